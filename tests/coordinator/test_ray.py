"""Ray placement on a local Ray instance: the coordinator is the Ray driver, reserves a placement
group and runs each service as a Ray actor that starts its gRPC server. The run is PPO with a
critic (GAE), the hf rollout engine (faster to start than vLLM on CPU), a reward model, and the
hybrid-engine (colocation) flags."""

from __future__ import annotations

from tests.coordinator.conftest import finish, pid_alive, read_metrics, service_pids, start_coordinator


def test_ray_placement_ppo_with_critic(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path):
    argv = ["--placement", "ray", "--ray_num_cpus", "2", "--rollout_engine", "hf",
            "--pretrain", str(tiny_model_dir), "--reward_pretrain", str(tiny_reward_model_dir),
            "--prompt_data", str(tiny_data_dir / "arith_train.jsonl"), "--input_key", "prompt",
            "--apply_chat_template", "--advantage_estimator", "gae", "--lambd", "0.95",
            "--rollout_batch_size", "16", "--micro_rollout_batch_size", "16", "--train_batch_size", "16",
            "--micro_train_batch_size", "8", "--generate_max_len", "16", "--prompt_max_len", "64",
            "--actor_learning_rate", "1e-4", "--critic_learning_rate", "1e-3", "--lr_scheduler",
            "constant_with_warmup", "--init_kl_coef", "0.01", "--max_steps", "2",
            # The hybrid-engine flags of the skill page: on CPU they free nothing, but the step runs
            # in the colocated order (generate -> sleep -> reload -> train -> push -> offload).
            "--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep",
            "--ckpt_path", str(tmp_path / "ckpt"), "--save_path", str(tmp_path / "model"),
            "--run_dir", str(tmp_path / "run")]
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator.train_ppo_ray", argv, log)
    output = finish(proc, log, timeout_s=420)
    assert proc.returncode == 0, output[-6000:]
    assert "ray.connected address=local" in output and "ray.stopped" in output
    assert "rollout.sleep_unsupported" in output  # the engine said so; the run carried on
    records = read_metrics(tmp_path / "run")
    assert [r["global_step"] for r in records] == [1, 2]
    for r in records:
        assert r["critic/value_loss"] > 0 and "actor/policy_loss" in r and "kl/mean" in r
    assert [r["weights/version"] for r in records] == [1, 2]
    # Both models trained: gradients flowed and the critic's predictions moved between the steps.
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in records)
    assert abs(records[1]["critic/values_mean"] - records[0]["critic/values_mean"]) > 1e-3
    assert (tmp_path / "model" / "config.json").is_file()
    pids = service_pids(tmp_path / "run")
    assert {"learner", "rollout-0", "reward-ref-0"} <= set(pids)
    assert not [name for name, pid in pids.items() if pid_alive(pid)], "services outlived the Ray actors"
