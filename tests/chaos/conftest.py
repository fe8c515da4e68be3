"""The fault-free run that the kill trials of tests/chaos/ are compared with (shared: one per session)."""

from __future__ import annotations

import pytest

from tests.chaos.harness import grpo_argv, run_trial

STEPS = 5


def _fault_free(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("chaos-baseline")
    trial = run_trial(grpo_argv(tiny_model_dir, tiny_data_dir, out, 2, STEPS), out, timeout_s=600)
    assert trial.returncode == 0, trial.log[-6000:]
    assert trial.steps == list(range(1, STEPS + 1))
    return trial, out


@pytest.fixture(scope="session")
def baseline(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    """(trial, its output folder) of a 5-step GRPO run with two engines and no fault."""
    return _fault_free(tiny_model_dir, tiny_data_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def walk_baseline(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    """The same run for the crash walk (tests/chaos/test_crash_points.py): a fixture of its own so
    that the walk and the kill trials can run on different workers."""
    return _fault_free(tiny_model_dir, tiny_data_dir, tmp_path_factory)
