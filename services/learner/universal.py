"""Resuming a checkpoint under another layout (--use_ds_universal_ckpt): other ranks, other ZeRO stage.

A ZeRO checkpoint holds each rank's shard of the flat optimizer partitions, so DeepSpeed loads it
only under the stage and the number of ranks that wrote it. DeepSpeed's universal checkpoint
(deepspeed/checkpoint/ds_to_universal.py) holds every parameter whole, with its Adam states, and an
engine loading it with `checkpoint.load_universal` cuts it into its own partitions. The learner
converts a checkpoint of another layout when it loads it, once, into the checkpoint's own folder
(pruned with it):

    global_step_N/universal/universal.json                       what was converted, from which layout
    global_step_N/universal/{actor,critic}/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt
    global_step_N/universal/{actor,critic}/zero/optimizer_state.pt
    global_step_N/universal/{actor,critic}/{mp_rank_00,zero_pp_rank_0_mp_rank_00}_model_states.pt

It is built in `global_step_N/.universal-tmp-<pid>/`, fsynced, and renamed to `universal/` last, so
it exists whole or not at all; a conversion killed half-way leaves a temporary folder that the next
one removes. The checkpoint's own files are only read.

DeepSpeed's converter writes what a ZeRO-1/2 source holds in the dialect of the ZeRO-1/2 loader and
what a ZeRO-3 source holds in that of the ZeRO-3 loader. `normalize` rewrites the result in the form
both loaders read, so that any stage 1-3 loads it: every state file a {"param": tensor} dict in the
parameter's shape, a step.pt beside each parameter, optimizer_state.pt with both the per-group list
(ZeRO-1/2) and the step and shared hyperparameters (ZeRO-3), and the engine's own state (its step
count, LR schedule) under the file name each stage looks for. ZeRO stage 0 has no partitions to
convert: its checkpoints already load on any number of ranks, but not under another stage.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import torch

from services.common.durable import fsync_path
from services.learner import checkpoint

FOLDER = "universal"
MARKER = "universal.json"
TMP_PREFIX = ".universal-tmp-"
ZERO1_STATES = "mp_rank_00_model_states.pt"  # the file names the two loaders glob for
ZERO3_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def prepare(step_folder: pathlib.Path, models: list[str]) -> pathlib.Path:
    """The universal form of step_folder's `models` (converted now unless an earlier load did)."""
    target = step_folder / FOLDER
    if (target / MARKER).is_file() and set(models) <= set(json.loads((target / MARKER).read_text())["models"]):
        return target
    for stale in step_folder.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = step_folder / f"{TMP_PREFIX}{os.getpid()}"
    tmp.mkdir()
    source = checkpoint.read_marker(step_folder)
    try:
        for name in models:
            convert(step_folder / name, tmp / name)
        (tmp / "latest_universal").unlink(missing_ok=True)  # the converter's; loads name their tag
        (tmp / MARKER).write_text(json.dumps({"models": models, "world_size": source["world_size"],
                                              "zero_stage": source["zero_stage"]}))
        checkpoint.fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():  # one without marker, or with fewer models: replaced whole
        shutil.rmtree(target)
    os.rename(tmp, target)
    fsync_path(step_folder)
    return target


def convert(source: pathlib.Path, out: pathlib.Path) -> None:
    """DeepSpeed's converter on one model's checkpoint (its own process: it prints, and its pools
    and module-level state stay out of the learner), then normalize."""
    workers = str(max(1, min(8, (os.cpu_count() or 2) // 2)))
    run = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
         "--output_folder", str(out), "--num_extract_workers", workers, "--num_merge_workers", workers,
         "--inject_missing_state"], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"converting {source} to DeepSpeed's universal checkpoint failed (exit {run.returncode}):"
                           f"\n{(run.stdout + run.stderr)[-3000:]}")
    normalize(out)


def normalize(folder: pathlib.Path) -> None:
    """Rewrites one converted model in the form the ZeRO-1/2 and the ZeRO-3 loaders both read."""
    states = folder / ZERO1_STATES if (folder / ZERO1_STATES).is_file() else folder / ZERO3_STATES
    engine_state = torch.load(states, map_location="cpu", weights_only=False)
    shapes = {name: shape for group in engine_state["param_shapes"] for name, shape in group.items()}
    zero = folder / "zero"
    optimizer = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=False)
    if "optimizer_state_dict" in optimizer:  # from ZeRO-3: every group's step is the same
        step = optimizer["optimizer_state_dict"]["state"][0]["step"]
    else:  # from ZeRO-1/2: one step.pt per parameter, all equal
        step = torch.load(next(zero.glob("*/step.pt")), weights_only=False)
    for name, shape in shapes.items():
        for key in STATE_KEYS:
            path = zero / name / f"{key}.pt"
            if not path.is_file():  # a parameter that never had a gradient has no Adam states
                continue
            value = torch.load(path, map_location="cpu", weights_only=False)
            if torch.is_tensor(value):  # ZeRO-3's converter writes bare flat tensors
                torch.save({"param": value.reshape(shape)}, path)
        if not (zero / name / "step.pt").is_file():
            torch.save(step, zero / name / "step.pt")
    groups = optimizer["param_groups"]
    # ZeRO-3's loader gives every group the first group's hyperparameters: only those all groups
    # share (weight decay is not shared: matrices only), so each group keeps its own for the rest.
    shared = {k: v for k, v in groups[0].items() if k != "params" and all(g.get(k) == v for g in groups)}
    optimizer["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": [shared]}
    optimizer.pop("fp32_flat_groups", None)  # rank 0's shard only, as written by ZeRO-3's converter
    optimizer.setdefault("ds_version", engine_state["ds_version"])  # ZeRO-1/2's loader requires it
    torch.save(optimizer, zero / "optimizer_state.pt")
    engine_state["module"] = {}  # the weights come from zero/; the loaders read the rest only
    for stale in folder.glob("*model_states.pt"):
        stale.unlink()
    for name in (ZERO1_STATES, ZERO3_STATES):
        torch.save(engine_state, folder / name)


def load(engine, folder: pathlib.Path, tag: str) -> dict:
    """Loads folder/tag (written by prepare) into engine: weights, optimizer, LR schedule, step;
    returns the client state saved with it."""
    groups = torch.load(folder / tag / "zero" / "optimizer_state.pt", weights_only=False)["param_groups"]
    if len(groups) != len(engine.optimizer.param_groups):
        raise ValueError(f"{folder / tag} has {len(groups)} optimizer parameter groups, this learner's {tag} has "
                         f"{len(engine.optimizer.param_groups)}: it was saved by another version of the learner; "
                         "resume it under the layout it was saved with")
    with _universal_loading(engine):
        load_path, client_state = engine.load_checkpoint(str(folder), tag=tag, load_module_strict=True)
    if load_path is None:
        raise FileNotFoundError(f"{folder / tag}: DeepSpeed found no universal checkpoint to load")
    # DeepSpeed's ZeRO-3 loader gives every parameter group one shared `step` tensor, which Adam
    # then advances once per group at each step (wrong bias correction from the second step on).
    for state in engine.optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    return client_state


@contextlib.contextmanager
def _universal_loading(engine):
    """DeepSpeed reads `checkpoint.load_universal` from the engine's config at each load; set for
    this load only, so a checkpoint of the learner's own layout still loads natively (bit for bit,
    no conversion)."""
    saved = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = saved
