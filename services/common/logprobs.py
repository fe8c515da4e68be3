"""Per-token log-probs of a causal LM: the one function the learner and the reference role share,
so their numbers agree bit for bit on the same hardware."""

import torch


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                   chunk_rows: int = 8) -> torch.Tensor:
    """log softmax(logits / temperature)[labels].

    logits: (B, T, V); labels: (B, T) int. Returns (B, T) float32. Works on `chunk_rows` rows at a
    time so that the (rows, T, V) float32 log-softmax never covers the whole batch at once.
    """
    out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], chunk_rows):
        rows = logits[start:start + chunk_rows].float()
        if temperature != 1.0:
            rows = rows / temperature
        logp = torch.log_softmax(rows, dim=-1)  # (b, T, V)
        out[start:start + chunk_rows] = logp.gather(-1, labels[start:start + chunk_rows].unsqueeze(-1)).squeeze(-1)
    return out


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B, T) positions counting only real tokens (left or right padding)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t = 1..T-1.

    input_ids, attention_mask: (B, T). Returns (B, T-1) float32; entries at padding are
    meaningless and must be masked by the caller.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    return token_logprobs(out.logits[:, :-1, :], input_ids[:, 1:], temperature)
