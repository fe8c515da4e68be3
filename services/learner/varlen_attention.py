"""Variable-length causal attention for transformers models: the `varlen` attention implementation.

Packed micro-batches put many samples end to end in one row; attention must stay within each
sample. transformers does this for `sdpa` with a (tokens x tokens) block mask, which sends the
attention to slow masked kernels, and for `flash_attention_2` only with the separate flash-attn
package. This module registers `varlen` with transformers' AttentionInterface: on CUDA it calls
PyTorch's own FlashAttention kernel for variable-length sequences (torch.nn.attention.varlen,
forward and backward); elsewhere it runs causal sdpa per sequence, slower but the same maths, so
the CPU tests check the sequence boundaries that the GPU kernel relies on.

Where the sequences start is given as cumulative lengths (`cu_seq_lens_q`, `max_length_q`, the
keyword names transformers uses for flash attention), passed to the model's forward:

    model(input_ids=ids, position_ids=pos, **packed_kwargs(lengths, device))

Without them, a 2-D padding mask (right or left padding) or else one sequence per row is assumed.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

NAME = "varlen"


def cumulative_lengths(lengths: list[int], device) -> torch.Tensor:
    """[3, 5] -> tensor([0, 3, 8], int32): where each packed sequence starts, and the total."""
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def packed_kwargs(lengths: list[int], device) -> dict:
    """Model-forward keyword arguments describing one row of sequences of these lengths end to end."""
    cu = cumulative_lengths(lengths, device)
    longest = max(lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


@functools.cache
def _varlen_attn():
    """torch's varlen_attn and the names of its parameters (they differ between torch releases)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(q, k, v, cu, longest: int, scale: float | None) -> torch.Tensor:
    """q (N, Hq, D), k/v (N, Hkv, D), cu (S+1,) int32 -> (N, Hq, D), causal within each sequence."""
    varlen_attn, params = _varlen_attn()
    extra = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # older torch: expand the key/value heads (small next to the queries)
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, **extra)


def _sdpa_per_sequence(q, k, v, cu, scale: float | None) -> torch.Tensor:
    """The same as _flash_varlen, one causal sdpa call per sequence (any device)."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        # (1, H, n, D) views of this sequence
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        out[start:end] = o[0].transpose(0, 1)
    return out


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     sliding_window=None, **kwargs):
    """transformers attention interface: query (B, Hq, T, D), key/value (B, Hkv, T, D) ->
    ((B, T, Hq, D), None)."""
    if dropout:
        raise ValueError("the varlen attention has no dropout; set attention_dropout to 0 in the model config")
    if sliding_window is not None:
        raise ValueError("the varlen attention has no sliding window; use attn_implementation sdpa for this model")
    B, Hq, T, D = query.shape
    # (B, H, T, D) -> (B*T, H, D); transformers' projections leave (B, T, H, D) in memory, so the
    # transpose back is free for the queries.
    q = query.transpose(1, 2).reshape(B * T, Hq, D)
    k = key.transpose(1, 2).reshape(B * T, key.shape[1], D)
    v = value.transpose(1, 2).reshape(B * T, value.shape[1], D)
    keep = None
    if kwargs.get("cu_seq_lens_q") is not None:
        cu, longest = kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
    elif attention_mask is not None and attention_mask.dim() == 2:
        # Padded rows: drop the padding, each row's real tokens are one sequence.
        mask = attention_mask.bool()
        counts = mask.sum(-1)
        keep = mask.reshape(-1).nonzero().squeeze(-1)
        q, k, v = q[keep], k[keep], v[keep]
        cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
        longest = int(counts.max())
    elif attention_mask is None:
        cu = torch.arange(0, (B + 1) * T, T, device=query.device, dtype=torch.int32)
        longest = T
    else:
        raise ValueError(f"the varlen attention takes a 2-D padding mask or none, got shape {list(attention_mask.shape)}")
    if query.is_cuda:
        out = _flash_varlen(q, k, v, cu, longest, scaling)
    else:
        out = _sdpa_per_sequence(q, k, v, cu, scaling)
    if keep is not None:
        full = out.new_zeros(B * T, Hq, D)
        full[keep] = out
        out = full
    return out.view(B, T, Hq, D), None


def register() -> None:
    """Makes attn_implementation="varlen" known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention)
    # The same mask handling as flash attention: None when there is no padding, else the 2-D mask.
    AttentionMaskInterface.register(NAME, flash_attention_mask)
