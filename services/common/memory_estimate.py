"""Rough GPU memory of a model's states, for the plans that --dry_run prints.

Parameters are counted from a local model folder's weight files (their bytes over the bytes per
parameter of config.json's torch_dtype), nothing is loaded. The learner's share per GPU follows
DeepSpeed ZeRO's partitioning of its states (weights, gradients, Adam's two moments and, in
bfloat16 training, fp32 master weights) over the ranks; activations, the CUDA context and
allocator slack come on top and are not counted.
"""

from __future__ import annotations

import json
import pathlib

GIB = 1024 ** 3
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def parameter_count(model_dir: str) -> int | None:
    """Parameters of the model in `model_dir` from its weight files; None when the folder has none here."""
    folder = pathlib.Path(model_dir) if model_dir else None
    if folder is None or not (folder / "config.json").is_file():
        return None
    files = [f for f in folder.iterdir() if f.suffix in _WEIGHT_SUFFIXES and f.name != "training_args.bin"]
    if not files:
        return None
    dtype = json.loads((folder / "config.json").read_text()).get("torch_dtype") or "float32"
    return sum(f.stat().st_size for f in files) // _DTYPE_BYTES.get(str(dtype), 4)


def learner_state_bytes(params: int, ranks: int, zero_stage: int, bf16: bool, adam_offload: bool = False,
                        trainable_fraction: float = 1.0) -> int:
    """Bytes of one rank's training states: weights, gradients and optimizer states under ZeRO.

    trainable_fraction: share of the parameters that train (LoRA adapters: a small one)."""
    width = 2 if bf16 else 4
    trained = params * trainable_fraction
    weights = params * width
    grads = trained * width
    optimizer = trained * (8 + (4 if bf16 else 0))  # Adam moments (fp32), and fp32 master weights in bf16
    if adam_offload:
        optimizer = 0  # in host memory
    ranks = max(1, ranks)
    if zero_stage >= 1:
        optimizer /= ranks
    if zero_stage >= 2:
        grads /= ranks
    if zero_stage >= 3:
        weights /= ranks
    return int(weights + grads + optimizer)


def weights_bytes(params: int, bf16: bool, shards: int = 1) -> int:
    """Bytes of inference-only weights (a reference or reward model, an engine's tensor-parallel shard)."""
    return params * (2 if bf16 else 4) // max(1, shards)


def gib(value: int | float | None) -> str:
    if value is None:
        return "unknown (no local model folder)"
    return f"{value / GIB:.1f} GiB" if value >= 0.1 * GIB else f"{value / 1024 ** 2:.1f} MiB"
