"""The dtype of an exported Hugging Face model (ExportHF: the final model, --save_hf_ckpt exports).

Without a dtype in the request the export is never wider than the model it started from, nor than
the training: a bfloat16 checkpoint trained in float32 (the CPU default, without --bf16) is saved in
bfloat16, as it came, not at twice its size; a model trained with --bf16 is saved in bfloat16; only
a float32 checkpoint trained in float32 is saved in float32. ExportHFRequest.dtype (the
coordinator's --export_dtype) overrides the rule.

The DeepSpeed checkpoints (SaveCheckpoint) are not concerned: they keep the float32 master weights
and the optimizer's states, which resuming needs.
"""

from __future__ import annotations

import json
import pathlib

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(folder: str | pathlib.Path) -> torch.dtype | None:
    """The dtype a Hugging Face folder's config.json declares ("dtype", or the older "torch_dtype"), or None."""
    try:
        config = json.loads((pathlib.Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return _DTYPES.get(str(name).removeprefix("torch.")) if name else None


def record_dtype(folder: str | pathlib.Path, dtype: torch.dtype) -> None:
    """Writes `dtype` into a saved folder's config.json: transformers' save_pretrained records the module's
    own dtype there (float32 while training in float32) even when the tensors it writes are converted."""
    path = pathlib.Path(folder) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_dtype(requested: torch.dtype | None, pretrained: torch.dtype | None, training: torch.dtype) -> torch.dtype:
    """The requested dtype; else the training dtype when it is a 16-bit one; else the checkpoint's (or float32)."""
    if requested is not None:
        return requested
    if training != torch.float32:
        return training
    return pretrained or torch.float32
