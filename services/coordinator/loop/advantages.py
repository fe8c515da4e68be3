"""From scored samples to advantages: the coordinator's maths, built on services.common.rl_math.

Order of operations (the same as OpenRLHF's experience maker, so the same flags give the same
numbers): overlong penalty, then the stop-properly penalty, on the scalar reward -> group baseline
for the group estimators -> per-token rewards with the KL penalty (unless KL is a loss) and the
reward clip -> GAE with the critic's values, or discounted returns -> global whitening for gae /
reinforce / reinforce_baseline.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from services.common import rl_math


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment.

    lengths: (B,) response lengths in tokens. Responses longer than max_len - buffer_len get
    -(length - (max_len - buffer_len)) / buffer_len * factor, i.e. 0 at the start of the buffer
    down to -factor at max_len. Returns (B,) float32 (0 everywhere when buffer_len is 0).
    """
    if buffer_len <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    expected = max_len - buffer_len
    excess = (lengths.float() - expected).clamp(min=0)
    return -excess / buffer_len * factor


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float | None) -> torch.Tensor:
    """ProRL's stop-properly penalty on responses cut at the generation limit (finish reason length).

    rewards: (B,) scalar rewards (the overlong penalty already added); truncated: (B,) bool.
    coef in [0, 1]: a truncated response's reward is multiplied by coef; coef < 0: it is replaced by
    coef; None: no penalty. Responses that stopped are unchanged. Returns (B,) float32.
    """
    rewards = rewards.float()
    if coef is None:
        return rewards
    penalised = torch.full_like(rewards, coef) if coef < 0 else rewards * coef
    return torch.where(truncated.bool(), penalised, rewards)


def keep_group(rewards: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """DAPO dynamic filtering: which groups carry a learning signal.

    rewards: (num_prompts, n). A group is kept when low < mean reward < high, which (for rewards in
    [low, high]) drops exactly the groups whose samples all got the lowest or all the highest
    reward. Returns (num_prompts,) bool.
    """
    mean = rewards.float().mean(dim=1)
    return (mean > low) & (mean < high)


def update_kl_coef(kl_coef: float, current_kl: float, target: float, horizon: int, n_samples: int) -> float:
    """Adaptive KL controller (Ziegler et al.): moves the coefficient towards the KL target.

    error = clip(current_kl / target - 1, -0.2, 0.2); coef *= 1 + error * n_samples / horizon.
    """
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_samples / horizon)


class Advantages(NamedTuple):
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    kl: torch.Tensor  # (B, T) per-token KL estimate (0 without a reference)
    shaped_rewards: torch.Tensor  # (B,) scalar reward after penalty and baseline (before KL)


def compute_advantages(rewards: torch.Tensor, mask: torch.Tensor, estimator: str, n_samples_per_prompt: int,
                       logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
                       values: torch.Tensor | None = None, kl_coef: float = 0.0, kl_estimator: str = "k1",
                       use_kl_loss: bool = False, gamma: float = 1.0, lambd: float = 1.0,
                       reward_clip: tuple[float, float] | None = None, std_norm: bool = True) -> Advantages:
    """Advantages and returns for one rollout batch.

    rewards: (B,) scalar reward per sample (overlong penalty already added), with the n samples
    of each prompt contiguous (B = num_prompts * n). mask: (B, T) 1 on response tokens.
    logp / ref_logp: (B, T) old-policy and reference log-probs of the response tokens (both or
    neither). values: (B, T) critic values, required for gae.
    """
    if estimator not in rl_math.ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator {estimator!r}: use one of {', '.join(rl_math.ADVANTAGE_ESTIMATORS)}")
    spec = rl_math.ADVANTAGE_ESTIMATORS[estimator]
    B = rewards.shape[0]
    if ref_logp is not None and logp is not None:
        kl = rl_math.kl_estimate(logp, ref_logp, mask, kl_estimator)
    else:
        kl = torch.zeros(mask.shape, dtype=torch.float32)
    scalar = rewards.float()
    if spec.group_baseline is not None:
        groups = scalar.view(B // n_samples_per_prompt, n_samples_per_prompt)  # (num_prompts, n)
        scalar = spec.group_baseline(groups).reshape(B)
    token_rewards = rl_math.kl_shaped_rewards(scalar, kl, mask, 0.0 if use_kl_loss else kl_coef, reward_clip)
    if spec.critic:
        if values is None:
            raise ValueError(f"{estimator} needs the critic's values")
        advantages, returns = rl_math.gae_advantages_and_returns(token_rewards, values, mask, gamma, lambd)
    else:
        # The group estimators discount with gamma = 1 by definition (one terminal reward).
        returns = rl_math.discounted_returns(token_rewards, mask, 1.0 if spec.group_baseline else gamma)
        advantages = returns
    if spec.whiten:
        advantages = rl_math.masked_whiten(advantages, mask, std_norm=std_norm)
    return Advantages(advantages, returns, kl, scalar)


def pad_right(rows: list[torch.Tensor], dtype: torch.dtype = torch.float32, value: float = 0.0) -> torch.Tensor:
    """Stacks 1-D tensors of different lengths into (B, T_max), padding on the right."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def length_mask(lengths: list[int]) -> torch.Tensor:
    """(B, T_max) mask with lengths[i] leading ones in row i."""
    width = max(lengths, default=0)
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).to(torch.float32)
