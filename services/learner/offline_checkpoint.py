"""Resumable checkpoints of the offline trainers (SFT, reward model, DPO), in the RL learner's
layout and with its completeness rule (services.learner.checkpoint):

    {ckpt_path}/global_step_{N}/model/...        DeepSpeed checkpoint: weights, optimizer, LR schedule
    {ckpt_path}/global_step_{N}/learner.json     the marker, renamed into place after every file is fsynced
    {ckpt_path}/latest                           "global_step_N", written last

The trainer's own position travels in DeepSpeed's client state: the optimizer step, from which
the epoch and the batch follow (the data order is a function of --seed and the epoch), and the
RNG states, so a resumed run continues with the numbers the uninterrupted one would have used.
"""

from __future__ import annotations

import pathlib
import random

import torch

from services.common.durable import write_atomic
from services.common.log import get_logger, log_event
from services.learner import checkpoint, universal

_log = get_logger("offline")
TAG = "model"


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save(engine, root: pathlib.Path, step: int, rank: int, world: int, zero_stage: int, keep: int) -> pathlib.Path:
    """Writes global_step_{step} (every rank calls); complete once its marker exists."""
    folder = checkpoint.step_dir(root, step)
    if rank == 0:
        (folder / checkpoint.MARKER).unlink(missing_ok=True)  # a repeated save never looks complete early
        folder.mkdir(parents=True, exist_ok=True)
    _barrier()
    state = {"global_step": step, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
    engine.save_checkpoint(str(folder), tag=TAG, client_state=state, save_latest=False)
    _barrier()
    if rank == 0:
        checkpoint.fsync_tree(folder)
        write_atomic(folder / checkpoint.MARKER, checkpoint.marker_contents(world, zero_stage, [TAG], step))
        write_atomic(root / "latest", folder.name)
        removed = checkpoint.prune(root, keep, folder)
        log_event(_log, "checkpoint.saved", path=str(folder), step=step, removed=len(removed))
    _barrier()
    return folder


def load_latest(engine, root: pathlib.Path, world: int, zero_stage: int, universal_ok: bool = False) -> int:
    """Restores the newest complete checkpoint under root into engine; returns its step (0: none).
    universal_ok (--use_ds_universal_ckpt): one saved under another layout is converted first
    (services/learner/universal.py; rank 0 converts, the others wait at a barrier)."""
    try:
        folder = checkpoint.resolve_checkpoint(root, 0)
    except FileNotFoundError:
        log_event(_log, "checkpoint.none", path=str(root), note="--load_checkpoint: nothing to resume, starting anew")
        return 0
    try:
        marker = checkpoint.check_compatible(folder, world, zero_stage, [TAG], universal=universal_ok)
    except ValueError as exc:
        raise SystemExit(f"config error: --load_checkpoint: {exc}") from None
    if checkpoint.layout_differs(marker, world, zero_stage):
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            converted = universal.prepare(folder, [TAG])
            log_event(_log, "checkpoint.universal", path=str(converted), saved_ranks=marker["world_size"],
                      saved_zero_stage=marker["zero_stage"])
        _barrier()
        state = universal.load(engine, folder / universal.FOLDER, TAG)
    else:
        _, state = engine.load_checkpoint(str(folder), tag=TAG)
    if state is None:
        raise SystemExit(f"config error: --load_checkpoint: {folder} could not be loaded (see the log)")
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    log_event(_log, "checkpoint.loaded", path=str(folder), step=state["global_step"])
    return int(state["global_step"])
