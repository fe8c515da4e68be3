"""--agent_func_path through the real services: OpenRLHF agent files run unchanged in worker
processes; episodes are multi-turn with the environment's tokens masked out of the loss; an agent
that raises or hangs fails only its episode; the agent's own rewards need no reward service; and
OpenRLHF's asynchronous agent configuration (--async_train --partial_rollout --deepspeed_enable_sleep)
runs: episodes go on across weight pushes, each model token with the version that generated it."""

from __future__ import annotations

import pathlib
import re

from tests.coordinator.conftest import finish, read_metrics, start_coordinator

AGENTS = pathlib.Path(__file__).parent / "agents"


def test_faulty_agent_fails_episodes_not_the_run(tiny_model_dir, tiny_data_dir, tmp_path):
    log = tmp_path / "coordinator.log"
    argv = ["--pretrain", str(tiny_model_dir), "--prompt_data", str(tiny_data_dir / "arith_train.jsonl"),
            "--input_key", "prompt", "--label_key", "label", "--init_kl_coef", "0",  # the agent's rewards only
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
    # The agent function is the run's reward source (as in OpenRLHF): no reward service was started.
    assert not list((tmp_path / "run" / "logs").glob("reward*.log")), sorted((tmp_path / "run" / "logs").iterdir())
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


def test_async_partial_rollout_agent_with_learner_sleep(tiny_model_dir, tiny_data_dir, tmp_path):
    """OpenRLHF's train_reinforce_baseline_ray_agent_async.sh in small: the agent's rewards (no reward
    service), --async_train with --partial_rollout (pushes freeze running turns and let them go on)
    and --deepspeed_enable_sleep (the learner's states leave its GPUs between its steps)."""
    log = tmp_path / "coordinator.log"
    argv = ["--pretrain", str(tiny_model_dir), "--prompt_data", str(tiny_data_dir / "arith_train.jsonl"),
            "--input_key", "prompt", "--label_key", "label", "--init_kl_coef", "0",
            "--advantage_estimator", "reinforce_baseline", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
            "--micro_rollout_batch_size", "8", "--train_batch_size", "8", "--micro_train_batch_size", "8",
            "--generate_max_len", "8", "--prompt_max_len", "48", "--max_steps", "3", "--seed", "0",
            "--actor_learning_rate", "1e-3", "--disable_ds_ckpt", "--run_dir", str(tmp_path / "run"),
            "--save_path", str(tmp_path / "model"), "--ckpt_path", str(tmp_path / "ckpt"),
            "--agent_func_path", str(AGENTS / "two_turn_agent.py"), "--agent_num_workers", "2",
            "--async_train", "--max_staleness", "1", "--partial_rollout", "--deepspeed_enable_sleep",
            "--use_tis", "--enforce_eager", "--no-plots"]
    proc = start_coordinator("services.coordinator", argv, log)
    output = finish(proc, log, timeout_s=900)
    assert proc.returncode == 0, output[-6000:]
    records = read_metrics(tmp_path / "run")
    assert [r["global_step"] for r in records] == [1, 2, 3]
    assert not list((tmp_path / "run" / "logs").glob("reward*.log"))
    for r in records:
        assert r["agent/turns_max"] == 2 and r["agent/failed_episodes"] == 0
        assert r["async/staleness_max"] <= 1 and "async/mixed_version_samples" in r
        assert "time/learner_offload_s" in r
    # Every push went through the engine's freeze and resume (partial rollout), none waited for the turns.
    frozen = re.findall(r"weights\.generation_frozen version=(\d+)", (tmp_path / "run/logs/rollout-0.log").read_text())
    assert [int(v) for v in frozen] == [1, 2, 3], frozen
    # The learner slept between its steps: each reload is followed by an offload before the next reload.
    moves = re.findall(r"learner\.(offloaded|reloaded)", output)
    assert moves[0] == "offloaded" and moves.count("reloaded") >= 3, moves
    assert all(a != b for a, b in zip(moves, moves[1:])), moves


def test_episode_tokens_carry_the_version_that_generated_them(tiny_model_dir):
    """A turn a --partial_rollout push split (versions 3 then 4) keeps both; the environment's tokens
    after a turn take the version of its last token; the sample is as old as its oldest token."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from services.coordinator.loop.agent import AgentRunner, Outcome
    from services.coordinator.loop.data import Prompt

    config = SimpleNamespace(agent_max_length=64, prompt_max_len=32, generate_max_len=32, agent_rewards="agent")
    runner = AgentRunner(config, pool=None)
    runner.tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = [5, 6, 10, 11, 12, 20, 21, 30, 31]  # prompt 5 6 | turn 10 11 12 | env 20 21 | turn 30 31
    turns = [{"prompt_len": 2, "token_ids": [10, 11, 12], "logprobs": [-0.1, -0.2, -0.3], "finish_reason": "stop",
              "weight_version": 3, "token_versions": [3, 4, 4]},
             {"prompt_len": 7, "token_ids": [30, 31], "logprobs": [-0.4, -0.5], "finish_reason": "length",
              "weight_version": 5, "token_versions": [5, 5]}]
    outcome = Outcome(0, result={"observation_tokens": tokens, "action_ranges": [(2, 5), (7, 9)], "reward": 1.0},
                      turns=turns)
    prompt = Prompt(uid="p", text="", token_ids=(5, 6), label="", datasource="")
    sample = runner.new_sample(prompt, outcome, weight_version=5)
    assert not sample.failed
    assert sample.token_versions.tolist() == [3, 4, 4, 4, 4, 5, 5]
    assert sample.action_mask.tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert sample.oldest_version == 3 and sample.weight_version == 3
