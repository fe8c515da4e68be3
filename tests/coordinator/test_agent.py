"""--agent_func_path through the real services: OpenRLHF agent files run unchanged in worker
processes; episodes are multi-turn with the environment's tokens masked out of the loss; an agent
that raises or hangs fails only its episode."""

from __future__ import annotations

import pathlib

from tests.coordinator.conftest import finish, read_metrics, start_coordinator

AGENTS = pathlib.Path(__file__).parent / "agents"


def test_faulty_agent_fails_episodes_not_the_run(tiny_model_dir, tiny_data_dir, tmp_path):
    log = tmp_path / "coordinator.log"
    argv = ["--pretrain", str(tiny_model_dir), "--prompt_data", str(tiny_data_dir / "arith_train.jsonl"),
            "--input_key", "prompt", "--label_key", "label", "--reward_func", "math", "--init_kl_coef", "0",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "8",
            "--micro_rollout_batch_size", "16", "--train_batch_size", "2", "--micro_train_batch_size", "2",
            "--generate_max_len", "6", "--prompt_max_len", "32", "--max_steps", "2", "--seed", "0",
            "--actor_learning_rate", "1e-3", "--disable_ds_ckpt", "--run_dir", str(tmp_path / "run"),
            "--save_path", str(tmp_path / "model"),
            "--ckpt_path", str(tmp_path / "ckpt"), "--agent_func_path", str(AGENTS / "faulty_agent.py"),
            "--agent_timeout_s", "5", "--agent_num_workers", "4", "--agent_max_turns", "4",
            "--rollout_engine", "hf", "--no-plots"]  # the agent path is the engine's caller; vLLM runs it in the learning test
    proc = start_coordinator("services.coordinator", argv, log)
    output = finish(proc, log, timeout_s=900)
    assert proc.returncode == 0, output[-6000:]
    records = read_metrics(tmp_path / "run")
    assert [r["global_step"] for r in records] == [1, 2]
    failed = sum(r["agent/failed_episodes"] for r in records)
    assert failed > 0, records
    assert "the agent code raised" in output and "ValueError: tool crashed" in output
    assert "ran past --agent_timeout_s 5" in output
    trained = [r for r in records if r["samples/trained"] > 0]
    assert trained, "every group failed"
    for r in trained:
        # Healthy episodes have two model turns with the environment's tokens between them,
        # masked out of the loss: model tokens are a strict part of the response.
        assert r["agent/turns_max"] == 2 and r["agent/turns_mean"] == 2
        assert 0 < r["agent/model_token_ratio"] < 1
        assert r["agent/step_latency_s"] >= 0 and "reward/turn" in r
        # A failed episode drops its group (2 samples); the rest of the step trains.
        assert r["samples/trained"] == 16 - r.get("agent/dropped_failed_group_samples", 0)
