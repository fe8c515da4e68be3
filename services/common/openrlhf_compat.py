"""OpenRLHF's helper modules for user files written against OpenRLHF, without OpenRLHF.

Reward files and agent files from OpenRLHF's examples import its helpers: ProRL v2's
math_reward_func.py does `from openrlhf.utils import extract_boxed_answer, grade_answer`, agent
files `from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor`. rlmesh provides
those names, with the same behaviour, implemented here (services/common/math_grading.py; the agent
API is the coordinator's agent_api.py):

    openrlhf.utils              extract_boxed_answer, grade_answer (and math_utils, agent below)
    openrlhf.utils.math_utils   the grading helpers (PROVIDED lists them)
    openrlhf.utils.agent        the agent API, in agent files only (--agent_func_path)

`install()` registers these modules in sys.modules of the process that loads the user's file (a
reward function worker, an agent worker) just before it loads it; nothing named openrlhf is
installed anywhere else. `check_imports(path)` reads a file's imports (ast, nothing is run) at
validation, so an import of something not provided (openrlhf.utils.get_tokenizer,
openrlhf.models, ...) fails before any service starts, naming the import and the file.
"""

from __future__ import annotations

import ast
import pathlib
import sys
import types

from services.common import math_grading
from services.common.config_error import ConfigError

_MATH_NAMES = ("extract_boxed_answer", "grade_answer", "grade_answer_mathd", "grade_answer_sympy",
               "mathd_normalize_answer", "last_boxed_only_string", "remove_boxed", "split_tuple",
               "are_equal_under_sympy")
AGENT_MODULE = "openrlhf.utils.agent"
AGENT_NAMES = ("AgentInstanceBase", "AgentExecutorBase", "MultiTurnAgentExecutor")
# module -> the names it provides (its submodules are names too)
PROVIDED: dict[str, tuple[str, ...]] = {
    "openrlhf": ("utils",),
    "openrlhf.utils": ("extract_boxed_answer", "grade_answer", "math_utils", "agent"),
    "openrlhf.utils.math_utils": _MATH_NAMES,
    AGENT_MODULE: AGENT_NAMES,
}


def install(agent_api: types.ModuleType | None = None) -> None:
    """Registers openrlhf, openrlhf.utils and openrlhf.utils.math_utils (and openrlhf.utils.agent
    when the agent API is given) in this process's sys.modules."""
    package, utils = types.ModuleType("openrlhf"), types.ModuleType("openrlhf.utils")
    math_utils = types.ModuleType("openrlhf.utils.math_utils")
    package.__path__, utils.__path__ = [], []  # packages: `import openrlhf.utils.math_utils` works
    for name in _MATH_NAMES:
        setattr(math_utils, name, getattr(math_grading, name))
    utils.extract_boxed_answer, utils.grade_answer = math_grading.extract_boxed_answer, math_grading.grade_answer
    package.utils, utils.math_utils = utils, math_utils
    modules = {"openrlhf": package, "openrlhf.utils": utils, "openrlhf.utils.math_utils": math_utils}
    if agent_api is not None:
        utils.agent = agent_api
        modules[AGENT_MODULE] = agent_api
    sys.modules.update(modules)


def _imports(tree: ast.AST) -> list[tuple[str, str | None, int]]:
    """(module, name or None for `import module`, line) of every absolute openrlhf import in the file."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "openrlhf"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "openrlhf":
            found += [(node.module, a.name, node.lineno) for a in node.names]
    return found


def missing_imports(path: str, agent: bool = False) -> list[str]:
    """The file's imports of OpenRLHF that are not provided ("line N: from X import Y"); [] when all are.
    `agent`: the file is an agent file, which may import openrlhf.utils.agent."""
    source = pathlib.Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError:
        return []  # loading the file reports it, with its line
    provided = {m: names for m, names in PROVIDED.items() if agent or m != AGENT_MODULE}
    missing = []
    for module, name, line in _imports(tree):
        if module not in provided:
            missing.append(f"line {line}: {'import ' + module if name is None else f'from {module} import {name}'}")
        elif name is not None and name != "*" and name not in provided[module]:
            missing.append(f"line {line}: from {module} import {name}")
    return missing


def check_imports(path: str, option: str, agent: bool = False) -> None:
    """ConfigError naming the file, its option and each OpenRLHF import rlmesh does not provide."""
    missing = missing_imports(path, agent)
    if not missing:
        return
    offered = ("openrlhf.utils: extract_boxed_answer, grade_answer; openrlhf.utils.math_utils: "
               + ", ".join(_MATH_NAMES) + ("; openrlhf.utils.agent: " + ", ".join(AGENT_NAMES) if agent else ""))
    agent_note = "" if agent else " (openrlhf.utils.agent is for agent files, --agent_func_path)"
    raise ConfigError(f"{option} {path} imports from OpenRLHF what rlmesh does not provide: {'; '.join(missing)}. "
                      f"rlmesh provides {offered}{agent_note}; copy what else the file needs into it (OpenRLHF "
                      "itself is not needed)")
