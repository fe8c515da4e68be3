"""What a user reads while a run goes: rewards per difficulty and per data source, the reward logs and
lengths in Prometheus, the samples file of each step and `rlmesh samples`. The same, from a real run
of the services, is asserted in tests/coordinator/test_eval_during_training.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import prometheus_client
import pytest
import torch

from rlmesh.rollout.v1 import rollout_pb2
from services.common.user_errors import UserError
from services.coordinator.cli import samples_cli
from services.coordinator.loop import samples_log
from services.coordinator.loop.data import Prompt
from services.coordinator.loop.experience import Sample
from services.coordinator.loop.group_rewards import group_rewards
from services.coordinator.loop.metrics import MetricsLog
from tests.coordinator.conftest import REPO
from tests.coordinator.test_metrics_plot import fake_config

LENGTH, STOP = rollout_pb2.FINISH_REASON_LENGTH, rollout_pb2.FINISH_REASON_STOP


def make_sample(uid: str, index: int, reward: float | None, difficulty: str = "", datasource: str = "arith",
                finish=STOP, text: str = "so \\boxed{3}") -> Sample:
    prompt = Prompt(uid, f"question {uid}?", (1, 2), label="3", datasource=datasource, difficulty=difficulty)
    return Sample(prompt=prompt, index=index, response_ids=torch.arange(4), text=text, finish_reason=finish,
                  weight_version=2, reward=reward, score=reward, extra={"accuracy": float(reward == 1.0)})


def gauge(name: str, labels: dict) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name, labels)


def test_rewards_per_difficulty_and_per_data_source():
    samples = [make_sample("a", 0, 1.0, "2", "add"), make_sample("a", 1, 0.0, "2", "add"),
               make_sample("b", 0, 1.0, "10", "sub"), make_sample("c", 0, 0.5, "hard", "sub"),
               make_sample("d", 0, None, "2", "sub"),  # not scored (yet): counts nowhere
               make_sample("e", 0, 0.25, "", "sub")]  # a row without a difficulty
    out = group_rewards(samples)
    # Levels in numeric order, then names; a row without a difficulty is in no difficulty group.
    assert [k for k in out if "by_difficulty" in k] == ["reward/by_difficulty/2", "reward/by_difficulty/10",
                                                         "reward/by_difficulty/hard"]
    assert out["reward/by_difficulty/2"] == 0.5 and out["reward/by_difficulty/10"] == 1.0
    assert out["reward/by_datasource/add"] == 0.5 and out["reward/by_datasource/sub"] == pytest.approx(1.75 / 3)
    assert gauge("rlmesh_coordinator_reward_by_difficulty", {"difficulty": "hard"}) == 0.5
    assert gauge("rlmesh_coordinator_reward_by_datasource", {"datasource": "add"}) == 0.5
    # One data source: no per-source keys (they would repeat reward/mean); no difficulties: none either.
    assert group_rewards([make_sample("a", 0, 1.0), make_sample("b", 0, 0.0)]) == {}


def test_length_truncation_entropy_and_reward_logs_reach_prometheus(tmp_path):
    from types import SimpleNamespace

    from services.coordinator.loop.step_metrics import step_metrics

    samples = [make_sample("a", 0, 1.0, finish=LENGTH), make_sample("a", 1, 0.0), make_sample("b", 0, 1.0),
               make_sample("b", 1, 1.0, finish=LENGTH)]
    samples[0].extra["boxed"] = 1.0
    samples[1].extra["boxed"] = 0.0
    collector = SimpleNamespace(all_samples=lambda: samples, kept=[], dropped=[])
    cfg = SimpleNamespace(dynamic_filtering=False, overlong_buffer_len=0, stop_properly_penalty_coef=None)
    state = SimpleNamespace(kl_coef=0.0, episode=1, prompts_consumed=2)
    times = {"generate": 1.0, "score": 0.5, "train": 1.0, "push": 0.5}
    m = step_metrics(cfg, state, 7, collector, {"count": 0}, {}, times, 4.0, {}, {})
    assert m["response_length/truncated_ratio"] == 0.5 and m["response_length/max"] == 4
    assert m["reward/boxed"] == 0.5 and m["reward/accuracy"] == 0.75
    assert gauge("rlmesh_coordinator_reward_log", {"name": "boxed"}) == 0.5
    assert gauge("rlmesh_coordinator_reward_log", {"name": "accuracy"}) == 0.75
    log = MetricsLog(tmp_path / "run", fake_config(tmp_path))
    log.log(7, {**m, "actor/entropy": 1.25})
    log.close()
    assert gauge("rlmesh_coordinator_response_length_max_tokens", {}) == 4
    assert gauge("rlmesh_coordinator_truncated_ratio", {}) == 0.5
    assert gauge("rlmesh_coordinator_entropy", {}) == 1.25


def test_samples_file_of_a_step_and_its_reader(tmp_path):
    # 3 prompts x 2 samples; 4 logged: the first of each prompt, then the second of the first prompt.
    samples = [make_sample(uid, i, float(i), difficulty="3", finish=LENGTH if i else STOP, text=f"answer {uid}{i}")
               for uid in ("p0", "p1", "p2") for i in range(2)]
    samples[0].reward = math.nan  # a reward function may return one: still valid JSON for the reader
    path = samples_log.write_step_samples(tmp_path, 12, samples, 4)
    assert path == tmp_path / "samples" / "step_000012.jsonl"
    records = samples_log.read_samples(tmp_path, 12)
    assert [(r["prompt_uid"], r["sample_index"]) for r in records] == [("p0", 0), ("p1", 0), ("p2", 0), ("p0", 1)]
    first, last = records[0], records[3]
    assert first["prompt"] == "question p0?" and first["response"] == "answer p00" and first["label"] == "3"
    assert first["step"] == 12 and first["difficulty"] == "3" and first["weight_version"] == 2
    assert first["truncated"] is False and last["truncated"] is True and last["response_tokens"] == 4
    assert math.isnan(first["reward"]) and last["reward"] == 1.0 and last["extra"] == {"accuracy": 1.0}
    # A redone step replaces its file; 0 writes nothing.
    samples_log.write_step_samples(tmp_path, 12, samples[:1], 4)
    assert len(samples_log.read_samples(tmp_path, 12)) == 1
    assert samples_log.write_step_samples(tmp_path, 13, samples, 0) is None
    samples_log.write_step_samples(tmp_path, 3, samples, 2)
    assert samples_log.logged_steps(tmp_path) == [3, 12]


def test_rlmesh_samples_prints_a_step(tmp_path, capsys):
    samples = [make_sample("p0", 0, 1.0, difficulty="2", text="12+7 is \\boxed{19}"),
               make_sample("p1", 0, 0.0, finish=LENGTH, text="I think")]
    for step in (1, 2, 4):
        samples_log.write_step_samples(tmp_path, step, samples, 8)
    assert samples_cli.main([str(tmp_path), "--n", "1"]) == 0  # the latest step, first sample
    out = capsys.readouterr().out
    assert "steps with samples 1-2, 4" in out and "step 4 | sample 1/1 | prompt p0 #0 | reward 1" in out
    assert "difficulty 2" in out and "label 3" in out and "12+7 is \\boxed{19}" in out and "I think" not in out
    assert samples_cli.main([str(tmp_path), "--step", "2", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["response"] for line in lines] == ["12+7 is \\boxed{19}", "I think"]
    assert samples_cli.main([str(tmp_path), "--step", "all", "--n", "1"]) == 0
    assert capsys.readouterr().out.count("| sample 1/1 |") == 3
    with pytest.raises(UserError, match="--step 3: no samples of that step .* steps with samples: 1-2, 4"):
        samples_cli.main([str(tmp_path), "--step", "3"])
    with pytest.raises(UserError, match="no samples yet"):
        samples_cli.main([str(tmp_path / "samples")])


def test_rlmesh_samples_errors_are_one_line(tmp_path):
    """As the console script runs it: a user error is its message and exit code 2, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", "samples", str(tmp_path / "missing")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("no such folder; RUN_DIR is the folder a training run wrote (its --run_dir, "
                                        "by default runs/<run name>)")
