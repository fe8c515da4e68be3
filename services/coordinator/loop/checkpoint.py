"""The coordinator's half of a checkpoint: coordinator.json and the `latest` marker.

Layout (DESIGN.md):

    {ckpt_path}/global_step_{N}/actor/...          the learner writes these (SaveCheckpoint), with
    {ckpt_path}/global_step_{N}/critic/...         its marker learner.json last
    {ckpt_path}/global_step_{N}/coordinator.json   step, episode, data position, RNG, config digest
    {ckpt_path}/latest                             "global_step_{N}", renamed into place last

A checkpoint counts only once `latest` names it: the learner's files are complete when
SaveCheckpoint returns (learner.json in place), coordinator.json is fsynced after that, and `latest` is written last
through a temporary file, fsync and rename. A crash at any point leaves `latest` naming the
previous complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil

from services.common import ownership
from services.common.crash_points import crash_point
from services.common.durable import write_atomic

LATEST = "latest"
STATE_FILE = "coordinator.json"
FORMAT_VERSION = 1

# Flags whose change makes a resumed run a different experiment: a digest of them is stored and
# compared on resume (a mismatch is reported, not fatal, as OpenRLHF users sometimes do it on purpose).
DIGEST_FIELDS = ("pretrain", "prompt_data", "prompt_data_probs", "input_key", "label_key", "apply_chat_template",
                 "input_template", "rollout_batch_size", "n_samples_per_prompt", "train_batch_size",
                 "advantage_estimator", "seed", "max_samples", "prompt_max_len", "generate_max_len",
                 "init_kl_coef", "use_kl_loss", "kl_estimator", "actor_learning_rate", "temperature")


def step_dir(ckpt_path: str | os.PathLike, step: int) -> pathlib.Path:
    return pathlib.Path(ckpt_path) / f"global_step_{step}"


def config_digest(config) -> tuple[str, dict]:
    values = {name: getattr(config, name) for name in DIGEST_FIELDS}
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return digest, values


@dataclasses.dataclass
class CoordinatorState:
    """Everything the coordinator needs to continue a run exactly where it stopped."""

    global_step: int = 0
    episode: int = 1
    data_position: int = 0  # index of the next prompt within the episode's order
    prompts_consumed: int = 0
    samples_trained: int = 0
    weight_version: int = 0  # last version pushed to and verified on every engine
    kl_coef: float = 0.0  # current KL coefficient (adaptive controllers change it)
    # Every random choice of the coordinator (data order per episode, generation seeds per chunk,
    # the learner's shuffle seed) is derived from (seed, step, ...), so the seed is the RNG state.
    seed: int = 0
    run_dir: str = ""
    config_digest: str = ""
    config_values: dict = dataclasses.field(default_factory=dict)
    # The step's metrics as they stood when it was saved: a rerun in the same run folder whose
    # metrics.jsonl lacks the step (the coordinator died between the save and the log line) logs them
    # from here; a run resumed into another folder does not (the step did not run there).
    step_record: dict = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CoordinatorState:
        raw = json.loads(text)
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"coordinator.json format {raw.get('format_version')} is not {FORMAT_VERSION}; "
                             "it was written by another rlmesh version")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def commit(ckpt_path: str | os.PathLike, state: CoordinatorState, max_ckpt_num: int) -> pathlib.Path:
    """Writes coordinator.json into global_step_N (the learner's files must be complete), then
    moves `latest` to it, then removes checkpoints beyond the newest max_ckpt_num."""
    root = pathlib.Path(ckpt_path)
    folder = step_dir(root, state.global_step)
    ownership.make_owned_dir(folder, "checkpoint")  # the learner's save made it, unless it saves nothing
    write_atomic(folder / STATE_FILE, state.to_json())
    crash_point("coordinator.checkpoint.state_written")
    write_atomic(root / LATEST, f"global_step_{state.global_step}\n")
    crash_point("coordinator.checkpoint.latest_updated")
    prune(root, max_ckpt_num)
    crash_point("coordinator.checkpoint.pruned")
    return folder


def list_steps(ckpt_path: str | os.PathLike) -> list[int]:
    """Global steps that have a global_step_N folder, ascending (complete or not)."""
    steps = []
    for p in pathlib.Path(ckpt_path).glob("global_step_*"):
        suffix = p.name.removeprefix("global_step_")
        if p.is_dir() and suffix.isdigit():
            steps.append(int(suffix))
    return sorted(steps)


def prune(ckpt_path: str | os.PathLike, max_ckpt_num: int) -> list[int]:
    """Removes the oldest complete checkpoints beyond max_ckpt_num, and incomplete ones older than
    `latest` (a crash mid-save leaves those). Never touches `latest`'s own folder, nor a folder
    rlmesh did not write (services.common.ownership)."""
    latest = latest_step(ckpt_path)
    if latest is None:
        return []
    steps = list_steps(ckpt_path)
    complete = [s for s in steps if s <= latest and (step_dir(ckpt_path, s) / STATE_FILE).is_file()]
    doomed = set(complete[:-max_ckpt_num]) if len(complete) > max_ckpt_num else set()
    doomed |= {s for s in steps if s < latest and s not in complete}
    doomed = {s for s in doomed if ownership.may_delete_step(step_dir(ckpt_path, s))
              or (step_dir(ckpt_path, s) / STATE_FILE).is_file()}
    for s in sorted(doomed):
        shutil.rmtree(step_dir(ckpt_path, s), ignore_errors=True)
    # HF exports of --save_hf_ckpt live beside their step folder and go with it.
    for hf in pathlib.Path(ckpt_path).glob("global_step_*_hf"):
        step = hf.name.removeprefix("global_step_").removesuffix("_hf")
        if step.isdigit() and not step_dir(ckpt_path, int(step)).is_dir() and ownership.is_owned(hf):
            shutil.rmtree(hf, ignore_errors=True)
    return sorted(doomed)


def latest_step(ckpt_path: str | os.PathLike) -> int | None:
    """The step `latest` names, or None when there is no complete checkpoint."""
    marker = pathlib.Path(ckpt_path) / LATEST
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    suffix = text.removeprefix("global_step_")
    if not suffix.isdigit():
        raise ValueError(f"{marker}: unexpected content {text!r}; it should read global_step_N")
    return int(suffix)


def load_latest(ckpt_path: str | os.PathLike) -> CoordinatorState | None:
    """The state of the latest complete checkpoint, or None when there is none yet."""
    step = latest_step(ckpt_path)
    if step is None:
        return None
    path = step_dir(ckpt_path, step) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing although {pathlib.Path(ckpt_path) / LATEST} names step {step}; "
                                "the checkpoint folder was changed by hand - restore it or point `latest` "
                                "at an earlier global_step_N that has coordinator.json")
    state = CoordinatorState.from_json(path.read_text())
    if state.global_step != step:
        raise ValueError(f"{path} holds global_step {state.global_step}, but its folder says {step}")
    return state


def new_state(config, run_dir: str) -> CoordinatorState:
    digest, values = config_digest(config)
    return CoordinatorState(kl_coef=config.init_kl_coef, seed=config.seed, run_dir=run_dir,
                            config_digest=digest, config_values=values)
