"""Log-probs of the response tokens without materialising (tokens, vocabulary) logits.

With a 151k vocabulary the logits of one micro-batch (and their float32 log-softmax, and the
gradient of both) dominate a training step's memory and a good share of its time; they also cover
the prompt tokens, which the losses never look at. Here the backbone runs once, the hidden states
of the response positions are picked out, and the output projection + log-softmax run over
`chunk_tokens` of them at a time, each chunk recomputed in the backward pass (activation
checkpointing), so at most one chunk's logits exist at any moment.

Numerically this is log_softmax computed as z[label] - logsumexp(z), on the same float32 logits as
services.common.logprobs.token_logprobs; results agree to float rounding, not bit for bit.
ZeRO stages 0-2 only (under ZeRO-3 the projection's weight is a shard).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
           want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (n, H), weight (V, H), labels (n,) -> log-probs (n,) and entropies (n,) (zeros if not wanted)."""
    z = (hidden @ weight.t()).float()  # (n, V)
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels[:, None])[:, 0] - lse
    if want_entropy:
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    else:
        entropy = torch.zeros_like(lse)
    return logp, entropy


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     chunk_tokens: int = 4096, want_entropy: bool = False):
    """hidden (N, H), weight (V, H) of the output projection, labels (N,) ->
    (log-probs (N,) float32, entropies (N,) float32 or None), chunk_tokens rows at a time."""
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start:start + chunk_tokens], labels[start:start + chunk_tokens]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            lp, ent = checkpoint(_chunk, h, weight, y, temperature, want_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk(h, weight, y, temperature, want_entropy)
        logps.append(lp)
        entropies.append(ent)
    logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
    return logp, (torch.cat(entropies) if want_entropy and entropies else None)


def response_outputs(model, mb, temperature: float, chunk_tokens: int, want_entropy: bool):
    """(B, R) log-probs (and entropies) of a MicroBatch's response tokens under a causal LM.

    model: a transformers *ForCausalLM whose logits are lm_head(last hidden state) (Qwen2, Llama).
    """
    base, head = model.base_model, model.get_output_embeddings()
    if mb.attention_mask is not None:
        from services.common.logprobs import position_ids_from_mask

        out = base(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                   position_ids=position_ids_from_mask(mb.attention_mask), use_cache=False)
    else:
        out = base(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
    hidden = out.last_hidden_state  # (rows, T, H)
    width = hidden.shape[-1]
    picked = hidden[:, :-1].reshape(-1, width)[mb.out_index.reshape(-1)]  # (B*R, H)
    labels = mb.input_ids[:, 1:].reshape(-1)[mb.out_index.reshape(-1)]
    logp, entropy = chunked_logprobs(picked, head.weight, labels, temperature, chunk_tokens, want_entropy)
    shape = mb.out_index.shape
    return logp.view(shape), (entropy.view(shape) if entropy is not None else None)
