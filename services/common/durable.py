"""Durable file writes for checkpoints: a file or marker exists whole or not at all."""

import os
import pathlib
from collections.abc import Callable


def fsync_path(path: pathlib.Path) -> None:
    """fsyncs a file or a folder (a folder's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: pathlib.Path, pid: int | str | None = None) -> pathlib.Path:
    """Where write_atomic writes `path` before renaming it: `.<name>.tmp-<pid>` beside it."""
    path = pathlib.Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid() if pid is None else pid}")


def write_atomic(path: pathlib.Path, data: bytes | str, before_rename: Callable[[], None] | None = None) -> None:
    """tmp + fsync + rename + fsync of the folder: readers see the old file or the whole new one.
    before_rename runs between the two (services/common/crash_points.py names that moment)."""
    path = pathlib.Path(path)
    tmp = temporary_name(path)
    with open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    fsync_path(path.parent)
