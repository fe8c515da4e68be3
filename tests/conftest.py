"""Shared fixtures: tiny models and data built once per test session, free ports, CUDA gating.

Tests that need a GPU carry `@pytest.mark.requires_cuda` (everything under tests/gpu gets it
automatically) and are skipped on machines without CUDA.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.tiny import make_data, make_tiny_model, make_tiny_reward_model

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.requires_cuda


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_cuda: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "xdist_group(name): the tests of a group run on one worker")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (after pytest-randomly's shuffle)
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in Path(str(item.fspath)).parts:
            item.add_marker(requires_cuda)
        if not HAS_CUDA and item.get_closest_marker("requires_cuda"):
            item.add_marker(skip)
    group_for_workers(config, items)


# Session fixtures that start processes or train: every test that uses one runs on the worker that
# built it (scripts/test.sh runs the suite on parallel workers, pytest-xdist's --dist loadgroup).
SHARED_FIXTURES = {"quickstart_run": "quickstart", "baseline": "chaos-baseline", "walk_baseline": "crash-walk",
                   "vllm_rollout": "rollout-services", "hf_rollout": "rollout-services", "docgen": "docs"}
# Modules that start Ray (a local instance or a cluster of loopback nodes): one at a time, on one worker.
RAY_MODULES = ("tests/chaos/test_ray_chaos.py", "tests/coordinator/test_ray_placement_wait.py",
               "tests/coordinator/test_ray_multinode.py", "tests/coordinator/test_ray_elastic.py",
               "tests/bench/test_soak_ray.py")
# Groups that take minutes go out first, so that no long one starts last (measured on 2 cores).
LONG_GROUPS = ("ray", "crash-walk", "chaos-baseline", "quickstart", "tests/chaos/test_learner_ranks.py",
               "tests/chaos/test_static_chaos.py", "tests/deploy/test_compose_local.py",
               "tests/coordinator/test_static.py", "tests/rollout/test_push_logprobs.py")


def group_for_workers(config, items) -> None:
    """Marks each test with the xdist group it runs in: its module (its module fixtures are built
    once), joined with every module that shares one of SHARED_FIXTURES with it; RAY_MODULES form
    one group. Without xdist the marks change nothing but the order: long groups first, each group's
    tests together, the groups and the tests within them in pytest-randomly's order."""
    root = Path(__file__).resolve().parents[1]
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    module_of = {}
    for item in items:
        module = module_of[item] = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
        if module in RAY_MODULES:
            parent[find(module)] = find("ray")
        for fixture in set(item.fixturenames) & SHARED_FIXTURES.keys():
            parent[find(module)] = find(SHARED_FIXTURES[fixture])
    names = {}
    for item in items:
        group = find(module_of[item])
        names[item] = next((name for name in ("ray", *SHARED_FIXTURES.values()) if find(name) == group), group)
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(names[item]))
    if getattr(config.option, "loadgroup", False):
        # pytest-xdist 3.8 names the group in the test's id (path::test@group) by assigning
        # item._nodeid, which pytest 9.2 no longer reads (Node.nodeid is str(item._id)): done here.
        from _pytest.nodeid import NodeId

        for item in items:
            group = item.get_closest_marker("xdist_group").args[0]
            if not item.nodeid.endswith(f"@{group}"):
                item._id = NodeId.parse(f"{item.nodeid}@{group}")
    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(names[item], index)
    rank = {name: LONG_GROUPS.index(name) if name in LONG_GROUPS else len(LONG_GROUPS) for name in first_seen}
    items.sort(key=lambda item: (rank[names[item]], first_seen[names[item]]))


_HANDED_OUT: set[int] = set()


def get_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on host a moment ago and that this process has not handed out before:
    tests define several services' ports before any binds, and the OS may offer one port twice."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@pytest.fixture
def free_port() -> int:
    return get_free_port()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Random tiny Qwen2 causal LM (seed 0) with the shared tokenizer and chat template."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_qwen2_seed0", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory) -> Path:
    """Same shapes and tokenizer as tiny_model_dir, other weights (seed 1): for weight swaps."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_qwen2_seed1", seed=1)


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory) -> Path:
    """Random tiny Mixtral (4 experts, 2 per token) with the same tokenizer: a model with a router loss."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_mixtral_seed0", arch="mixtral", seed=0)


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> Path:
    """Random tiny Qwen2 sequence-classification model, one label, same tokenizer."""
    return make_tiny_reward_model(tmp_path_factory.mktemp("models") / "tiny_reward_seed0", seed=0)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    """arith_train/arith_test/sft/prefs JSONL files (seed 0)."""
    return make_data(tmp_path_factory.mktemp("data"), seed=0)


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> dict:
    """One short quickstart, run as `rlmesh quickstart` runs it (real SFT, real services, 10 GRPO
    steps): tests/test_quickstart.py checks it; the learning tests start from its SFT model and
    compare against its synchronous GRPO. Returns quickstart.json plus run_dir and the output."""
    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path_factory.mktemp("quickstart") / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(root), str(root / "protos")])}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "quickstart", "--run_dir", str(run_dir),
                           "--grpo_steps", "10", "--device", "cpu"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    result = json.loads((run_dir / "quickstart.json").read_text())
    return {**result, "run_dir": run_dir, "stdout": proc.stdout}
