"""The ready file: how a process started with `--ready_file F` says that it serves, and where.

The process writes F once it serves (services.common.server for every service; the coordinator for
its control API): one JSON object, for a service {"service", "address", "port", "metrics_port",
"pid"}. It is written to F.tmp and renamed, so a reader never sees half of it.

Whoever started the process waits for F with `wait_for_ready_file` (or `wait_for_ready_file_async`
inside an event loop): the wait fails at once, quoting the end of the process's log, when the
process exits first, and names the file and the log when the time runs out. The fleet's launcher,
the tests and the benchmarks all wait this way.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import time


class ServiceStartError(RuntimeError):
    """A started process exited or did not become ready; the message quotes its log."""


def write_ready_file(path: str | os.PathLike, info: dict) -> None:
    """Writes info as JSON to path in one rename (a reader sees all of it or nothing)."""
    tmp = pathlib.Path(f"{path}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def log_tail(path: pathlib.Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file; "(no log)" when it cannot be read."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _check(path: pathlib.Path, process: subprocess.Popen, name: str, log_path: pathlib.Path | None,
           timeout_s: float, deadline: float, tail_lines: int) -> dict | None:
    """One look: the file's content once written; None while the process runs and time is left."""
    if path.exists():
        return json.loads(path.read_text())
    tail = f"; last lines of {log_path}:\n{log_tail(log_path, tail_lines)}" if log_path is not None else ""
    if process.poll() is not None:
        raise ServiceStartError(f"{name} exited with code {process.returncode} before it was ready{tail}")
    if time.monotonic() > deadline:
        raise ServiceStartError(f"{name} did not write its ready file {path} within {timeout_s:.0f} s{tail}")
    return None


def wait_for_ready_file(path: str | os.PathLike, process: subprocess.Popen, timeout_s: float, name: str = "",
                        log_path: str | os.PathLike | None = None, poll_s: float = 0.1,
                        tail_lines: int = 30) -> dict:
    """Blocks until `process` has written its ready file; returns what the file says.

    process: the started process (or the one that starts it), watched so that an early exit fails
    the wait at once. name: how the messages call it (default: the command). log_path: its output,
    quoted in ServiceStartError. The caller stops the process after a failure.
    """
    path, log = pathlib.Path(path), pathlib.Path(log_path) if log_path is not None else None
    name = name or _command(process)
    deadline = time.monotonic() + timeout_s
    while (info := _check(path, process, name, log, timeout_s, deadline, tail_lines)) is None:
        time.sleep(poll_s)
    return info


async def wait_for_ready_file_async(path: str | os.PathLike, process: subprocess.Popen, timeout_s: float,
                                    name: str = "", log_path: str | os.PathLike | None = None,
                                    poll_s: float = 0.1, tail_lines: int = 30) -> dict:
    """wait_for_ready_file without blocking the event loop (cancellable)."""
    path, log = pathlib.Path(path), pathlib.Path(log_path) if log_path is not None else None
    name = name or _command(process)
    deadline = time.monotonic() + timeout_s
    while (info := _check(path, process, name, log, timeout_s, deadline, tail_lines)) is None:
        await asyncio.sleep(poll_s)
    return info


def _command(process: subprocess.Popen) -> str:
    """The module of a `python -m module ...` process, else its pid."""
    args = [str(a) for a in process.args] if isinstance(process.args, (list, tuple)) else [str(process.args)]
    modules = [args[i + 1] for i in range(len(args) - 1) if args[i] == "-m"]
    return modules[0] if modules else f"process {process.pid}"
