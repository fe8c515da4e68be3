"""The policy's entropy on the trained response tokens, as a metric when no entropy term is trained.

TrainActorResponse.entropy is the entropy term's value when --entropy_loss_coef is set. Without it
the learner still measures the entropy wherever it has the logits at hand, at a small cost:
- --logprobs_head full: the response logits are there; their entropy is taken without a graph
  (no memory kept for the backward pass), a block of rows at a time, so that at most a block of
  float32 (rows, vocabulary) temporaries exists beside the logits;
- --logprobs_head chunked: each chunk's logits exist in turn; the entropy comes out of the same
  pass (and its recomputation), one more softmax over the chunk;
- --logprobs_head fused: the logits never exist as such (the kernel overwrites them with the
  gradient), so the entropy is not measured and the response carries NaN, which the coordinator
  does not log (rather than a 0.0 that reads as a collapsed policy).
"""

from __future__ import annotations

import torch

from services.common import rl_math

# Rows of logits whose entropy is taken at once: 1024 x a 151k vocabulary x 4 bytes = 0.6 GB per temporary.
BLOCK_ROWS = 1024


def measured(head: str, entropy_coef: float) -> bool:
    """Whether TrainActor measures the entropy without training it (see the module docstring)."""
    return entropy_coef == 0 and head in ("full", "chunked")


@torch.no_grad()
def entropy_without_grad(logits: torch.Tensor, temperature: float, block_rows: int = BLOCK_ROWS) -> torch.Tensor:
    """logits (N, V) -> (N,) float32 entropies of softmax(logits / temperature), no autograd graph."""
    if logits.shape[0] == 0:
        return logits.new_zeros(0, dtype=torch.float32)
    return torch.cat([rl_math.entropy_from_logits(logits[start:start + block_rows].detach(), temperature)
                      for start in range(0, logits.shape[0], block_rows)])
