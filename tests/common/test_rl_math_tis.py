"""Truncated importance sampling (--use_tis) against a case computed by hand."""

from __future__ import annotations

import math

import torch

from services.common import rl_math as rm


def test_truncated_is_weights_hand_computed():
    # Probabilities of the sampled tokens: trained policy before the update (old) vs the engine's.
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
    rollout = torch.log(torch.tensor([[0.25, 0.9, 0.8]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = rm.truncated_is_weights(old, rollout, mask, cap=1.5)
    # 0.5 / 0.25 = 2 -> capped at 1.5; 0.9 / 0.9 = 1; the third token is masked out.
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.0, 0.0]]))
    assert not weights.requires_grad
    # Below the cap a weight is the plain ratio (0.2 / 0.8 = 0.25), never raised.
    torch.testing.assert_close(rm.truncated_is_weights(old, rollout, torch.ones(1, 3), cap=1.5)[0, 2],
                               torch.tensor(0.25))


def test_policy_loss_weighted_by_tis_hand_computed():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
    rollout = torch.log(torch.tensor([[0.25, 0.9, 0.8]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    advantages = torch.tensor([[1.0, -2.0, 5.0]])
    logp = old.clone().requires_grad_(True)  # on-policy: ratio 1, nothing clipped
    weights = rm.truncated_is_weights(old, rollout, mask, cap=1.5)
    out = rm.policy_loss(logp, old, advantages, mask, eps_low=0.2, is_weights=weights)
    # loss = -(1.5 * 1 + 1.0 * -2) / 2 tokens = 0.25 (without the weights: -(1 - 2) / 2 = 0.5)
    assert math.isclose(out.loss.item(), 0.25, abs_tol=1e-6)
    assert math.isclose(rm.policy_loss(logp, old, advantages, mask).loss.item(), 0.5, abs_tol=1e-6)
    out.loss.backward()
    # d loss / d logp_t = -w_t * A_t * ratio_t / 2: -0.75, 1.0, and 0 for the masked token.
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.75, 1.0, 0.0]]))
