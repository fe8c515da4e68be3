"""Offline trainers resume like the RL trainer: --save_steps writes resumable DeepSpeed checkpoints
to --ckpt_path, and --load_checkpoint continues from the newest complete one at its step, data
position, optimizer and learning-rate schedule.

The uninterrupted run saves a checkpoint half-way; a second run started from that checkpoint (what
a run killed after it would restart from: the checkpoint is complete once its marker exists, and
nothing after it counts) must end with the same weights and log the same losses for the steps it
trains.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def sft(tiny_model_dir, data: Path, save: Path, ckpt: Path, *extra: str) -> str:
    command = [sys.executable, "-m", "services.learner.train_sft", "--pretrain", str(tiny_model_dir),
               "--dataset", str(data), "--input_key", "prompt", "--output_key", "response", "--apply_chat_template",
               "--max_samples", "64", "--train_batch_size", "16", "--micro_train_batch_size", "8",
               "--learning_rate", "1e-3", "--lr_scheduler", "cosine_with_min_lr", "--lr_warmup_ratio", "0.25",
               "--save_steps", "2", "--save_path", str(save), "--ckpt_path", str(ckpt), "--seed", "3", *extra]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                               "TOKENIZERS_PARALLELISM": "false"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def train_losses(folder: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_resumed_sft_equals_the_uninterrupted_run(tiny_model_dir, tiny_data_dir, tmp_path):
    data = tiny_data_dir / "sft.jsonl"
    whole, ckpt = tmp_path / "whole", tmp_path / "ckpt"
    sft(tiny_model_dir, data, whole, ckpt)
    assert (ckpt / "global_step_2" / "learner.json").is_file() and (ckpt / "latest").read_text() == "global_step_2"
    resumed = tmp_path / "resumed"
    output = sft(tiny_model_dir, data, resumed, ckpt, "--load_checkpoint")
    assert "checkpoint.loaded" in output and "step=2" in output
    # Steps 3 and 4 only, on the same rows with the same weights and learning rate as before.
    first, second = train_losses(whole), train_losses(resumed)
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [3, 4]
    for step in (3, 4):
        assert abs(first[step] - second[step]) < 1e-5, (step, first[step], second[step])
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
    # And training did move them: the final weights are not the initial ones.
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(initial[n], a[n]) for n in a)
