"""Atomic checkpoints of the learner, in the run's layout (DESIGN.md, "Checkpoint layout"):

    {ckpt_path}/global_step_{N}/actor/...          DeepSpeed checkpoint: model, optimizer, scheduler
    {ckpt_path}/global_step_{N}/critic/...         when there is a critic
    {ckpt_path}/global_step_{N}/client_state.bin   the coordinator's opaque bytes
    {ckpt_path}/global_step_{N}/learner.json       the marker: written (tmp + fsync + rename) last
    {ckpt_path}/global_step_{N}/coordinator.json   written by the coordinator afterwards
    {ckpt_path}/latest                             written by the coordinator, last of all

A learner checkpoint exists only when its marker does, and the marker is renamed into place after
every rank's files are written and fsynced. A crash at any earlier moment leaves a folder without
a marker, which loading ignores and the next save of a later step removes.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import time

from services.common import ownership
from services.common.durable import fsync_path, write_atomic

MARKER = ownership.CHECKPOINT_MARKER  # learner.json
CLIENT_STATE = "client_state.bin"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str | os.PathLike, global_step: int) -> pathlib.Path:
    return pathlib.Path(root) / f"global_step_{global_step}"


def fsync_tree(root: pathlib.Path) -> None:
    """fsyncs every file and folder under root (folders too, so new names are durable).

    Other ranks may be renaming their temporary files meanwhile; a name that vanished is skipped
    (its writer syncs the final file itself)."""
    for folder, _, files in os.walk(root):
        for path in [pathlib.Path(folder) / name for name in files] + [pathlib.Path(folder)]:
            try:
                fsync_path(path)
            except FileNotFoundError:
                continue


def is_complete(folder: pathlib.Path) -> bool:
    return (folder / MARKER).is_file()


def read_marker(folder: pathlib.Path) -> dict:
    return json.loads((folder / MARKER).read_text())


def list_steps(root: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """(step, folder) of every global_step_N folder under root, complete or not, ascending."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_named(root: pathlib.Path) -> pathlib.Path | None:
    """The folder the coordinator's `latest` file names ("global_step_N", "N" or a path), if any."""
    latest = root / "latest"
    if not latest.is_file():
        return None
    text = latest.read_text().strip()
    if text.isdigit():
        return step_dir(root, int(text))
    path = pathlib.Path(text)
    return path if path.is_absolute() else root / path


def resolve_checkpoint(root: pathlib.Path, global_step: int) -> pathlib.Path:
    """The complete checkpoint to load: global_step's, or (0) the newest complete one, preferring
    what `latest` names. Raises FileNotFoundError / ValueError with what was found."""
    if global_step > 0:
        folder = step_dir(root, global_step)
        if not folder.is_dir():
            have = [s for s, f in list_steps(root) if is_complete(f)]
            raise FileNotFoundError(f"{folder} does not exist; complete checkpoints under {root}: {have}")
        if not is_complete(folder):
            raise ValueError(f"{folder} is incomplete (no {MARKER}: the save did not finish); load another step")
        return folder
    named = latest_named(root)
    if named is not None and named.is_dir() and is_complete(named):
        return named
    complete = [f for _, f in list_steps(root) if is_complete(f)]
    if not complete:
        raise FileNotFoundError(f"no complete checkpoint under {root}")
    return complete[-1]


def prune(root: pathlib.Path, keep: int, newest: pathlib.Path) -> list[str]:
    """Removes checkpoints beyond the newest `keep` complete ones, and incomplete folders older than
    `newest` (left by crashed saves). Never removes the folder `latest` names, nor a folder the
    learner did not write (services.learner.ownership). Returns removed paths."""
    protected = {newest.resolve()}
    named = latest_named(root)
    if named is not None:
        protected.add(named.resolve())
    steps = list_steps(root)
    newest_step = next((s for s, f in steps if f.resolve() == newest.resolve()), None)
    complete = [f for _, f in steps if is_complete(f)]
    doomed = complete[:-keep] if keep > 0 else []
    doomed += [f for s, f in steps if not is_complete(f) and newest_step is not None and s < newest_step]
    removed = []
    for folder in doomed:
        if folder.resolve() in protected or not ownership.may_delete_step(folder):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    if removed:
        fsync_path(root)
    return removed


def marker_contents(world_size: int, zero_stage: int, models: list[str], global_step: int) -> bytes:
    return json.dumps({"global_step": global_step, "world_size": world_size, "zero_stage": zero_stage,
                       "models": models, "saved_at": time.time()}).encode()


def layout_differs(marker: dict, world_size: int, zero_stage: int) -> bool:
    """Whether the checkpoint of this marker was written under another ZeRO layout than this
    learner's (stage 0 is the same on any number of ranks)."""
    return marker["zero_stage"] != zero_stage or (zero_stage > 0 and marker["world_size"] != world_size)


def check_compatible(folder: pathlib.Path, world_size: int, zero_stage: int, models: list[str],
                     universal: bool = False) -> dict:
    """The marker of `folder` if this learner can load it; ValueError saying why not otherwise.
    universal (--use_ds_universal_ckpt): a checkpoint of another layout loads through DeepSpeed's
    universal checkpoint (services/learner/universal.py)."""
    marker = read_marker(folder)
    if layout_differs(marker, world_size, zero_stage):
        saved = (f"{folder} was saved with ZeRO stage {marker['zero_stage']} on {marker['world_size']} ranks; this "
                 f"learner runs stage {zero_stage} on {world_size}")
        if not universal:
            raise ValueError(f"{saved}: start it with the same --zero_stage and number of ranks, or with "
                             "--use_ds_universal_ckpt to convert the checkpoint to this layout")
        if 0 in (marker["zero_stage"], zero_stage):
            raise ValueError(f"{saved}: --use_ds_universal_ckpt converts between ZeRO stages 1, 2 and 3 only (a "
                             "stage-0 checkpoint loads under stage 0 on any number of ranks); start it with "
                             f"--zero_stage {marker['zero_stage']}")
    missing = [m for m in models if m not in marker["models"]]
    if missing:
        raise ValueError(f"{folder} has no {missing} state (it holds {marker['models']}); start the learner "
                         "with the same models it was saved with")
    return marker
