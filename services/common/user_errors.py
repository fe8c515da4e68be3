"""User errors: what a person must change (a flag, a config file, a data file, an address) is
reported as its message alone, without a Python traceback.

Every command's entry point runs its main() through `run_command`: an error of a class in
USER_ERRORS is printed as "<kind>: <message>" on stderr (e.g. "data error: train.jsonl: no usable
rows: ...; fix ...") and the command exits with code 2; any other exception is a bug and keeps its
traceback. With RLMESH_DEBUG=1 in the environment, or --debug anywhere on the command line, a user
error is printed with its traceback too. --debug is taken off the command line and turned into
RLMESH_DEBUG=1, so the processes a command starts (services, other ranks) inherit it.

A command that catches a failure itself after its run has started (the coordinator stops its
services and exits 1) asks `describe` / `debug_enabled` to print the same way.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, Sequence

from services.common.config_error import DEBUG_ENV, ConfigError, debug_enabled
from services.common.datasets import DatasetError
from services.common.ready_file import ServiceStartError

DEBUG_FLAG = "--debug"
USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """Base of errors the user fixes that have no more specific class (e.g. an address where no
    service answers); the message says what to change."""


class ServiceUnreachable(UserError, TimeoutError):
    """No service answered at an address within the wait; a TimeoutError for callers that catch those."""


# error class -> the word printed before its message; the first match (in this order) wins.
USER_ERRORS: dict[type[BaseException], str] = {
    ConfigError: "config error",
    DatasetError: "data error",
    ServiceStartError: "error",  # its message quotes the service's own log (with its traceback, if any)
    UserError: "error",
}



def take_debug_flag(argv: Sequence[str]) -> list[str]:
    """argv without --debug; a --debug that was there sets RLMESH_DEBUG=1 for this process and its children."""
    rest = [a for a in argv if a != DEBUG_FLAG]
    if len(rest) != len(argv):
        os.environ[DEBUG_ENV] = "1"
    return rest


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, tuple(USER_ERRORS))


def describe(exc: BaseException) -> str:
    """"<kind>: <message>" of a user error (the message as the error's class wrote it)."""
    kind = next(word for cls, word in USER_ERRORS.items() if isinstance(exc, cls))
    return f"{kind}: {exc}"


def report(exc: BaseException, stream=None) -> None:
    """Prints a user error: its message, after its traceback with debugging on."""
    stream = stream or sys.stderr
    if debug_enabled():
        traceback.print_exception(exc, file=stream)
    print(describe(exc), file=stream, flush=True)


def run_command(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Runs an entry point's main(argv) and returns its exit code; a user error is reported
    (see the module docstring) and gives USER_ERROR_EXIT_CODE. Other exceptions pass through."""
    argv = take_debug_flag(sys.argv[1:] if argv is None else argv)
    try:
        return main(argv) or 0
    except tuple(USER_ERRORS) as exc:
        report(exc)
        return USER_ERROR_EXIT_CODE
