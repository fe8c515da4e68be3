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


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in Path(str(item.fspath)).parts:
            item.add_marker(requires_cuda)
        if not HAS_CUDA and item.get_closest_marker("requires_cuda"):
            item.add_marker(skip)


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
