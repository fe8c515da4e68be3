"""The side of reward function calls that runs inside a worker process (see function_source.py).

    python -m services.reward.function_worker READ_FD WRITE_FD

A worker is a fresh interpreter that imports only this module (with verl_convention.py and the
OpenRLHF helpers that reward files import, services/common/openrlhf_compat.py) and the reward function: from its file, or by module and name for a function handed over in Python. It
answers calls over two pipes, each in its main thread, so that code which times out with SIGALRM (math-verify,
timeout_decorator, ...) works as it does in a script. Results travel back as plain Python (tensors
and arrays become lists), so the parent never depends on what the user's code imported. This
module imports nothing heavy, and the service's own modules are not imported again: a worker
starts in a fraction of a second plus the user's imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from services.common import openrlhf_compat
from services.reward import verl_convention

OPTIONAL_ARGUMENTS = ("responses", "sample_ids", "data_sources", "extra_infos")
_TRACEBACK_CHARS = 2000  # tail of a user traceback quoted in the error


class ImportProblem(Exception):
    """The reward function file cannot be used; the message says why and what to fix."""


FUNCTION_NAMES = ("reward_func", "compute_score")  # looked for in this order when the file names none


def split_file_target(target: str) -> tuple[str, str | None]:
    """"file.py" -> (file.py, None); "file.py:name" -> (file.py, name) (veRL's custom_reward_function.name)."""
    path, sep, name = target.rpartition(":")
    if sep and path.endswith(".py") and name.isidentifier():
        return path, name
    return target, None


def load_reward_func(target: str) -> Callable:
    """Imports the reward function of a Python file ("file.py", or "file.py:name" for another name).

    OpenRLHF's reward_func(queries, prompts, labels, **kwargs) is returned as it is; veRL's
    compute_score (one sample or a batch per call, see verl_convention.py) wrapped to that form.
    ImportProblem says what is missing.
    """
    path, name = split_file_target(target)
    file = pathlib.Path(path)
    if not file.is_file():
        raise ImportProblem(f"--remote_rm_url {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"rlmesh_reward_func_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    openrlhf_compat.install()  # OpenRLHF's helpers (openrlhf.utils.grade_answer, ...) for files written for it
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - any import failure of user code is a config problem
        raise ImportProblem(f"--remote_rm_url {path}: importing it failed: {type(exc).__name__}: {exc}") from exc
    found = vars(module)
    if name is not None:
        func = found.get(name)
        if not callable(func):
            raise ImportProblem(f"--remote_rm_url {target}: {path} defines no function {name}")
    else:
        func = next((found[n] for n in FUNCTION_NAMES if callable(found.get(n))), None)
        if func is None:
            raise ImportProblem(f"--remote_rm_url {path}: defines no function reward_func(queries, prompts, labels, "
                                "**kwargs) (OpenRLHF) or compute_score(data_source, solution_str, ground_truth, "
                                "extra_info) (veRL); name another one as FILE.py:NAME")
    if verl_convention.convention(func) != "openrlhf":
        return verl_convention.as_batch_reward_func(func, f"{path}:{func.__name__}")
    return func


def optional_arguments(func: Callable) -> list[str]:
    """Which of responses / sample_ids / data_sources / extra_infos the function takes (all of them with
    **kwargs)."""
    return verl_convention.accepted(func, OPTIONAL_ARGUMENTS)


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


def target_of(func: Callable | str) -> tuple:
    """How a worker finds the function: ("file", path) for a reward function file, ("module", name,
    qualname) or ("script", path, qualname) for a function defined at module level; ValueError else."""
    if isinstance(func, str):
        return ("file", func)
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", "")
    if not module or not qualname or "<" in qualname:  # <lambda>, <locals>
        raise ValueError(f"{qualname or func!r} is not defined at module level")
    if module != "__main__":
        return ("module", module, qualname)
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:  # python -m package.module
        return ("module", spec.name, qualname)
    if getattr(main, "__file__", None):  # python script.py
        return ("script", os.path.abspath(main.__file__), qualname)
    raise ValueError(f"{qualname} is defined in an interactive session, which a worker cannot import")


def load_target(target: tuple) -> Callable:
    if target[0] == "file":
        return load_reward_func(target[1])
    if target[0] == "module":
        namespace = vars(importlib.import_module(target[1]))
    else:  # a script: run it under another name, so that its `if __name__ == "__main__":` part stays out
        namespace = runpy.run_path(target[1], run_name="__rlmesh_reward_worker__")
    *outer, name = target[2].split(".")
    obj = namespace[outer[0]] if outer else namespace[name]
    for part in outer[1:] + ([name] if outer else []):
        obj = getattr(obj, part)
    return obj


def serve(receive: Connection, send: Connection) -> None:
    """Worker main: load the function the first message names, report ("ready", optional args), then
    answer calls.

    Each request is (queries, prompts, labels, kwargs); each reply is ("ok", plain result) or
    ("error", type name, message, traceback tail, gRPC status name or ""). A closed pipe (the
    service went away) ends the worker.
    """
    try:
        func = load_target(receive.recv())
        send.send(("ready", optional_arguments(func)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the start
        send.send(("failed", str(exc) if isinstance(exc, ImportProblem) else f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            queries, prompts, labels, kwargs = receive.recv()
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
            send.send(reply)
        except (BrokenPipeError, EOFError):
            return
        except Exception as exc:  # noqa: BLE001 - e.g. an answer that cannot be pickled
            send.send(("error", type(exc).__name__, f"its answer could not be sent back: {exc}", "", ""))


def exit_with_parent(interval_s: float = 1.0) -> None:
    """Ends this worker when the service that started it is gone (even killed, or while user code
    is stuck), since nothing else would: the worker is reparented, so its parent id changes."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


if __name__ == "__main__":
    # Ctrl-C in a terminal reaches the whole process group: the service stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
