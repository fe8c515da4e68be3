"""LoRA adapters on the trained model (PEFT), and the adapter's parameters under the engines' names.

With --lora_rank r > 0 every targeted linear layer W of the loaded model gets a low-rank update
W + (alpha / r) * B @ A (A: (r, in), B: (out, r), B starting at zero, so the first forward equals
the base model's); only A and B train (and, for a reward model, its head `score`), the base weights
stay frozen. It is applied after the model is loaded and before DeepSpeed wraps it:

    model = apply_lora(model, LoraOptions(rank=8, alpha=16), kind="causal_lm")
    for name, p in adapter_state(model): ...   # model.layers.0.self_attn.q_proj.lora_A.weight, ...

adapter_state gives the names vLLM's and PEFT's adapter files use without their prefix
(`base_model.model.`): the module path of the targeted layer, then lora_A.weight / lora_B.weight.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

import torch

# The adapter PEFT creates when none is named; its name sits inside every adapter parameter's.
ADAPTER_NAME = "default"
PEFT_PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"
# A reward model / critic is the backbone plus a new head `score` (token classification): the head
# is trained in full, beside the adapter.
HEAD_MODULES = ("score",)


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """One adapter's shape: rank (0 = no LoRA), alpha, the targeted modules, dropout on its input."""

    rank: int = 0
    alpha: float = 16.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    dropout: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def scaling(options: LoraOptions) -> float:
    """The factor on B @ A in the forward pass (the engines apply the same)."""
    return options.alpha / options.rank


def _task_type(kind: str):
    from peft import TaskType

    return {"causal_lm": TaskType.CAUSAL_LM, "critic": TaskType.TOKEN_CLS}[kind]


def lora_config(options: LoraOptions, kind: str = "causal_lm"):
    """The peft.LoraConfig of `options` for a model of `kind` ("causal_lm" or "critic")."""
    from peft import LoraConfig

    targets = list(options.target_modules)
    return LoraConfig(
        task_type=_task_type(kind), r=options.rank, lora_alpha=options.alpha, lora_dropout=options.dropout,
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets, bias="none",
        modules_to_save=list(HEAD_MODULES) if kind == "critic" else None)


def apply_lora(model: torch.nn.Module, options: LoraOptions, kind: str = "causal_lm") -> torch.nn.Module:
    """The PeftModel of `model` with a new adapter: only the adapter (and a critic's head) trains.

    Call it after loading (and after gradient_checkpointing_enable: with checkpointing the frozen
    embedding's output must require grad for the adapter's gradients to flow through the
    recomputed blocks) and before deepspeed.initialize.
    """
    from peft import get_peft_model

    if getattr(model, "is_gradient_checkpointing", False):
        model.enable_input_require_grads()
    # autocast_adapter_dtype=False: the adapter takes the base model's dtype, as DeepSpeed's bf16
    # engine expects of every parameter.
    return get_peft_model(model, lora_config(options, kind), autocast_adapter_dtype=False)


_ADAPTER_SEGMENT = re.compile(rf"\.(lora_[A-Za-z_]+)\.{ADAPTER_NAME}(?=\.|$)")


def engine_name(peft_name: str) -> str | None:
    """base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight ->
    model.layers.0.self_attn.q_proj.lora_A.weight; None for a parameter not of the adapter."""
    if not _ADAPTER_SEGMENT.search(peft_name):
        return None
    name = peft_name.removeprefix(PEFT_PREFIX)
    return _ADAPTER_SEGMENT.sub(r".\1", name)


def adapter_state(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters (lora_A, lora_B), in module order, under the engines' names.

    `model` is the PeftModel (a DeepSpeed engine's .module). Under ZeRO-3 each is its partition's
    placeholder (ds_shape holds the real shape): gather before reading.
    """
    found = []
    for name, p in model.named_parameters():
        short = engine_name(name)
        if short is not None:
            found.append((short, p))
    return found


def is_peft_model(model: torch.nn.Module) -> bool:
    # A PeftModel exists only once peft is imported (apply_lora, or a user's code loading one); a
    # learner without LoRA asks at every push, and importing peft to answer costs ~0.2 s of CPU.
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


_BASE_LAYER = ".base_layer."
_HEAD_COPY = f".modules_to_save.{ADAPTER_NAME}."


def merged_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A PEFT model's state dict (PeftModel.state_dict() names) -> the base model's, each adapted
    weight W (out, in) replaced by W + scale * B @ A (B: (out, r), A: (r, in)), in W's dtype.

    A head trained beside the adapter (modules_to_save) comes out under its own name; the frozen
    original of that head is dropped.
    """
    merged: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if engine_name(name) is not None or ".original_module." in name:
            continue
        plain = name.removeprefix(PEFT_PREFIX)
        if _BASE_LAYER in plain:
            module, _, field = plain.partition(_BASE_LAYER)
            plain = f"{module}.{field}"
            lora_a = state.get(f"{PEFT_PREFIX}{module}.lora_A.{ADAPTER_NAME}.weight")
            if field == "weight" and lora_a is not None:
                lora_b = state[f"{PEFT_PREFIX}{module}.lora_B.{ADAPTER_NAME}.weight"]
                value = (value.float() + scale * (lora_b.float() @ lora_a.float())).to(value.dtype)
        plain = plain.replace(_HEAD_COPY, ".")
        merged[plain] = value
    return merged


def save_adapter(module: torch.nn.Module, state: dict[str, torch.Tensor], path: pathlib.Path,
                 options: LoraOptions, merge: bool) -> None:
    """Writes the PEFT adapter folder of `module` (a PeftModel) from its full state dict: path/
    adapter_config.json and adapter_model.safetensors, which peft.PeftModel.from_pretrained and vLLM
    load over the base model; with `merge` also path/merged/, the base model with the adapter
    merged in (a plain Hugging Face model folder, without tokenizer files)."""
    module.save_pretrained(path, state_dict=state, safe_serialization=True)
    if merge:
        base = module.get_base_model()
        base.save_pretrained(path / "merged", state_dict=merged_state_dict(state, scaling(options)),
                             safe_serialization=True)
