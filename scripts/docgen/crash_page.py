"""docs/reference/crash-points.md: every crash point and hold point, where it fires and what it is for.

The points and what each is for come from the tables services.common.crash_points.POINTS and
services.common.hold_points.POINTS; where each fires is every call `crash_point("NAME")` /
`hold("NAME", ...)` in services/, found in the source with `ast`, named by file and function.
"""

from __future__ import annotations

import ast
import inspect

from scripts.docgen import sources
from scripts.docgen.markdown import cell, code, page, table


def call_sites(function: str) -> dict[str, list[str]]:
    """point name -> ["services/x.py: Class.method", ...] for each call function("point", ...) in services/."""
    sites: dict[str, set[str]] = {}
    for file, tree in sources.trees().items():
        for node, scope in sources.walk_scoped(tree):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                if called == function and isinstance(node.args[0].value, str):
                    sites.setdefault(node.args[0].value, set()).add(sources.where(file, scope))
    return {name: sorted(places) for name, places in sites.items()}


def points_table(points: dict[str, str], sites: dict[str, list[str]]) -> str:
    rows = []
    for name in sorted(points):
        where = "<br>".join(code(w) for w in sites.get(name, [])) or "no call site"
        rows.append([code(name), where, cell(points[name])])
    return table(["Point", "Fires in", "What it is for"], rows)


def _docstring(module) -> str:
    return inspect.cleandoc(module.__doc__ or "")


def render() -> str:
    from services.common import crash_points, hold_points

    crash_sites, hold_sites = call_sites("crash_point"), call_sites("hold")
    unknown = sorted(set(crash_sites) - set(crash_points.POINTS)) + sorted(set(hold_sites) - set(hold_points.POINTS))
    if unknown:
        raise SystemExit(f"points called but not declared in the POINTS tables: {unknown}")
    crash = (f"## Crash points\n\n{_docstring(crash_points)}\n\nIn `services/common/crash_points.py`; "
             f"{len(crash_points.POINTS)} points. Each says what a kill at that moment leaves behind and how the "
             "run gets over it.\n\n" + points_table(crash_points.POINTS, crash_sites))
    hold = (f"## Hold points\n\n{_docstring(hold_points)}\n\nIn `services/common/hold_points.py`; "
            f"{len(hold_points.POINTS)} points.\n\n" + points_table(hold_points.POINTS, hold_sites))
    intro = ("Test-only switches, off unless their environment variable is set: a crash point kills the process "
             "that reaches it (SIGKILL, as a power cut would), a hold point stops a call there until the test lets "
             "it go. The chaos and recovery tests (tests/chaos/) use them to fail a run at every step of its "
             "protocols.")
    return page("Crash and hold points", intro, [crash, hold])
