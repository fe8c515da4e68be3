"""Per-token values of a critic or reward model, with the MoE router's load-balancing loss when asked.

Both models are a transformers *ForTokenClassification with one label: the backbone, then a linear
head `score` on each token's hidden state (services.learner.deepspeed_setup.load_pretrained, dropout
0). transformers' token-classification forward drops the backbone's router logits, so for the router
loss the backbone and the head are called here one after the other, as that forward does. OpenRLHF
adds the same loss to its critic's loss (--actor.aux_loss_coef) and its reward model's
(--model.aux_loss_coef): services.learner.moe_aux.
"""

from __future__ import annotations

import torch

from services.learner import moe_aux
from services.learner.logprob_head import backbone_kwargs, forward_micro_batch


def token_values(model, mb, want_aux: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """((rows, T) values of a MicroBatch's tokens, in the model's dtype; the router loss, a scalar
    with grad, when want_aux, else None). model: the DeepSpeed engine, a PEFT model or the
    transformers model itself."""
    if not want_aux:
        return forward_micro_batch(model, mb).logits.squeeze(-1), None
    module = moe_aux.transformers_model(model)
    outputs = module.base_model(**backbone_kwargs(module, mb), **moe_aux.ROUTER_KWARGS)
    values = module.score(module.dropout(outputs.last_hidden_state)).squeeze(-1)  # (rows, T)
    return values, moe_aux.router_aux_loss(module, outputs, mb.attention_mask)
