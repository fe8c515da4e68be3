"""Named hold points: a test-only switch that stops a service's call at a chosen moment until the
test lets it go, so that a test can act "while step 3 trains" or "while rollout-0 generates step 1"
however fast or slow the machine is, instead of polling for a window that a loaded machine can miss.

    RLMESH_HOLD_AT="<point>[@<who>][:<call>][#<n>][,<point>...]"   (as RLMESH_CRASH_AT, and:)
        call   only where the point is reached for this call: its request id, or the id followed by
               "-" and more ("step3" matches "step3" and "step3-9f2c", not "step30")
    RLMESH_HOLD_DIR=<folder>

When a process reaches an entry, it creates <folder>/held-<entry> (exclusively: each entry holds
once over all processes, so a restarted service goes through), then waits, without blocking its
other calls, until <folder>/release-<entry> exists. A test waits for the first file, does what it
came to do (kill the process, kill the coordinator, scale), and writes the second (or not, when the
held process is gone). With RLMESH_HOLD_AT unset, hold() returns at its first line.
"""

from __future__ import annotations

import asyncio
import os
import pathlib

from services.common.crash_points import Entry, claim_file, parse_entries

POINTS: dict[str, str] = {
    "rollout.generate.started": "a rollout engine logged generate.start for a Generate call (call: its request id) "
                                "and has produced no sample of it",
    "rollout.generate.finished": "a rollout engine sent the last sample of a Generate call (call: its request id) "
                                 "and has not ended the call",
    "learner.train.started": "the learner took TrainActor (call: its request id, 'step<N>') and has not begun "
                             "the first micro-batch",
}

_PLAN = parse_entries("RLMESH_HOLD_AT", POINTS, calls=True) or None
_DIR = pathlib.Path(os.environ.get("RLMESH_HOLD_DIR", "."))
if _PLAN is not None and not os.environ.get("RLMESH_HOLD_DIR"):
    raise SystemExit("RLMESH_HOLD_AT needs RLMESH_HOLD_DIR: the folder where held-/release- files are written")


def _held(name: str, call: str) -> Entry | None:
    if _PLAN is None:
        return None
    if name not in POINTS:
        raise ValueError(f"hold({name!r}): not in services.common.hold_points.POINTS; add it there")
    return next((e for e in _PLAN if e.reached(name, call) and claim_file(_DIR, e, "held-")), None)


def _release_file(entry_text: str) -> pathlib.Path:
    return _DIR / ("release-" + entry_text.replace("/", "_"))


async def hold(name: str, call: str = "") -> None:
    """Waits at `name` for `call` until the test releases it, where the switch names this moment;
    otherwise returns at once. The event loop goes on serving the process's other calls."""
    entry = _held(name, call)
    while entry is not None and not _release_file(entry.text).exists():
        await asyncio.sleep(0.02)

