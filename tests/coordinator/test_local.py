"""Local placement: the seed documents' GRPO command, unchanged apart from the module name and with
tiny sizes, starts every service on this machine, trains, verifies each weight push, and stops
every service it started (also when interrupted)."""

from __future__ import annotations

import signal
import time

from services.coordinator.loop import checkpoint
from services.coordinator.loop.samples_log import read_samples
from tests.coordinator.conftest import (finish, pid_alive, read_metrics, service_pids, start_coordinator,
                                        wait_for_file)


def seed_grpo_command(model, reward_model, data, out) -> list[str]:
    # OpenRLHF skill page, workflow 2 (GRPO), with tiny sizes and local paths.
    return ["--advantage_estimator", "group_norm",
            "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1",
            "--reward_num_nodes", "1", "--reward_num_gpus_per_node", "1",
            "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "1",
            "--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "1",
            "--colocate_all_models",
            "--pretrain", str(model),
            "--reward_pretrain", str(reward_model),
            "--save_path", str(out / "model"),
            "--micro_train_batch_size", "8", "--train_batch_size", "16",
            "--micro_rollout_batch_size", "16", "--rollout_batch_size", "8",
            "--max_epochs", "1", "--bf16",
            "--actor_learning_rate", "5e-7",
            "--init_kl_coef", "0.01", "--use_kl_loss", "--kl_estimator", "k3",
            "--normalize_reward", "--no_advantage_std_norm",
            # What the skill page leaves to the reader: the data, the group size, how long to run.
            "--prompt_data", str(data / "arith_train.jsonl"), "--input_key", "prompt", "--apply_chat_template",
            "--n_samples_per_prompt", "2", "--max_steps", "2", "--generate_max_len", "16", "--prompt_max_len", "64",
            "--ckpt_path", str(out / "ckpt"), "--save_steps", "1", "--run_dir", str(out / "run"),
            # vLLM is eager on a CPU without --enforce_eager (asserted below); the rollout dtype is chosen.
            "--rollout_dtype", "float32"]


def test_seed_grpo_command_runs_locally(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path):
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator.train_ppo_ray",
                             seed_grpo_command(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path), log)
    output = finish(proc, log, timeout_s=420)
    assert proc.returncode == 0, output[-6000:]
    assert "--bf16 on CPU" in output  # GPU-oriented flags warn instead of failing
    records = read_metrics(tmp_path / "run")
    assert [r["global_step"] for r in records] == [1, 2]
    for r in records:
        assert r["samples/generated"] == 16 and r["samples/trained"] == 16
        assert "reward/mean" in r and "kl/mean" in r and r["actor/optimizer_steps"] == 1
        assert r["time/overhead_ratio"] < 0.5
    # Every step pushed a new version and every engine reported it with the learner's checksum
    # (the coordinator fails the run otherwise).
    assert [r["weights/version"] for r in records] == [1, 2]
    # The reward model's scores vary, so the policy learned something: the KL to the reference grew.
    assert records[1]["kl/mean"] != 0.0
    assert checkpoint.latest_step(tmp_path / "ckpt") == 2
    assert (tmp_path / "ckpt" / "global_step_2" / "coordinator.json").is_file()
    assert (tmp_path / "model" / "config.json").is_file()
    assert (tmp_path / "run" / "plots" / "summary.png").is_file()
    # vLLM's own configuration line: eager by default on a CPU (no ~30 s compile), float32 as asked
    # although --bf16 trains in bfloat16; the push's harmless reload warning is not in its log.
    rollout_log = (tmp_path / "run" / "logs" / "rollout-0.log").read_text(errors="replace")
    assert "enforce_eager=True" in rollout_log and "dtype=torch.float32" in rollout_log
    assert "Failed to load weights" not in rollout_log and "weights.update.done version=2" in rollout_log
    # What a user watches: the learner's entropy (computed, never a 0.0 standing in), lengths, the
    # truncated share (16-token cap, random weights: most run to it), and each step's samples file.
    for r in records:
        assert r["actor/entropy"] > 0 and 0 < r["response_length/max"] <= 16
        samples = read_samples(tmp_path / "run", r["global_step"])
        assert len(samples) == 8  # --log_samples' default, of the step's 16
        assert len({s["prompt_uid"] for s in samples}) == 8  # one sample of each of the 8 prompts
        assert all(s["weight_version"] == r["global_step"] - 1 and s["response"] is not None for s in samples)
    pids = service_pids(tmp_path / "run")
    assert set(pids) == {"learner", "rollout-0", "reward-ref-0"}
    assert not [name for name, pid in pids.items() if pid_alive(pid)], "services outlived the coordinator"


def test_interrupt_stops_the_services(tiny_model_dir, tiny_data_dir, tmp_path):
    argv = ["--pretrain", str(tiny_model_dir), "--prompt_data", str(tiny_data_dir / "arith_train.jsonl"),
            "--input_key", "prompt", "--label_key", "label", "--reward_func", "math", "--init_kl_coef", "0",
            "--advantage_estimator", "rloo", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
            "--train_batch_size", "8", "--micro_train_batch_size", "4", "--rollout_engine", "hf",
            "--run_dir", str(tmp_path / "run"), "--ckpt_path", str(tmp_path / "ckpt"), "--save_path", ""]
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator", argv, log)
    logs = tmp_path / "run" / "logs"
    for name in ("learner", "rollout-0", "reward-0"):
        wait_for_file(logs / f"{name}.ready.json", proc, log, timeout_s=300)
    pids = service_pids(tmp_path / "run")
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    output = finish(proc, log, timeout_s=90)
    assert proc.returncode == 130, output[-4000:]
    assert "run.interrupted signal=SIGINT" in output
    assert not [name for name, pid in pids.items() if pid_alive(pid)], "services outlived the coordinator"
