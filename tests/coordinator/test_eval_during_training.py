"""Evaluation during training (--eval_dataset / --eval_steps): a local GRPO run evaluates held-out
prompts before the first step, every --eval_steps steps and after the last, and logs eval/ metrics
to metrics.jsonl, TensorBoard and Prometheus next to the training metrics.

The run is also the one that shows paths are the user's: started from another folder with relative
paths, it reads its model and data there and writes its checkpoints, final model, TensorBoard events
and run folder there, although the services it starts run in the repository root."""

from __future__ import annotations

import os

import prometheus_client
import pytest

from services.coordinator.loop import checkpoint
from services.coordinator.loop.metrics import MetricsLog
from services.coordinator.cli.plot import read_metrics as plot_records
from tests.coordinator.conftest import REPO, finish, read_metrics, start_coordinator
from tests.coordinator.test_metrics_plot import fake_config

EVAL_PROMPTS = 4


def test_grpo_run_from_another_folder_logs_evaluations_and_keeps_every_path_there(tiny_model_dir, tiny_data_dir,
                                                                                  tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model").symlink_to(tiny_model_dir)
    (elsewhere / "prompts.jsonl").symlink_to(tiny_data_dir / "arith_train.jsonl")
    (elsewhere / "heldout.jsonl").symlink_to(tiny_data_dir / "arith_test.jsonl")
    name = f"evalrun_{os.getpid()}"  # names the default run folder runs/<name>
    argv = ["--pretrain", "model", "--prompt_data", "prompts.jsonl",
            "--input_key", "prompt", "--label_key", "label", "--reward_func", "math", "--init_kl_coef", "0",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2",
            "--train_batch_size", "4", "--micro_train_batch_size", "4", "--rollout_engine", "hf",
            "--generate_max_len", "8", "--prompt_max_len", "64", "--max_steps", "3",
            "--eval_dataset", "heldout.jsonl", "--eval_max_samples", str(EVAL_PROMPTS),
            "--eval_steps", "2", "--eval_n_samples_per_prompt", "2", "--eval_temperature", "1.0",
            "--use_tensorboard", "tb", "--wandb_run_name", name,
            "--ckpt_path", f"out/{name}", "--save_steps", "3", "--save_path", "final"]
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator", argv, log, cwd=elsewhere)
    output = finish(proc, log, timeout_s=420)
    assert proc.returncode == 0, output[-6000:]

    # Every path the user gave, and every default, is in the user's folder.
    ckpt = elsewhere / "out" / name
    assert checkpoint.latest_step(ckpt) == 3
    step = ckpt / "global_step_3"
    # Both halves of the checkpoint in one folder: the learner's (marker, DeepSpeed files) and the coordinator's.
    assert (step / "learner.json").is_file() and (step / "actor").is_dir() and (step / "coordinator.json").is_file()
    assert (elsewhere / "final" / "config.json").is_file()
    run_dir = elsewhere / "runs" / name
    assert (run_dir / "logs" / "learner.log").is_file()
    for stray in (REPO / "runs" / name, REPO / "out" / name, REPO / "final", REPO / "tb" / name):
        assert not stray.exists(), f"{stray} written in the repository instead of the user's folder"

    records = read_metrics(run_dir)
    assert [r["global_step"] for r in records] == [0, 1, 2, 3]
    # Before the first step, every --eval_steps steps, and after the last step (3 is not a multiple of 2).
    evaluated = [r["global_step"] for r in records if "eval/pass@1" in r]
    assert evaluated == [0, 2, 3]
    for r in records:
        if "eval/pass@1" not in r:
            continue
        assert r["eval/prompts"] == EVAL_PROMPTS
        assert 0.0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1.0
        assert 0 < r["eval/response_length"] <= 8
    # The step-0 record holds the evaluation only; training records keep their own metrics.
    assert "reward/mean" not in records[0] and all("reward/mean" in r for r in records[1:])
    # Evaluation takes no prompts from the training data: each step consumed one batch.
    assert [r["progress/prompts_consumed"] for r in records[1:]] == [2, 4, 6]
    assert "eval.step step=0" in output and "eval.step step=3" in output
    assert (run_dir / "plots" / "eval_pass@1.png").is_file()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(elsewhere / "tb" / name))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/pass@1")] == [0, 2, 3]


def test_eval_metrics_reach_prometheus_and_plots_merge_records(tmp_path):
    run = tmp_path / "run"
    log = MetricsLog(run, fake_config(tmp_path))
    log.log(1, {"reward/mean": 0.5})
    # An evaluation logged on its own at an already logged step (the data ran out early).
    log.log(1, {"eval/pass@1": 0.25, "eval/pass@4": 0.75, "eval/response_length": 6.0,
                "eval/gsm/pass@1": 0.5, "eval/gsm/response_length": 7.0})
    log.close()
    sample = prometheus_client.REGISTRY.get_sample_value
    assert sample("rlmesh_coordinator_eval_pass_ratio", {"k": "1", "datasource": "all"}) == 0.25
    assert sample("rlmesh_coordinator_eval_pass_ratio", {"k": "4", "datasource": "all"}) == 0.75
    assert sample("rlmesh_coordinator_eval_pass_ratio", {"k": "1", "datasource": "gsm"}) == 0.5
    assert sample("rlmesh_coordinator_eval_response_length_tokens", {"datasource": "gsm"}) == 7.0
    merged = plot_records(run)
    assert len(merged) == 1 and merged[0]["reward/mean"] == 0.5 and merged[0]["eval/pass@1"] == pytest.approx(0.25)


def test_eval_flags(tmp_path):
    from services.common.config import ConfigError, build_parser, config_from_args
    from services.coordinator.config import CoordinatorConfig

    (tmp_path / "model").mkdir()
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')

    def parse(*extra):
        argv = ["--placement", "local", "--device", "cpu", "--pretrain", str(tmp_path / "model"),
                "--prompt_data", str(data), "--reward_func", "math", "--label_key", "label", "--init_kl_coef", "0",
                "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2",
                "--train_batch_size", "4", "--micro_train_batch_size", "4", *extra]
        return config_from_args(CoordinatorConfig, build_parser(CoordinatorConfig).parse_args(argv))

    assert parse("--eval_dataset", str(data), "--eval_steps", "5").eval_enabled()
    with pytest.warns(UserWarning, match="no evaluation"):
        assert not parse("--eval_dataset", str(data)).eval_enabled()  # --eval_steps defaults to -1: off
    with pytest.raises(ConfigError, match="--eval_dataset .*missing.jsonl: no such file"):
        parse("--eval_dataset", str(tmp_path / "missing.jsonl"), "--eval_steps", "1")
    with pytest.raises(ConfigError, match="identical samples"):
        parse("--eval_dataset", str(data), "--eval_steps", "1", "--eval_n_samples_per_prompt", "4")
