"""Importance-sampling correction of the policy loss for the gap between the rollout engine and the learner.

The engine that sampled a response (vLLM, possibly some weight versions behind with --async_train,
and with other kernels) is the behaviour policy; the PPO ratio only corrects from the learner's
"old" log-probs to the new ones. These weights correct behaviour -> old, per token, from the
engine's own log-probs of the sampled tokens. With w_t = exp(old_logp_t - rollout_logp_t) and a
band [low, high], OpenRLHF 0.11's three types (--algo.advantage.is_correction_type) are:

- tis: w_t clamped into [low, high] (low = 0 is veRL's truncated IS, a cap from above only).
- icepop: w_t where low <= w_t <= high, else 0 (tokens far off-policy are dropped, not clipped).
- seq-mask-tis: each sequence is kept or dropped whole on its geometric mean ratio
  exp(masked mean of log w_t) being in [low, high]; kept sequences weight their tokens by w_t
  itself, unclamped (so it is this, and not a clamped w_t, that OpenRLHF multiplies in).

The weights multiply each token's clipped PPO term (after dual-clip) and carry no gradient. With
GSPO the correction is instead folded into the sequence ratio (see services.common.rl_math.policy_loss).
Pure functions; shapes (batch, response_len); 0 where the mask is 0.
"""

from __future__ import annotations

from typing import Literal

import torch

from services.common.rl_math import masked_mean

ISCorrectionType = Literal["tis", "icepop", "seq-mask-tis"]
IS_CORRECTION_TYPES: tuple[str, ...] = ("tis", "icepop", "seq-mask-tis")
# |log w| beyond this is far outside any band; bounding it keeps exp() finite.
_LOG_RATIO_BOUND = 20.0


def _log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    return (old_logp.float() - rollout_logp.float()).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)


def is_correction_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                          kind: ISCorrectionType = "tis", low: float = 0.0, high: float = 2.0) -> torch.Tensor:
    """Per-token importance weights of the policy loss.

    old_logp: (B, T) log-probs of the sampled tokens under the policy being trained, before the
    update (what the PPO ratio divides by); rollout_logp: (B, T) the same tokens' log-probs as the
    rollout engine reported them; mask: (B, T) 1 on trained tokens. kind and the band [low, high]
    as in the module docstring. Returns (B, T) float32 without grad, 0 where mask is 0.
    """
    if not 0 <= low <= high:
        raise ValueError(f"the band [low, high] needs 0 <= low <= high, got [{low}, {high}]")
    log_w = _log_ratio(old_logp, rollout_logp)
    w = torch.exp(log_w)
    if kind == "tis":
        weights = w.clamp(min=low, max=high)
    elif kind == "icepop":
        weights = torch.where((w >= low) & (w <= high), w, torch.zeros_like(w))
    elif kind == "seq-mask-tis":
        seq_ratio = torch.exp(masked_mean(log_w, mask, dim=1))  # (B,) geometric mean over the sequence
        keep = (seq_ratio >= low) & (seq_ratio <= high)
        weights = torch.where(keep.unsqueeze(1), w, torch.zeros_like(w))
    else:
        raise ValueError(f"kind must be one of {', '.join(IS_CORRECTION_TYPES)}, got {kind!r}")
    return torch.where(mask.bool(), weights, torch.zeros_like(weights)).detach()


def rollout_kl(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How far the engine's log-probs are from the learner's: masked mean of rollout_logp - old_logp
    over all tokens (a scalar; OpenRLHF logs it as vllm_kl). Inputs (B, T)."""
    return masked_mean(rollout_logp.float() - old_logp.float(), mask)
