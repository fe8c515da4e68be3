"""Evaluation during training (--eval_dataset / --eval_steps): a local GRPO run evaluates held-out
prompts before the first step, every --eval_steps steps and after the last, and logs eval/ metrics
to metrics.jsonl, TensorBoard and Prometheus next to the training metrics.

The run is also the one that shows paths are the user's: started from another folder with relative
paths, it reads its model and data there and writes its checkpoints, final model, TensorBoard events
and run folder there, although the services it starts run in the repository root.

And what a user watches in a run: its model is a bfloat16 checkpoint trained in float32 (a real
pretrained model on a CPU) whose final export stays bfloat16; its prompts carry a difficulty and
two data sources, whose mean rewards each step logs; each step's samples file matches the step's
length, truncation and reward metrics, and `rlmesh samples` prints it; the learner's entropy is logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import prometheus_client
import pytest
import torch

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
    save_bf16_copy(tiny_model_dir, elsewhere / "model")
    write_tagged_prompts(tiny_data_dir / "arith_train.jsonl", elsewhere / "prompts.jsonl")
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
            "--ckpt_path", f"out/{name}", "--save_steps", "3", "--save_path", "final",
            "--no-shuffle_prompts"]  # in file order: every step has both data sources
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
    check_watch_metrics(run_dir, records[1:], max_len=8)
    check_export_keeps_the_checkpoint_dtype(elsewhere / "final")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(elsewhere / "tb" / name))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/pass@1")] == [0, 2, 3]


def save_bf16_copy(model_dir, out) -> None:
    """The tiny model as a bfloat16 checkpoint, as real pretrained models come."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def write_tagged_prompts(source, out) -> None:
    """The arithmetic prompts with a difficulty (1: both operands below 10, else 2) and a data source by
    operation, alternating so that any two consecutive prompts come from both sources."""
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    adds, subs = [r for r in rows if "+" in r["prompt"]], [r for r in rows if "-" in r["prompt"]]
    tagged = []
    for add, sub in zip(adds, subs):
        for row, source_name in ((add, "add"), (sub, "sub")):
            operands = [int(x) for x in row["prompt"].rstrip("=").replace("+", " ").replace("-", " ").split()]
            tagged.append({**row, "data_source": source_name, "difficulty": 1 if max(operands) < 10 else 2})
    out.write_text("".join(json.dumps(r) + "\n" for r in tagged))


def check_watch_metrics(run_dir, records: list[dict], max_len: int) -> None:
    """Each training step's length, truncation and reward metrics equal what its samples file holds
    (every sample of a step is in it: 4 <= --log_samples' default 8); `rlmesh samples` prints them."""
    from services.coordinator.loop.samples_log import logged_steps, read_samples

    assert logged_steps(run_dir) == [r["global_step"] for r in records]
    for record in records:
        samples = read_samples(run_dir, record["global_step"])
        assert len(samples) == record["samples/generated"] == 4
        lengths = [s["response_tokens"] for s in samples]
        assert record["response_length/max"] == max(lengths) <= max_len
        assert record["response_length/truncated_ratio"] == pytest.approx(sum(s["truncated"] for s in samples) / 4)
        assert all(s["response_tokens"] == max_len for s in samples if s["truncated"])
        assert record["reward/mean"] == pytest.approx(sum(s["reward"] for s in samples) / 4)
        # The math rule's format hit rate (answers in \boxed{}), as a reward log.
        assert record["reward/boxed"] == pytest.approx(sum(s["extra"]["boxed"] for s in samples) / 4)
        for key, field in (("by_difficulty", "difficulty"), ("by_datasource", "datasource")):
            groups = {}
            for s in samples:
                groups.setdefault(s[field], []).append(s["reward"])
            assert {k.rsplit("/", 1)[1]: v for k, v in record.items() if k.startswith(f"reward/{key}/")} == \
                pytest.approx({g: sum(v) / len(v) for g, v in groups.items()}), key
        assert {s["datasource"] for s in samples} == {"add", "sub"}
        assert all(s["prompt"].endswith("=") and s["label"] and s["weight_version"] == record["global_step"] - 1
                   for s in samples)
        # Computed by the learner from the logits it has (never a 0.0 standing for "not computed").
        assert record["actor/entropy"] > 0
    proc = subprocess.run([sys.executable, "-m", "services.cli", "samples", str(run_dir), "--step", "2", "--n", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first = read_samples(run_dir, 2)[0]
    assert f"step 2 | sample 1/1 | prompt {first['prompt_uid']} #0" in proc.stdout and first["prompt"] in proc.stdout


def check_export_keeps_the_checkpoint_dtype(folder) -> None:
    """A bfloat16 checkpoint trained in float32 (no --bf16) is exported in bfloat16, not at twice its size."""
    from safetensors import safe_open

    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_eval_metrics_reach_prometheus_and_plots_merge_records(tmp_path):
    run = tmp_path / "run"
    log = MetricsLog(run, fake_config(tmp_path))
    log.log(1, {"reward/mean": 0.5})
    # An evaluation logged on its own at an already logged step (the data ran out early).
    log.log(1, {"eval/pass@1": 0.25, "eval/pass@4": 0.75, "eval/response_length": 6.0,
                "eval/gsm/pass@1": 0.5, "eval/gsm/response_length": 7.0, "eval/pass@1_ci_low": 0.1})
    log.close()
    sample = prometheus_client.REGISTRY.get_sample_value
    assert sample("rlmesh_coordinator_eval_pass_ratio", {"k": "1", "datasource": "all"}) == 0.25
    assert sample("rlmesh_coordinator_eval_pass_ratio", {"k": "4", "datasource": "all"}) == 0.75
    assert sample("rlmesh_coordinator_eval_pass_ratio", {"k": "1", "datasource": "gsm"}) == 0.5
    assert sample("rlmesh_coordinator_eval_response_length_tokens", {"datasource": "gsm"}) == 7.0
    assert sample("rlmesh_coordinator_eval_pass_ratio", {"k": "1_ci_low", "datasource": "all"}) is None  # not a k
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
