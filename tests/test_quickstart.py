"""A short quickstart, run as `rlmesh quickstart` runs it: real SFT, real services (vLLM rollout,
math reward, DeepSpeed learner), real GRPO; RL must not lower the held-out accuracy SFT reached."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_short_quickstart_rl_does_not_lose_accuracy(tmp_path):
    run_dir = tmp_path / "quickstart"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos")])}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "quickstart", "--run_dir", str(run_dir),
                           "--grpo_steps", "10", "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    result = json.loads((run_dir / "quickstart.json").read_text())
    before, after = result["accuracy_after_sft"], result["accuracy_after_grpo"]
    assert before > 0.1, f"SFT did not learn the task (held-out accuracy {before})"
    assert after >= before, f"held-out accuracy fell from {before} after SFT to {after} after GRPO"
    assert f"after GRPO: {after:.3f}" in proc.stdout
    for path in result["plots"]:
        assert Path(path).is_file() and Path(path).suffix == ".png"
    assert any("reward" in Path(p).name for p in result["plots"])
    for model in (result["sft_model"], result["grpo_model"]):
        assert (Path(model) / "config.json").is_file() and (Path(model) / "model.safetensors").is_file()
