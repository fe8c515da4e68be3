"""The dtype of an exported HF model: never wider than the checkpoint it started from nor than the
training, unless the request names one. The learner's real export of a bfloat16 checkpoint trained
in float32 is asserted in tests/coordinator/test_eval_during_training.py."""

import json

import pytest
import torch

from services.learner.export_dtype import checkpoint_dtype, export_dtype, record_dtype

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("requested, pretrained, training, expected", [
    (None, BF16, F32, BF16),  # SmolLM2's bf16 checkpoint trained on a CPU without --bf16: saved as it came
    (None, F32, F32, F32),
    (None, F32, BF16, BF16),  # --bf16: the training dtype
    (None, F16, BF16, BF16),  # bfloat16 values do not all fit float16's range
    (None, F16, F32, F16),
    (None, None, F32, F32),  # a config without a dtype
    (F32, BF16, F32, F32),  # asked for (--export_dtype float32)
    (F16, F32, BF16, F16),
])
def test_export_dtype(requested, pretrained, training, expected):
    assert export_dtype(requested, pretrained, training) == expected


def test_checkpoint_dtype_reads_either_config_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == BF16
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))  # transformers 4
    assert checkpoint_dtype(tmp_path) == F16
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_dtype(tmp_path) is None
    assert checkpoint_dtype(tmp_path / "missing") is None


def test_record_dtype_rewrites_only_the_dtype(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32", "model_type": "qwen2"}))
    record_dtype(tmp_path, BF16)
    assert json.loads((tmp_path / "config.json").read_text()) == {"dtype": "bfloat16", "model_type": "qwen2"}
    record_dtype(tmp_path / "merged", BF16)  # a folder without a model: nothing to do
    assert not (tmp_path / "merged").exists()
