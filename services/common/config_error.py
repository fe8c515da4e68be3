"""The error a user fixes by changing a setting, and the switch that keeps its traceback.

Its own module so that the config parser, the OpenRLHF name table and the command runner
(services/common/user_errors.py) can all raise or test it without importing each other.
"""

import os

DEBUG_ENV = "RLMESH_DEBUG"


class ConfigError(ValueError):
    """A configuration problem; the message says what to change."""


def debug_enabled() -> bool:
    """Whether user errors keep their traceback: RLMESH_DEBUG set to anything but "" or "0"."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")
