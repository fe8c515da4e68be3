"""The router load-balancing loss of mixture-of-experts models (--aux_loss_coef).

A MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) asked for `output_router_logits` returns each
layer's router logits; transformers' causal LM turns them into `aux_loss`, the Switch-Transformer
balancing loss over the non-padding tokens (without labels it is not added to any loss). The
trainers add aux_loss_coef x aux_loss to each micro-batch's loss, as OpenRLHF does. Forwards that
run the backbone alone (services.learner.logprob_head) get the router logits from it, and the
same loss comes from the model's own module's load_balancing_loss_func.
"""

from __future__ import annotations

import sys

import torch

ROUTER_KWARGS = {"output_router_logits": True}


def causal_lm(model):
    """The transformers causal LM inside a DeepSpeed engine and / or a PEFT wrapper."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def router_aux_loss(model, outputs, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The balancing loss of a forward run with ROUTER_KWARGS: the outputs' aux_loss (a causal LM's),
    or computed from their router_logits (a backbone's). attention_mask: (B, T) of that forward, or
    None for a packed row (no padding). ValueError for a model that returned neither."""
    aux = getattr(outputs, "aux_loss", None)
    if aux is not None:
        return aux
    lm = causal_lm(model)
    router_logits = getattr(outputs, "router_logits", None)
    balancing = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
    if not router_logits or balancing is None:
        raise ValueError(f"{type(lm).__name__} returned no router logits: --aux_loss_coef needs a "
                         "mixture-of-experts model")
    return balancing(router_logits, lm.num_experts, lm.num_experts_per_tok, attention_mask)
