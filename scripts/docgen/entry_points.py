"""Every command rlmesh ships, and a way to reach its argparse parser without running it.

A command is named as a user types it: `rlmesh train`, `python -m services.rollout`,
`deepspeed --module services.learner.train_sft`, `python bench/e2e_step.py`. `resolve` maps such
an argv to what Python runs for it: the module `python -m` runs (services.cli for `rlmesh`) or the
script file. `capture_parser` runs that as `__main__`, as Python would, with argparse's
`parse_args` replaced by one that stops the run with the parser in hand; `parse_only` lets
`parse_args` parse for real and stops the run right after it. So whatever a command does before
parsing runs (OpenRLHF 0.11 names translated, veRL overrides turned into flags, refused options
reported), and nothing after it (validation against files of this machine, the work itself).

The commands are found, not listed: every module of services/ with a module-level
`if __name__ == "__main__":` block, but those in NOT_COMMANDS, whose block is no command line; and
every script of bench/ and examples/ with such a block that builds its options with argparse or a
typed config (the others, children of benchmark runs, take positional files or nothing). A
services module that ends without reaching its parser is an error naming it, so a new entry point
cannot slip past the reference or the documentation check.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import io
import os
import pathlib
import runpy
import sys
import warnings

from scripts.docgen.sources import ROOT, trees

FOLDERS = ("services", "bench", "examples")
NOT_COMMANDS = {
    "services/common/config.py": "a library; its __main__ block only says so",
    "services/reward/function_worker.py": "the reward-function child process, started with two pipe descriptors",
}
# How a script of bench/ or examples/ shows that it parses options (see the module docstring).
PARSES_OPTIONS = ("ArgumentParser(", "parse_config(", "serve_reward_function(")


@functools.cache
def main_files() -> tuple[str, ...]:
    """The command files: services modules with a module-level `if __name__ == "__main__":` block,
    but NOT_COMMANDS; scripts of bench/ and examples/ with one that parse options."""
    found = []
    for folder in FOLDERS:
        for file, tree in trees(folder).items():
            if not any(isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) for node in tree.body):
                continue
            if folder == "services" or any(marker in (ROOT / file).read_text() for marker in PARSES_OPTIONS):
                found.append(file)
    return tuple(f for f in found if f not in NOT_COMMANDS)


def module_name(file: str) -> str:
    """services/rollout/__main__.py -> services.rollout; services/quickstart.py -> services.quickstart."""
    parts = pathlib.PurePosixPath(file).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__main__" else parts)


def commands() -> list[str]:
    """Every command as typed: `rlmesh NAME` for each subcommand, then `python -m MODULE` for each
    services module, then `python FILE` for each script of bench/ and examples/."""
    from services.cli import COMMANDS, SERVICES

    names = [f"rlmesh {name}" for name in COMMANDS] + [f"rlmesh serve {s}" for s in SERVICES]
    names += [f"python -m {module_name(f)}" for f in main_files()
              if f.startswith("services/") and module_name(f) != "services.cli"]
    names += [f"python {f}" for f in main_files() if not f.startswith("services/")]
    return names


@dataclasses.dataclass(frozen=True)
class Target:
    """What an argv runs: `module` as `python -m` runs it, or the script `script`, with `argv`."""

    command: str  # how the user typed it, up to the arguments: "rlmesh", "python -m services.rollout"
    argv: tuple[str, ...]
    module: str = ""
    script: str = ""


def resolve(tokens: list[str]) -> Target | None:
    """The command an argv runs (`rlmesh ...`, `python -m M ...`, `deepspeed --module M ...`, any
    launcher with `-m M`, `python path.py ...`); None when it runs no file of the repository.
    LookupError for a module or script of the repository that is not a command."""
    if not tokens:
        return None
    if tokens[0] == "rlmesh":
        return Target("rlmesh", tuple(tokens[1:]), module="services.cli")
    modules = {module_name(f): f for f in main_files()}
    for i, token in enumerate(tokens[:-1]):
        if token in ("-m", "--module") and tokens[i + 1].split(".")[0] in FOLDERS:
            name = tokens[i + 1]
            if name not in modules:
                raise LookupError(f"no module {name} runs as a command (a services module with a __main__ block)")
            command = "rlmesh" if name == "services.cli" else f"python -m {name}"
            return Target(command, tuple(tokens[i + 2:]), module=name)
    if pathlib.PurePosixPath(tokens[0]).name.startswith("python") and len(tokens) > 1 and tokens[1].endswith(".py"):
        script = pathlib.PurePosixPath(tokens[1]).as_posix().removeprefix("./")
        if script.split("/")[0] not in FOLDERS:
            return None
        if not (ROOT / script).is_file():
            raise LookupError(f"{script}: no such file in the repository")
        if script not in main_files():
            return None  # a script without options of its own: only its existence can be checked
        return Target(f"python {script}", tuple(tokens[2:]), script=script)
    return None


class _Stop(BaseException):
    """Ends a command's run at its parser: the parser (when known), and the namespace when it parsed.
    A BaseException, so that a command's own `except Exception` does not catch it."""

    def __init__(self, parser: argparse.ArgumentParser | None, namespace: argparse.Namespace | None):
        super().__init__("stopped at parse_args")
        self.parser, self.namespace = parser, namespace


@contextlib.contextmanager
def _stopping_at_parse(parse: bool):
    """parse=False: the first parse_known_args (parse_args calls it too) stops the run with its parser.
    parse=True: parse_args parses, then stops; a typed config's parse_config stops where parsing is
    done and validation starts (config_from_args), after its own checks of the options."""
    from services.common import config

    real_parse, real_known, real_exit, real_from_args = (argparse.ArgumentParser.parse_args,
                                                          argparse.ArgumentParser.parse_known_args, os._exit,
                                                          config.config_from_args)
    program = getattr(config, "PROGRAM", "")  # `rlmesh` sets the program name of usage lines

    def parse_then_stop(self, args=None, namespace=None):
        raise _Stop(self, real_parse(self, args, namespace))

    def stop_unparsed(self, args=None, namespace=None):
        raise _Stop(self, None)

    def stop_before_validation(cls, namespace):
        raise _Stop(None, namespace)

    def exit_without_teardown(code):  # services end with os._exit; here that ends the run only
        raise SystemExit(code)

    if parse:
        argparse.ArgumentParser.parse_args, config.config_from_args = parse_then_stop, stop_before_validation
    else:
        argparse.ArgumentParser.parse_known_args = stop_unparsed
    os._exit = exit_without_teardown
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real_parse, real_known
        os._exit, config.config_from_args, config.PROGRAM = real_exit, real_from_args, program


def _run(target: Target) -> int:
    """Runs the target as `__main__` with its argv; its exit code when it ends without stopping."""
    saved = sys.argv, list(sys.path)
    sys.argv = [target.script or target.module, *target.argv]
    if target.script:  # as `python FILE` does: the script's folder first on the path
        sys.path.insert(0, str((ROOT / target.script).parent))
    try:
        if target.script:
            runpy.run_path(str(ROOT / target.script), run_name="__main__")
        else:
            runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved
    return 0


@contextlib.contextmanager
def _quiet(err: io.StringIO):
    """The command's stdout, stderr and warnings kept out of the caller's output; the environment
    restored (--debug sets RLMESH_DEBUG)."""
    env = dict(os.environ)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        os.environ.clear()
        os.environ.update(env)


def capture_parser(tokens: list[str]) -> argparse.ArgumentParser:
    """The parser the command `tokens` (a command without options) builds; nothing of it runs after that."""
    target = resolve(tokens)
    if target is None:
        raise LookupError(f"{' '.join(tokens)}: not an rlmesh command")
    err = io.StringIO()
    with _stopping_at_parse(parse=False), _quiet(err):
        try:
            code = _run(target)
        except _Stop as stop:
            return stop.parser
    raise RuntimeError(f"`{' '.join(tokens)}` ended (exit {code}) without building an argparse parser; if it is no "
                       f"command line, add it to NOT_COMMANDS in scripts/docgen/entry_points.py\n{err.getvalue()}")


@dataclasses.dataclass
class Parsed:
    ok: bool
    message: str  # the command's own error when not ok
    parser: argparse.ArgumentParser | None = None
    namespace: argparse.Namespace | None = None


def parse_only(target: Target) -> Parsed:
    """Parses target.argv as the command does, without running it. Not ok: argparse's error, a
    user error (a refused option, a veRL key without a counterpart) or a non-zero exit before parsing."""
    from services.common.user_errors import describe, is_user_error

    err = io.StringIO()
    try:
        with _stopping_at_parse(parse=True), _quiet(err):
            code = _run(target)
    except _Stop as stop:
        return Parsed(True, "", stop.parser, stop.namespace)
    except Exception as exc:  # noqa: BLE001 - the command's failure is the answer
        return Parsed(False, describe(exc) if is_user_error(exc) else f"{type(exc).__name__}: {exc}")
    if code == 0 and (not target.argv or {"-h", "--help"} & set(target.argv)):
        return Parsed(True, "")  # usage printed without a parser (`rlmesh`, `rlmesh --help`)
    return Parsed(False, last_error(err.getvalue()) or f"exited {code} before parsing its options")


def last_error(output: str) -> str:
    """The error lines of a command's output (argparse's `prog: error: ...`, `config error: ...`), else
    its first line."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error: " in line]
    return "\n".join(errors) if errors else (lines[0] if lines else "")
