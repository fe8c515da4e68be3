"""Where the learner (and the coordinator's checkpoint pruning) may write and delete: only in folders
rlmesh created, or that carry its marker.

SaveCheckpoint and ExportHF take paths from the network. Without this rule a caller could point
them at any folder the learner's user can write to: ExportHF used to swap the whole folder for the
export (deleting what was there), and checkpoint pruning removed any `global_step_*` folder it
found. Now every folder the learner creates gets a marker file (`.rlmesh-learner`); an existing
folder is used only when it is marked, empty (it is then marked), or, for a checkpoint root,
already holds a complete checkpoint of this learner's format (a run from before the marker
existed). Anything else is refused with FAILED_PRECONDITION before a byte is written. Pruning
deletes only marked or complete `global_step_*` folders; an export replaces only the files the
previous export into that folder wrote (listed in the marker) and refuses to overwrite others.

A folder is made under a temporary name, marked, and renamed into place, so a kill never leaves
it in place unmarked; the next creation removes such temporary folders. A folder left holding only
the marker's temporary file (`..rlmesh-learner.tmp-<pid>`, durable.write_atomic; learners before
the rename did that when killed at that moment) is the learner's own, unfinished: the next save
adopts it and writes it anew. Anything else in it still makes it foreign.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time

from services.common.crash_points import crash_point
from services.common.durable import fsync_path, temporary_name, write_atomic
from services.common.errors import failed_precondition

OWNER_MARKER = ".rlmesh-learner"
# The marker of a complete learner checkpoint (services/learner/checkpoint.py writes it last); the
# one definition, also for the coordinator's checkpoint pruning.
CHECKPOINT_MARKER = "learner.json"


def is_owned(folder: pathlib.Path) -> bool:
    return (pathlib.Path(folder) / OWNER_MARKER).is_file()


def read_marker(folder: pathlib.Path) -> dict:
    try:
        return json.loads((pathlib.Path(folder) / OWNER_MARKER).read_text())
    except (OSError, ValueError):
        return {}


def is_unfinished(folder: pathlib.Path) -> bool:
    """A folder the learner created and was killed before marking: it holds nothing but temporary
    files of the owner marker (the learner writes nothing else into a folder before marking it)."""
    folder = pathlib.Path(folder)
    if not folder.is_dir() or is_owned(folder):
        return False
    names = [p.name for p in folder.iterdir()]
    return bool(names) and all(_is_temporary_marker(folder, n) for n in names)


def _is_temporary_marker(folder: pathlib.Path, name: str) -> bool:
    prefix = temporary_name(folder / OWNER_MARKER, "").name
    return name.startswith(prefix) and name[len(prefix):].isdigit()


def _mark(folder: pathlib.Path, purpose: str, **extra) -> None:
    write_atomic(folder / OWNER_MARKER, json.dumps({"written_by": "rlmesh learner", "purpose": purpose,
                                                    "pid": os.getpid(), "unix_time": time.time(), **extra}),
                 before_rename=lambda: crash_point("learner.checkpoint.folder_marking") if purpose == "checkpoint"
                 else None)


def _adopt_unfinished(folder: pathlib.Path, purpose: str) -> None:
    """Replaces the temporary markers of an unfinished folder of the learner's by a marker."""
    for stale in folder.iterdir():
        stale.unlink(missing_ok=True)
    _mark(folder, purpose)


def make_owned_dir(path: pathlib.Path, purpose: str) -> None:
    """Creates path and its missing parents, each with its marker already inside: a folder is made
    under a temporary name (`.<name>.tmp-<pid>`), marked, and renamed into place, so a kill never
    leaves it unmarked. An unfinished folder of the learner's at path (see is_unfinished) is marked."""
    path = pathlib.Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    if not missing and is_unfinished(path):
        _adopt_unfinished(path, purpose)  # an earlier learner was killed while marking it
    for folder in reversed(missing):
        _drop_unfinished_temporaries(folder)
        tmp = temporary_name(folder)
        tmp.mkdir()
        if purpose == "checkpoint":
            crash_point("learner.checkpoint.folder_created")
        _mark(tmp, purpose)
        os.rename(tmp, folder)
        fsync_path(folder.parent)


def _drop_unfinished_temporaries(folder: pathlib.Path) -> None:
    """Removes what killed learners left while creating `folder`: temporary folders of its name
    holding nothing but owner markers (finished or not)."""
    prefix = temporary_name(folder, "").name
    for tmp in folder.parent.glob(f"{prefix}*"):
        if tmp.is_dir() and tmp.name[len(prefix):].isdigit() and \
                all(p.name == OWNER_MARKER or _is_temporary_marker(tmp, p.name) for p in tmp.iterdir()):
            shutil.rmtree(tmp, ignore_errors=True)


def _holds_checkpoints(root: pathlib.Path) -> bool:
    return any(child.name.startswith("global_step_") and (child / CHECKPOINT_MARKER).is_file()
               for child in root.iterdir())


def claim_dir(path: str | os.PathLike, field: str, purpose: str, checkpoint_root: bool = False) -> pathlib.Path:
    """Makes sure the learner may write into `path` (the request field `field`): creates it when
    missing, adopts it when empty, accepts it when marked (or, with checkpoint_root, when it holds
    a complete checkpoint); raises FAILED_PRECONDITION naming the folder and the fix otherwise."""
    folder = pathlib.Path(path)
    if folder.exists() and not folder.is_dir():
        raise failed_precondition(f"{field} {folder} is a file, not a folder; give a folder path")
    if not folder.exists():
        make_owned_dir(folder, purpose)
        return folder
    if is_owned(folder):
        return folder
    if is_unfinished(folder):
        _adopt_unfinished(folder, purpose)
        return folder
    entries = sorted(p.name for p in folder.iterdir())
    if not entries or (checkpoint_root and _holds_checkpoints(folder)):
        _mark(folder, purpose)
        return folder
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    raise failed_precondition(
        f"{field} {folder} holds files the learner did not write ({shown}); it writes and deletes only in folders "
        f"it created (they carry {OWNER_MARKER}) or empty ones: give a new or empty folder, or move those files "
        "away; nothing was written or deleted")


def check_step_dir(folder: pathlib.Path, field: str) -> None:
    """A global_step_N folder a save would reuse must be this learner's: marked, complete, or left
    unfinished by a learner killed while marking it (nothing but the marker's temporary file)."""
    if folder.exists() and not may_delete_step(folder):
        raise failed_precondition(
            f"{field}: {folder} exists and was not written by the learner (no {OWNER_MARKER} or "
            f"{CHECKPOINT_MARKER}); save into another --ckpt_path or move that folder away; nothing was written "
            "or deleted")


def may_delete_step(folder: pathlib.Path) -> bool:
    """Pruning removes a global_step_N folder only when the learner wrote it."""
    return is_owned(folder) or (folder / CHECKPOINT_MARKER).is_file() or is_unfinished(folder)


def export_files(folder: pathlib.Path) -> list[str]:
    """The names the last export into folder wrote."""
    return list(read_marker(folder).get("export_files", []))


def record_export(folder: pathlib.Path, names: list[str]) -> None:
    marker = read_marker(folder)
    marker.pop("export_files", None)
    _mark(folder, marker.pop("purpose", "export"), **{k: v for k, v in marker.items()
                                                       if k not in ("written_by", "pid", "unix_time")},
          export_files=sorted(names))
