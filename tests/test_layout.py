"""The import rules of services/, checked on the code's own imports (read with `ast`, nothing imported).

1. A service package (rollout, reward, learner, coordinator) imports of another service only that
   service's declared client API (CLIENT_API; each package's __init__ docstring says the same).
2. services/common imports no service: it sits below all of them.
3. No import circles among the modules under services/ (imports run at import time: module level,
   class bodies, not function bodies nor `if TYPE_CHECKING:` blocks).
4. The coordinator's rooms, as services/coordinator/__init__.py states them: loop/ imports nothing
   of fleet/ or cli/; fleet/ imports of the loop only the modules in FLEET_MAY_IMPORT_OF_LOOP;
   cli/ anything; config.py only services.common.

services/cli.py, services/quickstart.py and services/quickstart_real.py are the product's top-level tools (`rlmesh ...`): they
drive every service, so they may import the services' entry points and their modules (rule 1 does
not apply to them), and no service may import them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
SERVICES = ("rollout", "reward", "learner", "coordinator")
# Of each service, the modules other services may import (its declared client API).
CLIENT_API = {"reward": {"services.reward.client"}, "rollout": set(), "learner": set(), "coordinator": set()}
TOOLS = {"services.cli", "services.quickstart", "services.quickstart_real"}
COORDINATOR = "services.coordinator"
FLEET_MAY_IMPORT_OF_LOOP = {f"{COORDINATOR}.loop.checkpoint", f"{COORDINATOR}.loop.metrics",
                            f"{COORDINATOR}.loop.run_state"}


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # module name, e.g. services.rollout.server
    file: str  # its path in the repository, e.g. services/rollout/server.py
    line: int
    imported: str  # the module imported (services.reward.client), or an outside name (torch)
    at_import_time: bool  # runs when the importer is imported (not in a function, not TYPE_CHECKING)

    def where(self) -> str:
        return f"{self.file}:{self.line} imports {self.imported}"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def service_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted((ROOT / "services").rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module of `from X import ...` (relative imports included)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def file_of(module: str, is_package: bool = False) -> str:
    return "/".join(module.split(".")) + ("/__init__.py" if is_package else ".py")


def imports_of(name: str, source: str, is_package: bool, modules: set[str]) -> list[Import]:
    """Every import in a module's source: `import a.b`, `from a import b` (b a module when it is one),
    at module level, in classes and in functions."""
    found: list[Import] = []
    file = file_of(name, is_package)

    def visit(node: ast.AST, at_import_time: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(name, file, node.lineno, a.name, at_import_time) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, name, is_package)
            for alias in node.names:
                # `from services.coordinator import loop` imports the module services.coordinator.loop;
                # `from services.reward.client import RewardClient` imports services.reward.client.
                sub = f"{base}.{alias.name}"
                found.append(Import(name, file, node.lineno, sub if sub in modules else base, at_import_time))
        runs_now = at_import_time and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for field, value in ast.iter_fields(node):
            typing_only = isinstance(node, ast.If) and field == "body" and _is_type_checking(node.test)
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    visit(child, runs_now and not typing_only)

    visit(ast.parse(source, file), True)
    return found


@functools.cache
def all_imports() -> tuple[Import, ...]:
    modules = service_modules()
    return tuple(imp for name, path in modules.items()
            for imp in imports_of(name, path.read_text(), path.name == "__init__.py", set(modules)))


def owner(module: str) -> str | None:
    """The service package a module belongs to ("common" for services.common), else None."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "services" and parts[1] in (*SERVICES, "common"):
        return parts[1]
    return None


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# ----------------------------------------------------------------------------------------------
# The rules: each returns one message per breach, naming the file, the line, the import and the rule.

def service_boundary_breaches(imports: Sequence[Import]) -> list[str]:
    breaches = []
    for imp in imports:
        service = owner(imp.importer)
        if service not in SERVICES:
            continue
        if imp.imported in TOOLS or any(within(imp.imported, t) for t in TOOLS):
            breaches.append(f"{imp.where()}: a service must not import the top-level tools (services/cli.py, "
                            "services/quickstart.py); they import the services, not the other way round")
            continue
        other = owner(imp.imported)
        if other in SERVICES and other != service and imp.imported not in CLIENT_API[other]:
            api = sorted(CLIENT_API[other]) or "none (talk to it through its protos)"
            breaches.append(f"{imp.where()}: services.{service} may import of services.{other} only its declared "
                            f"client API {api}; move what both need to services/common, or declare it in "
                            f"services/{other}/__init__.py and in CLIENT_API")
    return breaches


def common_breaches(imports: Sequence[Import]) -> list[str]:
    return [f"{imp.where()}: services/common imports no service (it sits below all of them); move the shared "
            "piece into services/common instead"
            for imp in imports
            if owner(imp.importer) == "common" and within(imp.imported, "services") and owner(imp.imported) != "common"]


def import_circles(imports: Sequence[Import], modules: set[str]) -> list[list[str]]:
    """Strongly connected components (more than one module, or a module importing itself) of the
    graph of import-time imports among `modules` (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        if imp.at_import_time and imp.imported in modules:
            graph[imp.importer].add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1 or v in graph[v]:
                    circles.append(sorted(component))
    return circles


def circle_breaches(imports: Sequence[Import], modules: set[str]) -> list[str]:
    breaches = []
    for circle in import_circles(imports, modules):
        members = set(circle)
        edges = [imp.where() for imp in imports
                 if imp.at_import_time and imp.importer in members and imp.imported in members]
        breaches.append(f"import circle among {circle}: " + "; ".join(edges) + ". No import circles in services/: "
                        "move the shared types into a module both import (as services/rollout/engine.py), or "
                        "build the implementations in a factory module (as services/rollout/engines.py)")
    return breaches


def coordinator_room_breaches(imports: Sequence[Import]) -> list[str]:
    loop, fleet, cli, config = (f"{COORDINATOR}.{room}" for room in ("loop", "fleet", "cli", "config"))
    breaches = []
    for imp in imports:
        target = imp.imported
        if imp.importer == config:
            if within(target, "services") and owner(target) != "common":
                breaches.append(f"{imp.where()}: services/coordinator/config.py imports only services.common "
                                "(loop/, fleet/ and cli/ all read it)")
        elif not within(target, COORDINATOR) or target == COORDINATOR:
            continue
        elif within(imp.importer, loop) and not (within(target, loop) or target == config):
            breaches.append(f"{imp.where()}: loop/ imports of the coordinator only loop/ and config.py, nothing of "
                            "fleet/ or cli/ (the fleet hands the loop its endpoints and a recovery object; see "
                            "services/coordinator/__init__.py)")
        elif within(imp.importer, fleet) and within(target, loop) and target not in FLEET_MAY_IMPORT_OF_LOOP:
            breaches.append(f"{imp.where()}: fleet/ imports of loop/ only {sorted(FLEET_MAY_IMPORT_OF_LOOP)}; "
                            "drive the loop through the named methods of the Trainer it is handed "
                            "(see services/coordinator/__init__.py)")
        elif within(imp.importer, fleet) and within(target, cli):
            breaches.append(f"{imp.where()}: fleet/ imports nothing of cli/ (the commands wire the fleet together, "
                            "not the other way round; see services/coordinator/__init__.py)")
    return breaches


# ----------------------------------------------------------------------------------------------

def _fail(breaches: list[str]) -> None:
    assert not breaches, f"{len(breaches)} import(s) break the layout rules:\n" + "\n".join(breaches)


def test_services_import_only_common_protos_and_declared_client_apis():
    _fail(service_boundary_breaches(all_imports()))


def test_common_imports_no_service():
    _fail(common_breaches(all_imports()))


def test_no_import_circles_under_services():
    _fail(circle_breaches(all_imports(), set(service_modules())))


def test_coordinator_rooms_import_as_their_docstring_says():
    _fail(coordinator_room_breaches(all_imports()))


def test_the_declared_client_apis_exist_and_export_names():
    """CLIENT_API names real modules, each with an __all__, and each package's docstring says what it
    may import and declares its client API."""
    modules = service_modules()
    for service, api in CLIENT_API.items():
        doc = " ".join((ast.get_docstring(ast.parse(modules[f"services.{service}"].read_text())) or "").split())
        assert "may import" in doc.lower(), f"services/{service}/__init__.py: its docstring must say what it may import"
        if service != "coordinator":  # the coordinator is the client of the others; nothing imports it
            assert "Client API" in doc, f"services/{service}/__init__.py: its docstring must declare its client API"
        for module in api:
            assert module in modules, f"CLIENT_API[{service!r}] names {module}, which is not a module under services/"
            assert module.rsplit(".", 1)[1] + ".py" in doc, (
                f"services/{service}/__init__.py: its docstring must name its client API module {module}")
            tree = ast.parse(modules[module].read_text())
            assert any(isinstance(t, ast.Name) and t.id == "__all__"
                       for n in tree.body if isinstance(n, ast.Assign) for t in n.targets), (
                f"{file_of(module)}: a client API module lists its public names in __all__")


def test_the_rules_catch_each_kind_of_breach():
    """Each check finds what it must, in every import form, with the file, the line and the module
    in its message (so that the checks passing on the tree means something)."""
    sources = {
        "services.common.bad": "import services.rollout.server\n",
        "services.rollout.bad": "import torch\n\ndef f():\n    from services.learner import server\n",
        "services.rollout.ok": "from services.reward.client import RewardClient\nfrom services.common import log\n",
        "services.reward.bad": "from services.coordinator import loop\nimport services.quickstart\n",
        "services.coordinator.loop.bad": "from services.coordinator.fleet.supervisor import Supervisor\n",
        "services.coordinator.fleet.bad": "from services.coordinator.loop import trainer, checkpoint\n",
        "services.coordinator.config": "from services.coordinator.loop import data\n",
        "services.learner.a": "import services.learner.b\n",
        "services.learner.b": "from services.learner import a\n",
        "services.learner.c": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import services.learner.a\n",
        "services.learner.d": "def f():\n    import services.learner.c\n",
    }
    modules = {*sources, "services.rollout.server", "services.learner.server", "services.coordinator.loop",
               "services.coordinator.loop.trainer", "services.coordinator.loop.checkpoint",
               "services.coordinator.loop.data", "services.coordinator.fleet.supervisor", "services.reward.client",
               "services.common.log", "services.quickstart"}
    imports = [imp for name, source in sources.items() for imp in imports_of(name, source, False, modules)]

    common = common_breaches(imports)
    assert len(common) == 1 and common[0].startswith("services/common/bad.py:1 imports services.rollout.server:")
    boundary = "\n".join(service_boundary_breaches(imports))
    assert "services/rollout/bad.py:4 imports services.learner.server: services.rollout may import" in boundary
    assert "services/reward/bad.py:1 imports services.coordinator.loop:" in boundary  # a package imported by name
    assert "services/reward/bad.py:2 imports services.quickstart: a service must not import" in boundary
    assert "services/rollout/ok.py" not in boundary and "torch" not in boundary
    rooms = coordinator_room_breaches(imports)
    assert [r.split(": ")[0] for r in rooms] == [
        "services/coordinator/loop/bad.py:1 imports services.coordinator.fleet.supervisor",
        "services/coordinator/fleet/bad.py:1 imports services.coordinator.loop.trainer",
        "services/coordinator/config.py:1 imports services.coordinator.loop.data"]
    # Only import-time imports make a circle: c's is for type checkers, d's runs when f is called.
    assert import_circles(imports, modules) == [["services.learner.a", "services.learner.b"]]
    assert "services/learner/a.py:1 imports services.learner.b" in circle_breaches(imports, modules)[0]
