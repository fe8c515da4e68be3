"""--async_train through the real services: generation of the next step overlaps training of the
current one, every sample's staleness stays within --max_staleness, the loss is corrected with the
engine's own log-probs (--use_tis), the staleness policy "drop" drops and counts what is past the
bound, and --partial_rollout pushes through the engines' pause/resume and counts a sample's
staleness by its oldest token."""

from __future__ import annotations

import re

import pytest

from services.coordinator.loop.async_loop import admit_fresh
from services.coordinator.loop.experience import Sample
from services.coordinator.loop.data import Prompt
from tests.coordinator.conftest import finish, read_metrics, start_coordinator

import torch


def grpo_argv(model, data, out, *extra: str) -> list[str]:
    return ["--pretrain", str(model), "--prompt_data", str(data / "arith_train.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--reward_func", "math", "--init_kl_coef", "0",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
            "--micro_rollout_batch_size", "8", "--train_batch_size", "8", "--micro_train_batch_size", "8",
            "--generate_max_len", "8", "--prompt_max_len", "64", "--max_steps", "4", "--seed", "0",
            "--actor_learning_rate", "1e-3", "--disable_ds_ckpt", "--run_dir", str(out / "run"),
            "--save_path", str(out / "model"),
            "--ckpt_path", str(out / "ckpt"), "--enforce_eager", "--no-plots", *extra]  # vLLM starts ~30 s sooner


def test_async_grpo_overlaps_generation_with_training(tiny_model_dir, tiny_data_dir, tmp_path):
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator",
                             grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, "--async_train", "--max_staleness", "1",
                                       "--use_tis", "--tis_cap", "2", "--partial_rollout"),
                             log)
    output = finish(proc, log, timeout_s=900)
    assert proc.returncode == 0, output[-6000:]
    records = read_metrics(tmp_path / "run")
    assert [r["global_step"] for r in records] == [1, 2, 3, 4]
    assert [r["weights/version"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["samples/trained"] == 8 and r["async/dropped_stale_samples"] == 0
        assert r["async/staleness_max"] <= 1
        assert sum(v for k, v in r.items() if re.fullmatch(r"async/staleness_\d+", k)) == 8
    # Step 1 comes from the starting weights (staleness 0); later steps were generated while the
    # previous one trained, so some of their samples are one version old.
    assert records[0]["async/staleness_max"] == 0
    assert any(r.get("async/staleness_1", 0) > 0 for r in records[1:]), records
    # The producer collected step s+1 before step s was trained (the overlap itself).
    collected = [(int(m.group(1)), int(m.group(2))) for m in
                 re.finditer(r"async\.collected step=(\d+) .*?trained=(\d+)", output)]
    assert any(step >= trained + 2 for step, trained in collected), collected
    # TIS weights: min(exp(old - engine log-prob), 2) per token. Step 1 is on-policy, where they
    # differ from 1 only by the engine's bf16 against the learner's fp32; later the lag shows.
    for r in records:
        assert 0 < r["actor/tis_weight_mean"] <= 2
    assert abs(records[0]["actor/tis_weight_mean"] - 1) < 0.2, records[0]["actor/tis_weight_mean"]
    # --partial_rollout: every push went through the engine's freeze and resume instead of waiting.
    # (Here the learner is slower than generation, so the pushes find the engine idle: samples that
    # span a push are shown by tests/rollout's partial-push test and the per-token test below.)
    frozen = re.findall(r"weights\.generation_frozen version=(\d+)", (tmp_path / "run/logs/rollout-0.log").read_text())
    assert [int(v) for v in frozen] == [1, 2, 3, 4], frozen
    assert all("async/mixed_version_samples" in r for r in records)


def _samples(versions: list[int]) -> list[Sample]:
    prompt = Prompt(uid="p", text="1+1=", token_ids=(1, 2), label="2", datasource="")
    return [Sample(prompt=prompt, index=i, response_ids=torch.tensor([3]), text="", finish_reason=1, weight_version=v)
            for i, v in enumerate(versions)]


def test_admit_fresh_drops_whole_groups_past_the_bound():
    samples = _samples([5, 5, 4, 3])  # two groups of 2; trained version 5; bound 1
    kept, metrics = admit_fresh(samples, 2, 5, 1, "drop")
    assert kept == samples[:2]
    assert metrics["async/dropped_stale_samples"] == 2
    assert (metrics["async/staleness_0"], metrics["async/staleness_1"], metrics["async/staleness_2"]) == (2, 1, 1)
    # Per-token versions (a multi-turn episode): the oldest token decides.
    samples[0].token_versions = torch.tensor([3, 5])
    kept, _ = admit_fresh(samples, 2, 5, 1, "drop")
    assert kept == []
    with pytest.raises(RuntimeError, match="past --max_staleness 1"):
        admit_fresh(samples, 2, 5, 1, "wait")


def test_admit_fresh_never_trains_tokens_older_than_the_runs_first_version():
    """An engine restarted unseen (static placement) generates at version 0 from its --pretrain
    until the next step start pushes to it. The run's first version was 1 (setup pushed it), so
    such a sample is never trained, even where --max_staleness alone would admit it (trained
    version 3, bound 4), and under --staleness_policy wait it is dropped, not a failed gate."""
    samples = _samples([3, 3, 0, 3, 2, 2])  # three groups of 2; the second holds a version-0 sample
    for policy in ("drop", "wait"):
        kept, metrics = admit_fresh(samples, 2, 3, 4, policy, first_version=1)
        assert kept == samples[:2] + samples[4:], policy
        assert metrics["async/dropped_lost_weights_samples"] == 2
        assert metrics["async/dropped_stale_samples"] == 0
    # Per-token versions: one version-0 token (the restart happened mid-episode) is enough.
    samples = _samples([3, 3])
    samples[1].token_versions = torch.tensor([0, 3])
    kept, metrics = admit_fresh(samples, 2, 3, 4, "drop", first_version=1)
    assert kept == [] and metrics["async/dropped_lost_weights_samples"] == 2
    # A run whose engines started with the learner's weights (first version 0) trains version 0.
    kept, metrics = admit_fresh(samples, 2, 3, 4, "drop", first_version=0)
    assert kept == samples and "async/dropped_lost_weights_samples" not in metrics


def test_partial_rollout_samples_are_as_stale_as_their_oldest_token():
    """A sample a --partial_rollout push split (versions 3 then 4, from the rollout service's
    token_weight_versions) counts as version 3: past the bound of 0 under version 4, within 1."""
    from rlmesh.rollout.v1 import rollout_pb2
    from services.common.tensors import to_proto
    from services.coordinator.loop.async_loop import token_versions

    response = rollout_pb2.GenerateResponse(weight_version=3)
    assert token_versions(response) is None
    response.token_weight_versions.CopyFrom(to_proto(torch.tensor([3, 3, 4], dtype=torch.int64)))
    samples = _samples([4, 4])
    samples[1].token_versions = token_versions(response)
    kept, metrics = admit_fresh(samples, 2, 4, 0, "drop")
    assert kept == [] and metrics["async/dropped_stale_samples"] == 2 and metrics["async/mixed_version_samples"] == 1
    kept, _ = admit_fresh(samples, 2, 4, 1, "drop")
    assert kept == samples
