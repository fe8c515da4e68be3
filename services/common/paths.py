"""Paths the user gives are read against the user's working directory, once, at start-up.

The services that a run starts do not share the user's working directory (local placement starts
them in the repository root; Ray actors run wherever Ray puts them), so every path flag is made
absolute while the configuration is validated, and only absolute paths travel on. A relative
path therefore means the same folder to the coordinator, every service and every log line.

The base is the working directory, or $RLMESH_WORKDIR when set. Under `ray job submit` with a
`working_dir`, the driver runs inside Ray's copy of that folder, which Ray deletes when the job
ends: relative inputs (models, data) are kept relative there, since every Ray worker of the job
runs in the same copy; a relative output (checkpoints, the final model, the run folder) would be
lost with the copy, so it is a ConfigError unless $RLMESH_WORKDIR names where outputs belong (set it
in the runtime env's env_vars, e.g. to the folder given as working_dir, on storage every node sees).
"""

from __future__ import annotations

import os
import pathlib

from services.common.config import ConfigError

WORKDIR_ENV = "RLMESH_WORKDIR"


def in_ray_working_dir_copy(cwd: str | os.PathLike | None = None) -> bool:
    """True when cwd is a Ray job's unpacked working_dir (…/runtime_resources/working_dir_files/…)."""
    parts = pathlib.PurePath(cwd or os.getcwd()).parts
    return "runtime_resources" in parts and "working_dir_files" in parts


def _base() -> pathlib.Path:
    return pathlib.Path(os.environ.get(WORKDIR_ENV) or os.getcwd())


def absolute_path(value: str, flag: str, output: bool = False) -> str:
    """value made absolute against the working directory ("" and URLs unchanged; ~ expanded).

    output: the path is written to (see the module docstring for Ray working_dir copies).
    """
    if not value or "://" in value:
        return value
    path = pathlib.Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    if in_ray_working_dir_copy() and not os.environ.get(WORKDIR_ENV):
        if not output:
            return value  # every worker of the job runs in the same copy
        raise ConfigError(f"--{flag} {value} is relative, and this Ray job runs in Ray's temporary copy of its "
                          f"working_dir ({os.getcwd()}), deleted when the job ends; give an absolute path on storage "
                          f"every node sees, or set {WORKDIR_ENV} in the runtime env's env_vars to the folder "
                          "relative outputs belong in")
    return os.path.normpath(_base() / path)


def absolute_paths(value: str, flag: str, output: bool = False) -> str:
    """A comma-separated list of paths (e.g. --prompt_data a.jsonl,b.jsonl), each made absolute."""
    if not value:
        return value
    return ",".join(absolute_path(part.strip(), flag, output) for part in value.split(",") if part.strip())


def resolve_path_fields(config, inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = ()) -> None:
    """Makes the named string fields of `config` absolute (comma-separated lists item by item)."""
    for names, output in ((inputs, False), (outputs, True)):
        for name in names:
            setattr(config, name, absolute_paths(getattr(config, name), name, output))
