"""Log-probs of the response tokens from the last hidden states, without full float32 logits.

With a 151k vocabulary the logits of a micro-batch, their float32 log-softmax and the gradients
of both dominate a training step's memory and a good share of its time; they also cover prompt
tokens and padding, which the losses never look at. Here the backbone runs once, the hidden states
of the real response tokens are picked out, and the output projection + log-softmax run on those
alone, in one of two ways (`--logprobs_head`):

- chunked: `chunk_tokens` rows at a time, each chunk's logits recomputed in the backward pass
  (activation checkpointing): at most one chunk of logits exists at any moment. Least memory.
- fused: one (tokens, vocabulary) buffer in the model's dtype holds the logits, then, overwritten
  in place by one kernel pass, d log p / d logits (= (onehot - softmax) / temperature, which does
  not depend on the loss); the backward is two matrix products, no recomputation. Fastest; needs
  tokens x vocabulary x 2 bytes (bf16) until the backward. On CUDA the in-place pass is a Triton
  kernel (one program per token, online log-sum-exp); elsewhere the same maths in torch.

Both compute log_softmax as z[label] - logsumexp(z) in float32 from the same logits as
services.common.logprobs.token_logprobs; results agree to float rounding, not bit for bit.
ZeRO stages 0-2 only (under ZeRO-3 the projection's weight is a shard).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from services.learner import moe_aux

HEADS = ("full", "chunked", "fused")


# ----------------------------------------------------------------------------------------------
# chunked: recompute each chunk's logits in the backward pass


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


# ----------------------------------------------------------------------------------------------
# fused: keep d logp / d logits instead of recomputing


def _logprobs_and_grad_torch_(z: torch.Tensor, labels: torch.Tensor, inv_t: float, rows: int = 1024) -> torch.Tensor:
    """z (N, V) logits -> log-probs (N,) float32; z is overwritten with (onehot - softmax(z * inv_t)) * inv_t."""
    out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    for start in range(0, z.shape[0], rows):
        zc = z[start:start + rows].float() * inv_t
        y = labels[start:start + rows, None]
        lse = torch.logsumexp(zc, dim=-1, keepdim=True)
        out[start:start + rows] = (zc.gather(-1, y) - lse)[:, 0]
        d = torch.exp(zc.sub_(lse)).mul_(-inv_t)
        d.scatter_add_(1, y, torch.full_like(lse, inv_t))
        z[start:start + rows] = d
    return out


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def logprobs_and_grad(z_ptr, labels_ptr, logp_ptr, stride, V, inv_t, BLOCK: tl.constexpr):
        # One program per token (row of z): online log-sum-exp over the vocabulary, the label's
        # log-prob, then the row overwritten with (onehot - softmax) * inv_t.
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        top = tl.max(m, axis=0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
        label = tl.load(labels_ptr + row)
        tl.store(logp_ptr + row, tl.load(base + label).to(tl.float32) * inv_t - lse)
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32) * inv_t
            d = -tl.exp(x - lse) * inv_t
            d = tl.where(cols == label, d + inv_t, d)
            tl.store(base + cols, d.to(z_ptr.dtype.element_ty), mask=cols < V)

    return logprobs_and_grad


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def logprobs_and_grad_(z: torch.Tensor, labels: torch.Tensor, inv_t: float) -> torch.Tensor:
    """In place on z (N, V): log-probs (N,) float32 returned, z replaced by d logp / d z."""
    if z.is_cuda and triton_available():
        if not z.is_contiguous():  # a copy would leave the caller's z without the gradient
            raise ValueError("logprobs_and_grad_ works in place on a contiguous (N, V) tensor")
        out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
        if z.shape[0]:
            _triton_kernel()[(z.shape[0],)](z, labels, out, z.stride(0), z.shape[1], inv_t, BLOCK=2048, num_warps=8)
        return out
    return _logprobs_and_grad_torch_(z, labels, inv_t)


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float):
        z = hidden @ weight.t()  # (N, V) in the model's dtype; becomes d logp / d z
        logp = logprobs_and_grad_(z, labels, 1.0 / temperature)
        ctx.save_for_backward(hidden, weight, z)
        return logp

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, d = ctx.saved_tensors
        g = grad.to(d.dtype)[:, None]  # (N, 1): the loss's weight on each token's log-prob
        grad_hidden = (d @ weight) * g if ctx.needs_input_grad[0] else None
        grad_weight = d.t() @ (hidden * g) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """hidden (N, H), weight (V, H), labels (N,) -> log-probs (N,) float32 of softmax(hidden @ weight.T / temperature)."""
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        z = hidden @ weight.t()
        return logprobs_and_grad_(z, labels, 1.0 / temperature)
    return _FusedLinearLogprobs.apply(hidden, weight, labels, temperature)


# ----------------------------------------------------------------------------------------------
# The response tokens of a micro-batch


def backbone_kwargs(model, mb) -> dict:
    """Forward keyword arguments of a MicroBatch (padded: mask and positions from it; packed:
    positions, and where each sample starts for varlen / flash attention)."""
    if mb.attention_mask is not None:
        from services.common.logprobs import position_ids_from_mask

        return {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask,
                "position_ids": position_ids_from_mask(mb.attention_mask), "use_cache": False}
    kwargs = {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "use_cache": False}
    if mb.seq_lengths and getattr(model.config, "_attn_implementation", "") in ("varlen", "flash_attention_2"):
        from services.learner.varlen_attention import packed_kwargs

        kwargs.update(packed_kwargs(mb.seq_lengths, mb.input_ids.device))
    return kwargs


def forward_micro_batch(model, mb, **extra):
    """The model's output on a MicroBatch. Padded: positions from the mask. Packed: the given
    positions and no mask, from which transformers keeps attention within each sample (it does so
    only without a KV cache, hence use_cache=False), or with varlen / flash attention the
    samples' boundaries. model: a transformers model or a DeepSpeed engine around one; extra: more
    forward arguments (e.g. services.learner.moe_aux.ROUTER_KWARGS)."""
    return model(**backbone_kwargs(getattr(model, "module", model), mb), **extra)


def response_outputs(model, mb, temperature: float, head: str, chunk_tokens: int, want_entropy: bool,
                     want_aux: bool = False):
    """(B, R) log-probs (and entropies) of a MicroBatch's response tokens under a causal LM; 0 at padding.

    model: a transformers *ForCausalLM whose logits are lm_head(last hidden state) (Qwen2, Llama), or a
    PEFT model around one.
    head: "chunked" or "fused" (entropies always go the chunked way).
    Returns (log-probs, entropies or None, the MoE router's balancing loss when want_aux else None).
    """
    # A PEFT (LoRA) model wraps the causal LM, whose layers carry the adapters: its backbone and head.
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    outputs = model.base_model(**backbone_kwargs(model, mb), **(moe_aux.ROUTER_KWARGS if want_aux else {}))
    aux = moe_aux.router_aux_loss(model, outputs, mb.attention_mask) if want_aux else None
    hidden = outputs.last_hidden_state  # (rows, T, H)
    mask = mb.response_mask
    flat = mb.out_index[mask]  # output positions of the real response tokens, in (rows, T - 1)
    row, col = flat // (hidden.shape[1] - 1), flat % (hidden.shape[1] - 1)
    picked = hidden[row, col]  # (n, H)
    labels = mb.input_ids[row, col + 1]
    weight = model.get_output_embeddings().weight
    entropy = None
    if head == "fused" and not want_entropy:
        logp = fused_logprobs(picked, weight, labels, temperature)
    else:
        logp, entropy = chunked_logprobs(picked, weight, labels, temperature, chunk_tokens, want_entropy)
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)
    return (zeros.masked_scatter(mask, logp), zeros.masked_scatter(mask, entropy) if entropy is not None else None,
            aux)
