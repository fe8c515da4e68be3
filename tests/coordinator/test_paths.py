"""Paths are the user's: a run started from another folder with relative paths reads its model and
data there and writes its checkpoints, final model and run folder there, although the services it
starts run in the repository root."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.common import paths
from services.common.config import ConfigError
from services.coordinator.loop import checkpoint
from tests.coordinator.conftest import REPO, finish, read_metrics, service_env


def test_a_run_from_another_folder_keeps_every_path_there(tiny_model_dir, tiny_data_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model").symlink_to(tiny_model_dir)
    (elsewhere / "prompts.jsonl").symlink_to(tiny_data_dir / "arith_train.jsonl")
    name = f"paths_test_{os.getpid()}"  # names the default run folder runs/<name>
    argv = ["--pretrain", "model", "--prompt_data", "prompts.jsonl", "--input_key", "prompt", "--label_key", "label",
            "--reward_func", "math", "--init_kl_coef", "0", "--advantage_estimator", "rloo",
            "--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--generate_max_len", "8", "--prompt_max_len", "64", "--max_steps", "1",
            "--rollout_engine", "hf", "--ckpt_path", f"out/{name}", "--save_steps", "1", "--save_path", "final"]
    log = tmp_path / "coordinator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.coordinator.train_ppo_ray", *argv], cwd=elsewhere,
                                env={**service_env(), "PYTHONPATH": str(REPO)}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    output = finish(proc, log, timeout_s=900)
    assert proc.returncode == 0, output[-6000:]
    ckpt = elsewhere / "out" / name
    assert checkpoint.latest_step(ckpt) == 1
    step = ckpt / "global_step_1"
    # Both halves of the checkpoint in one folder: the learner's (marker, DeepSpeed files) and the coordinator's.
    assert (step / "learner.json").is_file() and (step / "actor").is_dir() and (step / "coordinator.json").is_file()
    assert (elsewhere / "final" / "config.json").is_file()
    run_dir = elsewhere / "runs" / name
    assert [r["global_step"] for r in read_metrics(run_dir)] == [1]
    assert (run_dir / "logs" / "learner.log").is_file() or any((run_dir / "logs").iterdir())
    for stray in (REPO / "runs" / name, REPO / "out" / name, REPO / "final"):
        assert not stray.exists(), f"{stray} written in the repository instead of the user's folder"


def test_relative_paths_become_absolute_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(paths.WORKDIR_ENV, raising=False)
    assert paths.absolute_paths("a.jsonl, sub/b.jsonl", "prompt_data") == f"{tmp_path}/a.jsonl,{tmp_path}/sub/b.jsonl"
    assert paths.absolute_path("http://host:5000/get_reward", "remote_rm_url") == "http://host:5000/get_reward"
    assert paths.absolute_path("/abs/x", "pretrain") == "/abs/x"
    monkeypatch.setenv(paths.WORKDIR_ENV, "/shared/job")
    assert paths.absolute_path("./ckpt", "ckpt_path", output=True) == "/shared/job/ckpt"


def test_ray_working_dir_copy_refuses_relative_outputs(tmp_path, monkeypatch):
    """Under `ray job submit --runtime-env-json '{"working_dir": ...}'` the driver runs in Ray's
    temporary copy: a relative checkpoint folder would vanish with it."""
    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    monkeypatch.delenv(paths.WORKDIR_ENV, raising=False)
    assert paths.absolute_path("data/prompts.jsonl", "prompt_data") == "data/prompts.jsonl"  # same copy on every worker
    with pytest.raises(ConfigError, match=f"--ckpt_path ./checkpoints/x is relative.*{paths.WORKDIR_ENV}"):
        paths.absolute_path("./checkpoints/x", "ckpt_path", output=True)
    monkeypatch.setenv(paths.WORKDIR_ENV, "/openrlhf")
    assert paths.absolute_path("./checkpoints/x", "ckpt_path", output=True) == "/openrlhf/checkpoints/x"
