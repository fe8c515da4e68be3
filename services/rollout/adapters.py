"""LoRA adapters on the engine: checking an adapter push against the model, and merging it.

An adapter push (UpdateWeightsRequest.adapter) carries only A and B of every target module T.
The engine merges: it loads W_T + scaling * B @ A, with W_T read again from the --pretrain
checkpoint at every push (so a new adapter replaces the last one instead of stacking on it),
through the same load path as a full push (vLLM's load_weights under Hugging Face names, which
fuses q/k/v and gate/up and shards for tensor parallelism; every worker gets the full tensors).
Decoding then costs what it costs on the full model, and everything else the engines do (prefix
caching, partial rollout, sleep, tensor parallel) works unchanged. vLLM's own LoRA (a new adapter
per weight version, applied beside the base at every forward) would save the merge but slows
every decode step and depends on its LoRA kernels being built for the platform.

The adapter tensors of a push are kept until its final chunk and merged only then, so a push
refused or broken before its end leaves the weights as they were.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
from collections.abc import Iterator, Mapping

import torch

from rlmesh.rollout.v1 import rollout_pb2
from services.common.errors import invalid_argument
from services.common.weights import LoraAdapter, lora_tensor_names
from services.rollout.engine import checkpoint_files


def parse_adapter(msg: rollout_pb2.LoraAdapter, parameters: Mapping[str, tuple[int, ...]]) -> LoraAdapter:
    """Checks an UpdateWeightsRequest.adapter against the model; INVALID_ARGUMENT names what is wrong."""
    if msg.rank < 1:
        raise invalid_argument("adapter.rank", None, f"{msg.rank} is not a rank", "send the adapter's rank r >= 1")
    if not math.isfinite(msg.scaling):
        raise invalid_argument("adapter.scaling", None, f"{msg.scaling} is not finite", "send lora_alpha / r")
    if not msg.target_modules:
        raise invalid_argument("adapter.target_modules", None, "empty", "name every module the adapter adapts")
    seen = set()
    for target in msg.target_modules:
        item = f"target {target!r}"
        if target in seen:
            raise invalid_argument("adapter.target_modules", item, "named twice", "name each module once")
        seen.add(target)
        shape = parameters.get(f"{target}.weight")
        if shape is None or len(shape) != 2:
            raise invalid_argument("adapter.target_modules", item, f"the model has no 2-D weight '{target}.weight'",
                                   "name linear modules of this model by their Hugging Face path, e.g. "
                                   "'model.layers.0.self_attn.q_proj'")
    return LoraAdapter(int(msg.rank), float(msg.scaling), tuple(msg.target_modules))


def merged_weight(adapter: LoraAdapter, target: str, tensors: Mapping[str, torch.Tensor], base_weight: torch.Tensor,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """W_T + scaling * B @ A of target T, in `dtype` on `device`, summed in float32.

    tensors: the pushed adapter tensors by name; base_weight: T's (out, in) --pretrain weight.
    """
    a_name, b_name = lora_tensor_names(target)
    a = tensors[a_name].to(device, torch.float32)  # (r, in)
    b = tensors[b_name].to(device, torch.float32)  # (out, r)
    weight = base_weight.to(device, torch.float32)  # (out, in)
    return (weight + adapter.scaling * (b @ a)).to(dtype)


def adapter_weights(adapter: LoraAdapter, tensors: Mapping[str, torch.Tensor], base: CheckpointWeights,
                    previous: tuple[str, ...], dtype: torch.dtype,
                    device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """What an engine loads for an adapter push, one weight at a time (Hugging Face names): the
    merged weight of every target, and the --pretrain weight of every target of the `previous`
    adapter that this one does not adapt, so nothing of the previous adapter stays."""
    targets = {f"{t}.weight": t for t in adapter.targets}
    stale = [f"{t}.weight" for t in previous if t not in adapter.targets]
    for name, weight in base.tensors([*targets, *stale]):
        if name in targets:
            yield name, merged_weight(adapter, targets[name], tensors, weight, dtype, device)
        else:
            yield name, weight.to(device, dtype)


def checkpoint_with_adapter(adapter: LoraAdapter, tensors: Mapping[str, torch.Tensor], base: CheckpointWeights,
                            dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the --pretrain checkpoint, the targets' weights merged with the adapter: for an
    engine that reloads its whole model (vLLM on the CPU), one tensor at a time, on the CPU."""
    targets = {f"{t}.weight": t for t in adapter.targets}
    for name, weight in base.tensors(base.names()):
        if name in targets:
            yield name, merged_weight(adapter, targets[name], tensors, weight, dtype, torch.device("cpu"))
        else:
            yield name, weight


class CheckpointWeights:
    """The --pretrain checkpoint's tensors, read from its safetensors files when asked.

    Nothing is kept in memory between pushes: the files are memory-mapped, so the base weights
    of a push come from the OS page cache, one copy shared by every tensor-parallel worker.
    """

    def __init__(self, model_dir: str | pathlib.Path):
        from safetensors import safe_open

        self.files: dict[str, pathlib.Path] = {}
        for path in checkpoint_files(pathlib.Path(model_dir)):
            with safe_open(str(path), framework="pt") as f:
                self.files.update({name: path for name in f.keys()})

    def names(self) -> list[str]:
        return list(self.files)

    def tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor in the file's dtype) for each of `names`, in that order, read one at a time."""
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            opened = {}
            for name in names:
                path = self.files[name]
                if path not in opened:
                    opened[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                yield name, opened[path].get_tensor(name)
