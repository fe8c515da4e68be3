"""--dry_run: a cluster command is parsed, placed and checked (models, data, reward source) and its
plan printed, with no process, port or Ray connection made; a missing data file fails naming it."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess

import pytest

from services.common.user_errors import run_command
from services.coordinator.cli.train import main


def cluster_command(model, data) -> list[str]:
    """OpenRLHF's two-node slurm script's layout (module swapped), on the tiny model and data."""
    return ["--ref.num_nodes", "2", "--ref.num_gpus_per_node", "4", "--critic.num_nodes", "2",
            "--critic.num_gpus_per_node", "4", "--reward.num_nodes", "2", "--reward.num_gpus_per_node", "4",
            "--actor.num_nodes", "2", "--actor.num_gpus_per_node", "4", "--vllm.num_engines", "4",
            "--vllm.tensor_parallel_size", "2", "--train.colocate_critic_reward", "--train.colocate_actor_ref",
            "--actor.model_name_or_path", str(model), "--reward.model_name_or_path", str(model),
            "--train.micro_batch_size", "8", "--train.batch_size", "128", "--rollout.micro_batch_size", "16",
            "--rollout.batch_size", "16", "--rollout.n_samples_per_prompt", "8", "--data.max_len", "512",
            "--rollout.max_new_tokens", "256", "--ds.zero_stage", "3", "--ds.param_dtype", "bf16",
            "--data.prompt_dataset", str(data), "--data.input_key", "prompt", "--device", "cuda", "--dry_run"]


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fails the test at the first process start, fork, listening socket or Ray connection."""
    def refuse(what):
        def tripped(*args, **kwargs):
            raise AssertionError(f"a dry run must start nothing, but it called {what}")
        return tripped

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("subprocess.Popen"))
    monkeypatch.setattr(os, "fork", refuse("os.fork"))
    monkeypatch.setattr(multiprocessing.Process, "start", refuse("multiprocessing.Process.start"))
    monkeypatch.setattr(socket.socket, "listen", refuse("socket.listen"))
    import ray

    monkeypatch.setattr(ray, "init", refuse("ray.init"))


def test_a_cluster_command_prints_its_plan_and_starts_nothing(tiny_model_dir, tiny_data_dir, nothing_starts, capsys):
    assert main(cluster_command(tiny_model_dir, tiny_data_dir / "arith_train.jsonl")) == 0
    plan = capsys.readouterr().out
    assert "dry run: nothing was started" in plan
    assert "learner   x8   on actor GPUs 0-7 (2 node(s) x 4)" in plan and "ZeRO-3, bf16" in plan
    assert "rollout   x4   on own group of 8 GPUs, tensor parallel 2" in plan
    assert "reference x8   on actor GPUs (one each)" in plan and "reward    x8   on the critic's GPUs" in plan
    assert "GPUs in all: 16" in plan
    assert "usable prompts, " in plan and "global steps of 16 prompts x 8 samples" in plan
    assert "MiB" in plan  # the tiny model's states, estimated from its weight files
    assert not multiprocessing.active_children()


def test_a_missing_data_file_fails_naming_it(tiny_model_dir, tmp_path, nothing_starts, capsys):
    missing = tmp_path / "nowhere" / "train.jsonl"
    assert run_command(main, cluster_command(tiny_model_dir, missing)) == 2
    err = capsys.readouterr().err
    assert f"--prompt_data {missing}: no such file or folder" in err


def test_offline_trainers_and_eval_dry_runs_start_nothing(tiny_model_dir, tiny_data_dir, nothing_starts, capsys):
    from services.coordinator.cli import eval_cli
    from services.learner import train_dpo, train_rm, train_sft

    sft = ["--model.model_name_or_path", str(tiny_model_dir), "--data.dataset", str(tiny_data_dir / "sft.jsonl"),
           "--data.input_key", "prompt", "--data.output_key", "response", "--train.batch_size", "8",
           "--train.micro_batch_size", "2", "--ds.zero_stage", "3", "--dry_run"]
    assert train_sft.main(sft) == 0
    plan = capsys.readouterr().out
    assert "dry run (sft): nothing was started" in plan and "ZeRO-3, fp32" in plan and "optimizer steps" in plan
    dpo = ["--pretrain", str(tiny_model_dir), "--dataset", str(tiny_data_dir / "prefs.jsonl"), "--train_batch_size",
           "8", "--micro_train_batch_size", "2", "--dry_run"]
    assert train_dpo.main(dpo) == 0
    assert "dry run (dpo)" in capsys.readouterr().out
    rm = ["--model.model_name_or_path", str(tiny_model_dir), "--data.dataset", str(tiny_data_dir / "prefs.jsonl"),
          "--data.chosen_key", "chosen", "--data.rejected_key", "rejected", "--train.batch_size", "8",
          "--ds.param_dtype", "bf16", "--dry_run"]
    assert train_rm.main(rm) == 0
    plan = capsys.readouterr().out
    assert "dry run (rm): nothing was started" in plan and "usable rows" in plan and "ZeRO-2, bf16" in plan
    assert run_command(train_sft.main, [*sft[:3], str(tiny_data_dir / "absent.jsonl"), *sft[4:]]) == 2
    assert "absent.jsonl" in capsys.readouterr().err
    evaluation = ["--pretrain", str(tiny_model_dir), "--dataset", str(tiny_data_dir / "arith_test.jsonl"),
                  "--input_key", "prompt", "--reward_func", "math", "--dry_run"]
    assert eval_cli.main(evaluation) == 0
    assert "dry run (eval): nothing was started" in capsys.readouterr().out
