"""The fault-free run that the kill trials of tests/chaos/ are compared with (shared: one per session)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os

import pytest

from tests.chaos.harness import Trial, grpo_argv, run_trial

STEPS = 5


def _fault_free(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    """One fault-free run for the whole session, whichever worker asks first: the pytest-xdist
    workers share the folder above their own temporary folders, and the run (its Trial as JSON) is
    kept there under a lock, so that a worker asking while another runs it waits and reads it. The
    tiny model and data are seeded (tests/conftest.py), so every worker's run would be the same one."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out, saved = root / "chaos-baseline", root / "chaos-baseline.json"
    with open(root / "chaos-baseline.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if saved.is_file():
            return Trial(**json.loads(saved.read_text())), out
        trial = run_trial(grpo_argv(tiny_model_dir, tiny_data_dir, out, 2, STEPS), out, timeout_s=600)
        assert trial.returncode == 0, trial.log[-6000:]
        assert trial.steps == list(range(1, STEPS + 1))
        saved.write_text(json.dumps(dataclasses.asdict(trial)))
    return trial, out


@pytest.fixture(scope="session")
def baseline(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    """(trial, its output folder) of a 5-step GRPO run with two engines and no fault."""
    return _fault_free(tiny_model_dir, tiny_data_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def walk_baseline(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    """The same run for the crash walk (tests/chaos/test_crash_points.py): a fixture of its own so
    that the walk and the kill trials can run on different workers (the run itself is made once)."""
    return _fault_free(tiny_model_dir, tiny_data_dir, tmp_path_factory)
