"""The LoRA flags checked together, and against the model, before any service or rank starts.

The coordinator's config and the offline trainers' configs call check_lora in validate(): a
value the adapter cannot take, or a target module the model lacks, fails there with the flag and
the fix, not minutes later inside a learner rank. The model is built from its config.json on the
meta device (no weights are read), which takes about a second.
"""

from __future__ import annotations

from services.common.config_error import ConfigError

DEFAULT_ALPHA = 16.0
ALL_LINEAR = "all-linear"


def check_lora(rank: int, alpha: float, target_modules: list[str], dropout: float, pretrain: str,
               kind: str = "causal_lm") -> None:
    """ConfigError naming the flag when the LoRA options are inconsistent or name a module the model
    at `pretrain` lacks. rank 0 (no LoRA) with another LoRA option changed is an error too: the
    user meant LoRA and would train every weight."""
    if rank < 0:
        raise ConfigError(f"--lora_rank {rank} must be >= 0 (0 = no LoRA; e.g. 16)")
    changed = [name for name, value, default in (("lora_alpha", alpha, DEFAULT_ALPHA),
                                                 ("target_modules", list(target_modules), [ALL_LINEAR]),
                                                 ("lora_dropout", dropout, 0.0)) if value != default]
    if rank == 0:
        if changed:
            raise ConfigError(f"--{changed[0]} is a LoRA option, but --lora_rank is 0 (LoRA off: every weight "
                              "trains); give --lora_rank N (e.g. 16) to train an adapter, or drop "
                              f"--{' / --'.join(changed)}")
        return
    if alpha <= 0:
        raise ConfigError(f"--lora_alpha {alpha} must be > 0 (e.g. 16; the update is scaled by alpha / rank)")
    if not 0 <= dropout < 1:
        raise ConfigError(f"--lora_dropout {dropout} must be in [0, 1) (e.g. 0.05; 0 = none)")
    if not target_modules:
        raise ConfigError("--target_modules is empty: give module names (q_proj v_proj ...) or all-linear")
    if ALL_LINEAR in target_modules and len(target_modules) > 1:
        raise ConfigError(f"--target_modules {' '.join(target_modules)}: all-linear already means every linear "
                          "layer; give it alone, or list the modules without it")
    if pretrain and target_modules != [ALL_LINEAR]:
        model = _meta_model(pretrain, kind)
        names = [name for name, _ in model.named_modules() if name]
        linear = linear_suffixes(model)
        for target in target_modules:
            if not any(name == target or name.endswith("." + target) for name in names):
                raise ConfigError(f"--target_modules {target}: the model {pretrain} has no such module; its linear "
                                  f"modules are {', '.join(linear)}")


def _meta_model(pretrain: str, kind: str):
    """The model of `pretrain`'s config.json with its parameters on the meta device (no memory)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(pretrain)
    auto = transformers.AutoModelForTokenClassification if kind == "critic" else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def linear_suffixes(model) -> list[str]:
    """The last part of the name of every linear layer, in model order, each once (q_proj, k_proj, ...)."""
    import torch

    seen: dict[str, None] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            seen.setdefault(name.rsplit(".", 1)[-1], None)
    return list(seen)
