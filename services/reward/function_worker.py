"""The side of reward function calls that runs inside a worker process (see function_source.py).

A worker imports the reward function once (from its file, or by reference for a function handed
over in Python), then answers calls over a pipe, each in the process's main thread, so that code
which times out with SIGALRM (math-verify, timeout_decorator, ...) works as it does in a script.
Results travel back as plain Python (tensors and arrays become lists), so the parent never depends
on what the user's code imported. This module imports nothing heavy: workers start fast.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import traceback
from collections.abc import Callable

OPTIONAL_ARGUMENTS = ("responses", "sample_ids", "data_sources")
_TRACEBACK_CHARS = 2000  # tail of a user traceback quoted in the error


class ImportProblem(Exception):
    """The reward function file cannot be used; the message says why and what to fix."""


def load_reward_func(path: str) -> Callable:
    """Imports `reward_func` from a Python file; ImportProblem says what is missing."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ImportProblem(f"--remote_rm_url {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"rlmesh_reward_func_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - any import failure of user code is a config problem
        raise ImportProblem(f"--remote_rm_url {path}: importing it failed: {type(exc).__name__}: {exc}") from exc
    func = vars(module).get("reward_func")
    if not callable(func):
        raise ImportProblem(f"--remote_rm_url {path}: defines no function reward_func(queries, prompts, labels, "
                            "**kwargs)")
    return func


def optional_arguments(func: Callable) -> list[str]:
    """Which of responses / sample_ids / data_sources the function takes (all of them with **kwargs)."""
    params = inspect.signature(func).parameters.values()
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params)
    names = {p.name for p in params}
    return [a for a in OPTIONAL_ARGUMENTS if takes_all or a in names]


def plain(value):
    """A reward function's answer as plain Python: tensors and arrays become (nested) lists of numbers.

    Torch tensors go through float(), as before the worker processes (a bool tensor is 0/1 rewards).
    """
    if hasattr(value, "detach") and hasattr(value, "float"):  # torch.Tensor, without importing torch here
        return value.detach().float().cpu().tolist()
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy arrays and numpy scalars
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def serve(conn, target) -> None:
    """Worker process main: load the function, report ("ready", optional args), then answer calls.

    target is a file path (str) or the function itself. Each request is (queries, prompts, labels,
    kwargs); each reply is ("ok", plain result) or ("error", type name, message, traceback tail,
    gRPC status name or "" ). A closed pipe (the service went away) ends the worker.
    """
    try:
        func = load_reward_func(target) if isinstance(target, str) else target
        conn.send(("ready", optional_arguments(func)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the start
        conn.send(("failed", str(exc) if isinstance(exc, ImportProblem) else f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            queries, prompts, labels, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", plain(func(queries, prompts, labels, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - user code may raise anything, SystemExit included
            code = getattr(exc, "code", None)
            status = code.name if hasattr(code, "name") and type(exc).__name__ == "ServiceError" else ""
            message = getattr(exc, "message", None) if status else None
            reply = ("error", type(exc).__name__, message or str(exc),
                     traceback.format_exc()[-_TRACEBACK_CHARS:], status)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. an answer that cannot be pickled
            conn.send(("error", type(exc).__name__, f"its answer could not be sent back: {exc}", "", ""))
