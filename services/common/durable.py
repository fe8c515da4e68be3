"""Durable file writes for checkpoints: a file or marker exists whole or not at all."""

import os
import pathlib


def fsync_path(path: pathlib.Path) -> None:
    """fsyncs a file or a folder (a folder's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: pathlib.Path, data: bytes | str) -> None:
    """tmp + fsync + rename + fsync of the folder: readers see the old file or the whole new one."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
