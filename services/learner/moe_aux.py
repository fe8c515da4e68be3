"""The router load-balancing loss of mixture-of-experts models (--aux_loss_coef).

A MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) asked for `output_router_logits` returns each
layer's router logits; transformers' causal LM turns them into `aux_loss`, the Switch-Transformer
balancing loss over the non-padding tokens (without labels it is not added to any loss). The
trainers add aux_loss_coef x aux_loss to each micro-batch's loss, as OpenRLHF does. Forwards that
run the backbone alone (services.learner.logprob_head; the critic's and reward model's values,
services.learner.token_values) get the router logits from it, and the same loss comes from the
model's own module's load_balancing_loss_func.
"""

from __future__ import annotations

import sys

import torch

ROUTER_KWARGS = {"output_router_logits": True}


def transformers_model(model):
    """The transformers model (a causal LM, or a critic's token-classification model) inside a DeepSpeed
    engine and / or a PEFT wrapper."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def router_aux_loss(model, outputs, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The balancing loss of a forward run with ROUTER_KWARGS: the outputs' aux_loss (a causal LM's),
    or computed from their router_logits (a backbone's). attention_mask: (B, T) of that forward, or
    None for a packed row (no padding). ValueError for a model that returned neither."""
    aux = getattr(outputs, "aux_loss", None)
    if aux is not None:
        return aux
    lm = transformers_model(model)
    router_logits = getattr(outputs, "router_logits", None)
    balancing = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
    if not router_logits or balancing is None:
        raise ValueError(f"{type(lm).__name__} returned no router logits: --aux_loss_coef needs a "
                         "mixture-of-experts model")
    return balancing(router_logits, *expert_counts(lm), attention_mask)


def expert_counts(lm) -> tuple[int, int]:
    """(experts, experts per token) of a MoE model: a causal LM's own attributes, else its config's (a
    token-classification model has only the config: num_local_experts for Mixtral, num_experts for the
    Qwen MoE models)."""
    config = lm.config
    experts = getattr(lm, "num_experts", None) or getattr(config, "num_local_experts", None) or config.num_experts
    return experts, getattr(lm, "num_experts_per_tok", None) or config.num_experts_per_tok
