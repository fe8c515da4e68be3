"""The names a user's Python file defines (a reward function file, an agent file), read with ast:
nothing in it is run. The dry runs check that a file defines what would be called before anything
starts (services/coordinator/cli/dry_run.py, services/reward/dry_run.py)."""

from __future__ import annotations

import ast
import pathlib


def defined_names(path: str) -> set[str]:
    """Functions (sync or async) and classes defined anywhere in the file."""
    tree = ast.parse(pathlib.Path(path).read_text(), filename=path)
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
