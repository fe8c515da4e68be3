"""docs/reference/errors.md: every message a user error prints, with where it is raised.

Collected from the source with `ast`, so that every raise site counts, on any code path:

- user errors: each construction of a class of services.common.user_errors.USER_ERRORS (ConfigError,
  DatasetError, ServiceStartError, UserError) or of a subclass defined in services/; printed by
  `run_command` as "<kind>: <message>" with exit code 2;
- gRPC errors: `ServiceError(code, message)`, `invalid_argument(field, item, problem, fix)` and
  `failed_precondition(message)` (services/common/errors.py), returned to the caller as a status;
- exits: `raise SystemExit("message")` and `parser.error("message")`.

A message is its first string argument as written: an f-string's fields appear as `{expression}`
(long expressions as `{…}`). The options' value checks (`opt(..., check=...)`) are listed from the
typed configs: each check is called with values it must refuse and its answers are recorded.
Sites are named by file and function, not line, so that unrelated edits leave the page as it is.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import sys

from scripts.docgen import sources
from scripts.docgen.markdown import cell, code, page, table

GRPC_HELPERS = {"invalid_argument": "INVALID_ARGUMENT", "failed_precondition": "FAILED_PRECONDITION"}
LONG_FIELD = 28  # an f-string field longer than this shows as {…}


@dataclasses.dataclass(frozen=True)
class Message:
    kind: str  # "config error", "data error", "error", a gRPC status code name, "exit"
    text: str
    fix: str  # invalid_argument's fix; "" where the text holds it
    where: str  # "services/x.py: Class.method"


def template(node: ast.expr) -> str:
    """The message a string expression builds, fields shown as {expression}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(template(v) if isinstance(v, ast.Constant) else _field(v.value) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return template(node.left) + template(node.right)
    return _field(node)


def _field(node: ast.expr) -> str:
    text = ast.unparse(node)
    return "{" + (text if len(text) <= LONG_FIELD else "…") + "}"


def user_error_classes(trees: dict[str, ast.Module]) -> dict[str, str]:
    """Class name -> the kind its messages print with: USER_ERRORS's classes and their subclasses in services/."""
    from services.common.user_errors import USER_ERRORS

    kinds = {cls.__name__: word for cls, word in USER_ERRORS.items()}
    bases = {node.name: [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
             for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    changed = True
    while changed:
        changed = False
        for name, parents in bases.items():
            kind = next((kinds[p] for p in parents if p in kinds), None)
            if kind is not None and name not in kinds:
                kinds[name], changed = kind, True
    return kinds


def _message(call: ast.Call, called: str, classes: dict[str, str]) -> tuple[str, str, str] | None:
    """(kind, text, fix) of a call that builds a user-facing error, else None."""
    args = call.args
    if called in classes and args:
        return classes[called], template(args[0]), ""
    if called == "ServiceError" and len(args) >= 2:
        status = ast.unparse(args[0])
        kind = status.rsplit(".", 1)[-1] if status.startswith("grpc.StatusCode.") else "a status chosen at run time"
        return kind, template(args[1]), ""
    if called == "invalid_argument" and len(args) >= 4:
        item = f" of {template(args[1])}" if not (isinstance(args[1], ast.Constant) and args[1].value is None) else ""
        return GRPC_HELPERS[called], f"{template(args[0])}{item}: {template(args[2])}", template(args[3])
    if called == "failed_precondition" and args:
        return GRPC_HELPERS[called], template(args[0]), ""
    if called == "SystemExit" and args and not isinstance(args[0], (ast.Name, ast.Attribute)):
        return "exit", template(args[0]), ""
    if called == "error" and isinstance(call.func, ast.Attribute) and "parser" in ast.unparse(call.func) and args:
        return "usage error", template(args[0]), ""
    return None


def messages(trees: dict[str, ast.Module]) -> list[Message]:
    classes = user_error_classes(trees)
    found: set[Message] = set()
    for file, tree in trees.items():
        if file == "services/common/errors.py":
            continue  # the helpers' own formatting of what their callers give
        for node, scope in sources.walk_scoped(tree):
            if isinstance(node, ast.Call):
                called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                built = _message(node, called, classes)
                if built is not None:
                    found.add(Message(*built, sources.where(file, scope)))
    return sorted(found, key=lambda m: (m.kind, m.where, m.text))


# ---- the options' value checks ----------------------------------------------------------------

PROBES = {int: (0, -1, 2**40), float: (0.0, -1.0, 2.0, 1e9), list: ([], [1.0], [2.0, 2.0], [-1.0, 0.5]),
          str: ("", "x")}


def _config_files(trees: dict[str, ast.Module]) -> set[str]:
    """Files that declare checked options: they use services.common.flags, or call opt(..., check=...)."""
    found = set()
    for file, tree in trees.items():
        for node in ast.walk(tree):
            uses_flags = isinstance(node, ast.ImportFrom) and (node.module or "").startswith("services.common.flags")
            checked = isinstance(node, ast.Call) and any(k.arg == "check" for k in node.keywords) and \
                getattr(node.func, "id", "") == "opt"
            if uses_flags or checked:
                found.add(file)
                break
    return found - {"services/common/config.py"}


def checked_options(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    """`--option` -> what its check answers to values it refuses, over every typed config in services/."""
    for file in sorted(_config_files(trees)):
        importlib.import_module(file.removesuffix(".py").replace("/", "."))
    answers: dict[str, set[str]] = {}
    for module in [m for name, m in sorted(sys.modules.items()) if name.startswith("services.") and m]:
        for value in vars(module).values():
            if not (isinstance(value, type) and dataclasses.is_dataclass(value)):
                continue
            for f in dataclasses.fields(value):
                check = f.metadata.get("check")
                if check is None:
                    continue
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for probe in PROBES.get(type(default), ()):
                    answer = check(probe)
                    if answer:
                        answers.setdefault(f"--{f.name}", set()).add(answer)
    return {name: sorted(found) for name, found in sorted(answers.items())}


# ---- the page ----------------------------------------------------------------------------------

KIND_TITLES = {"config error": "Configuration errors (`config error: ...`, exit code 2)",
               "data error": "Data errors (`data error: ...`, exit code 2)",
               "error": "Start-up and connection errors (`error: ...`, exit code 2)",
               "exit": "Exits with a message", "usage error": "Usage errors (argparse, exit code 2)"}


def _section(kind: str, found: list[Message]) -> str:
    grpc = kind not in KIND_TITLES
    title = KIND_TITLES.get(kind) or ("gRPC status chosen at run time" if " " in kind else f"gRPC status {kind}")
    by_text: dict[tuple[str, str], list[str]] = {}
    for m in found:
        by_text.setdefault((m.text, m.fix), []).append(m.where)
    rows = []
    for (text, fix), wheres in sorted(by_text.items(), key=lambda item: (item[1][0], item[0])):
        row = [cell(text)] + ([cell(fix)] if kind == "INVALID_ARGUMENT" else [])
        rows.append(row + ["<br>".join(code(w) for w in sorted(set(wheres)))])
    header = ["Message"] + (["Fix"] if kind == "INVALID_ARGUMENT" else []) + ["Raised in"]
    count = f"{len(rows)} message{'s' if len(rows) != 1 else ''}."
    return f"## {title}\n\n{count}\n\n" + table(header, rows)


def render() -> str:
    trees = sources.trees()
    found = messages(trees)
    kinds = [k for k in KIND_TITLES if any(m.kind == k for m in found)]
    kinds += sorted({m.kind for m in found} - set(KIND_TITLES))
    sections = [_section(k, [m for m in found if m.kind == k]) for k in kinds]
    checks = checked_options(trees)
    rows = [[code(name), "<br>".join(cell(a) for a in answers)] for name, answers in checks.items()]
    sections.insert(1, "## Option values refused by their checks\n\nPrinted as `config error: --OPTION VALUE "
                    "<answer>`.\n\n" + table(["Option", "Answer"], rows))
    intro = ("Every message rlmesh prints for a problem the user fixes, found at its raise site in the code. A "
             "command prints a user error as `<kind>: <message>` without a traceback and exits with code 2 "
             "(`RLMESH_DEBUG=1` or `--debug` adds the traceback). Each message names what is wrong and what to "
             "change; `{…}` stands for the value filled in at run time. Services answer a bad request with a gRPC "
             "status and the same kind of message; INVALID_ARGUMENT names the field, the item and the fix. Options "
             "of OpenRLHF and veRL that rlmesh refuses are listed with their advice in [Commands and options]"
             "(cli.md).")
    return page("Error messages", intro, sections)
