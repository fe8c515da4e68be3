"""The repository's Python sources, parsed once for the pages that read code with `ast`."""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


@functools.cache
def trees(folder: str = "services") -> dict[str, ast.Module]:
    """Repository-relative path -> parsed module, for every .py file under folder."""
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(), str(p))
            for p in sorted((ROOT / folder).rglob("*.py"))}


def walk_scoped(tree: ast.Module):
    """(node, enclosing function / class names) for every node of tree."""
    stack = [(tree, ())]
    while stack:
        node, scope = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = (*scope, node.name)
        yield node, scope
        stack.extend((child, scope) for child in ast.iter_child_nodes(node))


def where(file: str, scope: tuple[str, ...]) -> str:
    """How a page names a place in the code: file and function, no line (which every edit moves)."""
    return f"{file}: {'.'.join(scope) or 'module level'}"


def portable(text: str) -> str:
    """text without this machine's paths: the checkout's folder (made relative) and the home folder (~)."""
    return text.replace(str(ROOT) + "/", "").replace(str(ROOT), ".").replace(str(pathlib.Path.home()), "~")
