"""Offline trainers with --use_ds_universal_ckpt: an SFT run saved under ZeRO-2 resumes under ZeRO-3
(the checkpoint converted to DeepSpeed's universal checkpoint) and trains the steps after the
checkpoint with the losses of the uninterrupted run and ends with its weights, up to float32
rounding; without the flag the resume stops with an error naming it."""

import pytest
import torch
from safetensors.torch import load_file

from services.learner import offline_checkpoint
from tests.learner.test_offline_resume import sft, train_losses


def test_sft_saved_under_zero2_resumes_under_zero3(tiny_model_dir, tiny_data_dir, tmp_path):
    data = tiny_data_dir / "sft.jsonl"
    whole, ckpt = tmp_path / "whole", tmp_path / "ckpt"
    sft(tiny_model_dir, data, whole, ckpt, "--zero_stage", "2")
    assert (ckpt / "latest").read_text() == "global_step_2"

    # The trainers' resume entry refuses it before touching the engine (none is needed to say so).
    with pytest.raises(SystemExit, match=r"ZeRO stage 2 on 1 ranks.*--use_ds_universal_ckpt"):
        offline_checkpoint.load_latest(None, ckpt, world=1, zero_stage=3)

    resumed = tmp_path / "resumed"
    output = sft(tiny_model_dir, data, resumed, ckpt, "--zero_stage", "3", "--use_ds_universal_ckpt",
                 "--load_checkpoint")
    assert "checkpoint.universal" in output and "checkpoint.loaded" in output and "step=2" in output
    first, second = train_losses(whole), train_losses(resumed)
    assert sorted(second) == [3, 4]
    for step in (3, 4):
        assert abs(first[step] - second[step]) < 1e-5, (step, first[step], second[step])
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)
