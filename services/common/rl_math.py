"""The RL maths shared by the coordinator (rewards, advantages) and the learner (losses).

Pure functions on tensors: no I/O, no config objects. Conventions (see reference/rl_math.md):
per-token tensors are (batch, response_len); `mask` is 1 on response tokens and 0 on padding;
log-probs come from logits divided by the sampling temperature. Values at masked positions never
influence any result, and the functions that return per-token tensors return 0 there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

KLEstimator = Literal["k1", "k2", "k3"]
LossLevel = Literal["token", "sequence", "sequence_sum"]

# ----------------------------------------------------------------------------------------------
# Masked reductions


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) over dim (all dims when None). x, mask: broadcastable, mask 0/1 or bool."""
    # where() rather than x * mask so that inf/nan at masked positions cannot leak in.
    masked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over dim (all dims when None); 0 where the mask sums to 0."""
    x, mask = torch.broadcast_tensors(x, mask)
    total = masked_sum(x, mask, dim)
    count = masked_sum(torch.ones_like(x), mask, dim)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, std_norm: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whitens values over all masked-in entries of the batch at once (global, not per row).

    values, mask: (B, T). mean = sum(v*m)/sum(m); var = sum((v-mean)^2*m)/sum(m) (population);
    returns (v - mean) * rsqrt(max(var, eps)), or only v - mean when std_norm is False.
    Masked-out entries are 0 in the result.
    """
    mean = masked_mean(values, mask)
    centred = values - mean
    if std_norm:
        var = masked_mean(centred**2, mask)
        centred = centred * torch.rsqrt(var.clamp(min=eps))
    return torch.where(mask.bool(), centred, torch.zeros_like(centred))


# ----------------------------------------------------------------------------------------------
# KL between the policy and the reference model


def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None, estimator: KLEstimator = "k1"
) -> torch.Tensor:
    """Per-token KL estimate from log-probs of the sampled tokens, clamped to [-10, 10].

    logp, ref_logp, mask: (B, T). With d = logp - ref_logp: k1 = d, k2 = d^2 / 2,
    k3 = exp(-d) - 1 + d. Returns (B, T) float32, 0 where mask is 0.
    """
    d = logp.float() - ref_logp.float()
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = d**2 / 2
    elif estimator == "k3":
        # |d| > 20 lands far outside the clamp anyway; bounding d first keeps exp() finite, so
        # the backward pass gives 0 there instead of 0 * inf = nan.
        d = d.clamp(-20.0, 20.0)
        kl = torch.exp(-d) - 1 + d
    else:
        raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")
    kl = kl.clamp(-10.0, 10.0)
    if mask is not None:
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return kl


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask -> (B,) index of the last position where mask is 1 (0 for an empty row)."""
    T = mask.shape[1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values.clamp(min=0)


def last_token_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) values, (B, T) mask -> (B,) each row's value at its last position where mask is 1
    (a reward model's score or a critic's value is read there; left or right padding both work)."""
    return values.gather(1, last_token_index(mask).unsqueeze(1)).squeeze(1)


def kl_shaped_rewards(
    reward: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    reward_clip: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Per-token rewards: -kl_coef * kl_t everywhere, plus the scalar reward at the last token.

    reward: (B,) one score per sample; kl, mask: (B, T). The score is clipped to reward_clip
    (low, high) when given and added at the last response token (last position where mask is 1).
    kl_coef <= 0 means no KL term (as when KL is used as a loss instead). Returns (B, T), 0 at
    masked positions.
    """
    if reward_clip is not None:
        reward = reward.clamp(reward_clip[0], reward_clip[1])
    rewards = torch.zeros_like(kl, dtype=torch.float32)
    if kl_coef > 0:
        rewards = -kl_coef * kl.float()
    rewards = rewards.scatter_add(1, last_token_index(mask).unsqueeze(1), reward.float().unsqueeze(1))
    return torch.where(mask.bool(), rewards, torch.zeros_like(rewards))


# ----------------------------------------------------------------------------------------------
# Returns and advantages


def gae_advantages_and_returns(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens.

    rewards, values, mask: (B, T). Rewards and values are masked first, V_T = 0;
    delta_t = r_t + gamma * V_{t+1} - V_t; A_t = delta_t + gamma * lam * A_{t+1};
    returns = A + V. Returns (advantages, returns), both (B, T), 0 at masked positions.
    """
    m = mask.to(torch.float32)
    rewards = torch.where(mask.bool(), rewards.float(), torch.zeros_like(m))
    values = torch.where(mask.bool(), values.float(), torch.zeros_like(m))
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    advantages = advantages * m
    return advantages, (advantages + values) * m


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE returns G_t = r_t + gamma * G_{t+1} (used as the advantages).

    rewards, mask: (B, T). Returns (B, T), 0 at masked positions.
    """
    rewards = torch.where(mask.bool(), rewards.float(), torch.zeros_like(rewards, dtype=torch.float32))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return torch.where(mask.bool(), returns, torch.zeros_like(returns))


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r - (sum(r) - r) / (n - 1) within each group.

    rewards: (num_prompts, n), n >= 2 samples of the same prompt per row. Returns (num_prompts, n).
    """
    n = _group_size(rewards, "rloo")
    return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)


def mean_baseline_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Group-mean baseline (reinforce_baseline and dr_grpo): r - mean(r) within each group.

    rewards: (num_prompts, n). Returns (num_prompts, n).
    """
    return rewards - rewards.mean(dim=1, keepdim=True)


def group_norm_advantages(rewards: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """GRPO: (r - mean(r)) / (std(r) + eps) within each group, std unbiased (divides by n - 1).

    rewards: (num_prompts, n), n >= 2. Returns (num_prompts, n).
    """
    _group_size(rewards, "group_norm")
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (std + eps)


class AdvantageEstimator(NamedTuple):
    """What one --advantage_estimator does to a batch's rewards (applied in this order by the
    coordinator's services.coordinator.loop.advantages.compute_advantages)."""

    # (num_prompts, n) -> (num_prompts, n): the baseline from the other samples of the same prompt;
    # None: no group baseline. Group estimators discount with gamma = 1 (one terminal reward).
    group_baseline: Callable[[torch.Tensor], torch.Tensor] | None
    critic: bool  # GAE over the critic's values; otherwise discounted returns of the per-token rewards
    whiten: bool  # advantages whitened over the whole batch (masked_whiten)


# --advantage_estimator name -> what it does; the coordinator's flag takes its choices from here.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator(None, critic=True, whiten=True),  # PPO
    "reinforce": AdvantageEstimator(None, critic=False, whiten=True),  # REINFORCE++
    "reinforce_baseline": AdvantageEstimator(mean_baseline_advantages, critic=False, whiten=True),
    "rloo": AdvantageEstimator(rloo_advantages, critic=False, whiten=False),
    "group_norm": AdvantageEstimator(group_norm_advantages, critic=False, whiten=False),  # GRPO
    "dr_grpo": AdvantageEstimator(mean_baseline_advantages, critic=False, whiten=False),  # Dr. GRPO
}
GROUP_ESTIMATORS = tuple(name for name, e in ADVANTAGE_ESTIMATORS.items() if e.group_baseline is not None)


def group_advantages(rewards: torch.Tensor, estimator: str) -> torch.Tensor:
    """Applies the group baseline named by estimator. rewards: (num_prompts, n) -> same shape."""
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(GROUP_ESTIMATORS)} (a group baseline), "
                         f"got {estimator!r}")
    return ADVANTAGE_ESTIMATORS[estimator].group_baseline(rewards)


def _group_size(rewards: torch.Tensor, name: str) -> int:
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"{name} needs rewards shaped (num_prompts, n_samples_per_prompt) with n >= 2, "
            f"got shape {tuple(rewards.shape)}"
        )
    return rewards.shape[1]


# ----------------------------------------------------------------------------------------------
# Loss aggregation


def aggregate_loss(
    loss: torch.Tensor, mask: torch.Tensor, level: LossLevel = "token", normalizer: float | None = None
) -> torch.Tensor:
    """Reduces a per-token loss (B, T) to a scalar.

    token: sum(loss * mask) / normalizer, where normalizer is the number of response tokens in
      the global batch of this optimizer step (all micro-batches, all data-parallel ranks), so
      that accumulated gradients equal one big batch; defaults to sum(mask) of this call. A
      constant normalizer (e.g. the generation length, as Dr. GRPO does) is also valid.
    sequence: mean over each sequence's tokens, then sum / normalizer, normalizer being the
      number of sequences in the global batch; defaults to B (veRL's seq-mean-token-mean).
    sequence_sum: sum over each sequence's tokens, then sum / normalizer (sequences, as for
      sequence); long responses weigh more (veRL's seq-mean-token-sum).
    """
    if level == "token":
        denom = mask.sum().clamp(min=1) if normalizer is None else normalizer
        return masked_sum(loss, mask) / denom
    if level == "sequence":
        per_sequence = masked_mean(loss, mask, dim=1)  # (B,)
        return per_sequence.sum() / (loss.shape[0] if normalizer is None else normalizer)
    if level == "sequence_sum":
        per_sequence = masked_sum(loss, mask, dim=1)  # (B,)
        return per_sequence.sum() / (loss.shape[0] if normalizer is None else normalizer)
    raise ValueError(f"level must be 'token', 'sequence' or 'sequence_sum', got {level!r}")


# ----------------------------------------------------------------------------------------------
# Losses


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, to backpropagate
    clip_ratio: torch.Tensor  # scalar metric: fraction of tokens where the clipped term is lower
    ppo_kl: torch.Tensor  # scalar metric: masked mean of old_logp - logp


def gspo_sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: one log-ratio per sequence, the masked mean over its tokens of logp - old_logp.

    logp, old_logp, mask: (B, T). Returns (B, 1), broadcastable against per-token tensors.
    """
    return masked_mean(logp.float() - old_logp.float(), mask, dim=1).unsqueeze(1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    ratio_type: Literal["token", "sequence"] = "token",
    level: LossLevel = "token",
    normalizer: float | None = None,
    is_weights: torch.Tensor | None = None,
    behaviour_logp: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate loss.

    logp (new policy, with grad), old_logp, advantages, mask: (B, T).
    ratio = exp(clamp(logp - old_logp, -20, 20)) per token, or with ratio_type="sequence" the
    GSPO ratio exp(masked mean of the log-ratio) shared by all tokens of a sequence.
    loss_t = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A); eps_high defaults to
    eps_low. dual_clip = c > 1 bounds the loss where A < 0: loss_t = -max(min(...), c * A).
    is_weights (B, T), constants (services.common.is_correction): loss_t is multiplied by them.
    behaviour_logp (B, T), GSPO only: the rollout engine's log-probs, which replace old_logp in the
    sequence ratio (OpenRLHF's importance-sampling correction for GSPO: one ratio from the
    behaviour policy to the new one, instead of per-token weights).
    Aggregated by aggregate_loss(level, normalizer). Metrics are masked means over tokens (ppo_kl
    against old_logp in every case).
    """
    if eps_high is None:
        eps_high = eps_low
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    log_ratio = logp.float() - old_logp.float()
    if ratio_type == "sequence":
        base = old_logp if behaviour_logp is None else behaviour_logp
        log_ratio = gspo_sequence_log_ratio(logp, base, mask)  # (B, 1)
    elif ratio_type != "token":
        raise ValueError(f"ratio_type must be 'token' or 'sequence', got {ratio_type!r}")
    elif behaviour_logp is not None:
        raise ValueError("behaviour_logp replaces old_logp in GSPO's sequence ratio only; weight token ratios "
                         "with is_weights")
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    advantages = advantages.float()
    unclipped = ratio * advantages  # (B, T)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    objective = torch.min(unclipped, clipped)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.max(objective, dual_clip * advantages), objective)
    if is_weights is not None:
        objective = objective * is_weights.detach().float()
    loss = aggregate_loss(-objective, mask, level, normalizer)
    with torch.no_grad():
        clip_ratio = masked_mean((clipped < unclipped).float(), mask)
        ppo_kl = masked_mean(old_logp.float() - logp.float(), mask)
    return PolicyLossOutput(loss, clip_ratio, ppo_kl)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None = None,
    level: LossLevel = "token",
    normalizer: float | None = None,
) -> torch.Tensor:
    """Critic loss: 0.5 * aggregate(max((old_v + clip(v - old_v, -c, c) - R)^2, (v - R)^2)).

    values (with grad), old_values, returns, mask: (B, T). Without value_clip: 0.5 * (v - R)^2.
    """
    values, returns = values.float(), returns.float()
    squared = (values - returns) ** 2
    if value_clip is not None:
        old_values = old_values.float()
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        squared = torch.max(squared, (clipped_values - returns) ** 2)
    return 0.5 * aggregate_loss(squared, mask, level, normalizer)


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator = "k3",
    level: LossLevel = "token",
    normalizer: float | None = None,
) -> torch.Tensor:
    """KL to the reference as a loss term: aggregate(kl_estimate). The caller adds beta * this.

    logp (with grad), ref_logp, mask: (B, T). Returns a scalar.
    """
    return aggregate_loss(kl_estimate(logp, ref_logp, mask, estimator), mask, level, normalizer)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position.

    logits: (B, T, V). Returns (B, T) float32: logsumexp(z) - sum(softmax(z) * z).
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)
