"""`rlmesh quickstart --real`, run as a user runs it (the console script in its own process, the real
services, `rlmesh make-task`, GRPO, the evaluations, the plots).

The CI test takes the documented way around the download, --model_dir, with a tiny tied Llama built
here (SmolLM2's architecture and tied head at ~0.6M parameters) and a run of two steps: every step of
the real quickstart runs, only smaller. The slow test is the real thing: SmolLM2-135M-Instruct fetched
(or found in the cache), the default settings, and the held-out accuracy must rise by more than both
95% intervals' half-widths combined, with McNemar's test agreeing, within 30 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from services.common.tiny import make_tiny_model
from services.coordinator.cli.plot import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def quickstart_real(run_dir: Path, *args: str, timeout: float) -> tuple[dict, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos")])}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "quickstart", "--real", "--run_dir", str(run_dir),
                           "--device", "cpu", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return json.loads((run_dir / "quickstart.json").read_text()), proc.stdout


def check_report(result: dict, stdout: str, run_dir: Path, steps: int, problems: int) -> dict:
    """What every run must show: the paired comparison printed and consistent with the run's own
    held-out evaluations, the curves drawn, the model exported."""
    c = result["comparison"]
    assert c["problems"] == problems
    assert f"before GRPO: {c['before']:.3f} [{c['before_interval'][0]:.3f}, {c['before_interval'][1]:.3f}]" in stdout
    assert f"after GRPO : {c['after']:.3f} [{c['after_interval'][0]:.3f}, {c['after_interval'][1]:.3f}]" in stdout
    assert f"McNemar exact p = {c['mcnemar_p']:.2g}" in stdout
    assert c["gained"] - c["lost"] == round((c["after"] - c["before"]) * problems)
    # The same greedy decoding on the same engine: the evaluation before GRPO is the run's step 0, the
    # one after is its last step.
    evals = [r for r in read_metrics(run_dir / "grpo") if "eval/pass@1" in r]
    assert [r["global_step"] for r in evals][0] == 0 and evals[-1]["global_step"] == steps
    assert evals[0]["eval/pass@1"] == pytest.approx(c["before"]) and evals[-1]["eval/pass@1"] == pytest.approx(c["after"])
    curve = Path(result["plots"][0])
    assert curve == run_dir / "learning_curve.png" and curve.read_bytes()[:4] == b"\x89PNG"
    assert f"learning curve: {curve}" in stdout
    assert all(Path(p).is_file() for p in result["plots"])
    assert (run_dir / "grpo" / "samples" / f"step_{steps:06d}.jsonl").is_file()
    # The trained model keeps the tied head: no separate lm_head in the export.
    with safe_open(str(Path(result["trained_model"]) / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    return c


def test_the_real_quickstart_runs_end_to_end_on_a_tiny_tied_llama(tmp_path):
    model = make_tiny_model(tmp_path / "model", arch="llama", tied=True)
    run_dir = tmp_path / "run"
    result, stdout = quickstart_real(run_dir, "--model_dir", str(model), "--grpo_steps", "2", "--eval_steps", "1",
                                     "--heldout_problems", "24", "--rollout_batch_size", "2",
                                     "--n_samples_per_prompt", "2", "--micro_train_batch_size", "4",
                                     "--generate_max_len", "8", timeout=900)
    check_report(result, stdout, run_dir, steps=2, problems=24)
    assert result["model_dir"] == str(model) and result["model_s"] < 5  # nothing was fetched
    # The task came from make-task: training and held-out prompts never overlap.
    train = {json.loads(line)["prompt"] for line in Path(result["train_file"]).read_text().splitlines() if line}
    heldout = {json.loads(line)["prompt"] for line in Path(result["heldout_file"]).read_text().splitlines() if line}
    assert train and heldout and not train & heldout
    assert len([r for r in read_metrics(run_dir / "grpo") if "eval/pass@1" in r]) == 3  # steps 0, 1, 2


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_smollm2_learns_arithmetic_on_the_cpu_within_30_minutes(tmp_path):
    run_dir = tmp_path / "run"
    result, stdout = quickstart_real(run_dir, timeout=3300)
    c = check_report(result, stdout, run_dir, steps=result["grpo_steps"], problems=result["comparison"]["problems"])
    assert c["significant"], f"held-out accuracy {c['before']:.3f} -> {c['after']:.3f}: a gain within the intervals"
    assert c["mcnemar_p"] < 0.01
    assert result["total_seconds"] < 1800, f"the real quickstart took {result['total_seconds']:.0f} s"
