"""The fault-free run that the kill trials of tests/chaos/ are compared with (shared: one per session)."""

from __future__ import annotations

import pytest

from tests.chaos.harness import grpo_argv, run_trial

STEPS = 5


@pytest.fixture(scope="session")
def baseline(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    """(trial, its output folder) of a 5-step GRPO run with two engines and no fault."""
    out = tmp_path_factory.mktemp("chaos-baseline")
    trial = run_trial(grpo_argv(tiny_model_dir, tiny_data_dir, out, 2, STEPS), out, timeout_s=600)
    assert trial.returncode == 0, trial.log[-6000:]
    assert trial.steps == list(range(1, STEPS + 1))
    return trial, out
