"""A short quickstart, run as `rlmesh quickstart` runs it: real SFT, real services (vLLM rollout,
math reward, DeepSpeed learner), real GRPO; RL must not lower the held-out accuracy SFT reached.
The run itself is the session fixture `quickstart_run` (tests/conftest.py), which the learning
tests share."""

from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(3000)  # the session's quickstart run is set up here: minutes idle, far more under load
def test_short_quickstart_rl_does_not_lose_accuracy(quickstart_run):
    result = quickstart_run
    before, after = result["accuracy_after_sft"], result["accuracy_after_grpo"]
    assert before > 0.1, f"SFT did not learn the task (held-out accuracy {before})"
    assert after >= before, f"held-out accuracy fell from {before} after SFT to {after} after GRPO"
    assert f"after GRPO: {after:.3f}" in result["stdout"]
    for path in result["plots"]:
        assert Path(path).is_file() and Path(path).suffix == ".png"
    assert any("reward" in Path(p).name for p in result["plots"])
    for model in (result["sft_model"], result["grpo_model"]):
        assert (Path(model) / "config.json").is_file() and (Path(model) / "model.safetensors").is_file()
