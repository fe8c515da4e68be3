"""The coordinator's maths against the reference values of shared/reference/rl_math.md."""

import pytest
import torch

from services.coordinator.loop.advantages import (compute_advantages, keep_group, length_mask, overlong_penalty,
                                             pad_right, update_kl_coef)

LOGP = torch.tensor([[-1.0, -0.5, -2.0, -0.1]])
REF = torch.tensor([[-1.2, -0.4, -1.5, -0.1]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_gae_with_kl_in_reward_matches_reference():
    values = torch.tensor([[0.5, 0.4, 0.3, 0.9]])
    out = compute_advantages(torch.tensor([1.0]), MASK, "gae", 1, logp=LOGP, ref_logp=REF, values=values,
                             kl_coef=0.1, kl_estimator="k1", gamma=1.0, lambd=0.95, std_norm=False)
    # Before whitening: A = [0.471375, 0.6225, 0.75]; whitening subtracts the masked mean only.
    raw = torch.tensor([0.471375, 0.6225, 0.75])
    assert torch.allclose(out.advantages[0, :3], raw - raw.mean(), atol=1e-5)
    assert torch.allclose(out.returns[0], torch.tensor([0.971375, 1.0225, 1.05, 0.0]), atol=1e-5)
    assert torch.allclose(out.kl[0], torch.tensor([0.2, -0.1, -0.5, 0.0]), atol=1e-6)


def test_reinforce_returns_match_reference():
    out = compute_advantages(torch.tensor([1.0]), MASK, "reinforce", 1, logp=LOGP, ref_logp=REF, kl_coef=0.1)
    assert torch.allclose(out.returns[0], torch.tensor([1.04, 1.06, 1.05, 0.0]), atol=1e-5)
    # Whitened over the three response tokens.
    assert abs(out.advantages[0, :3].mean().item()) < 1e-6


def test_group_norm_and_rloo_match_reference():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.ones(4, 2)
    grpo = compute_advantages(rewards, mask, "group_norm", 4)
    assert torch.allclose(grpo.advantages[:, 0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)
    # One terminal reward, gamma 1: every token of a sample gets the sample's advantage.
    assert torch.equal(grpo.advantages[:, 0], grpo.advantages[:, 1])
    rloo = compute_advantages(rewards, mask, "rloo", 4)
    assert torch.allclose(rloo.advantages[:, 1], torch.tensor([0.666667, -0.666667, -0.666667, 0.666667]), atol=1e-5)


def test_kl_as_loss_keeps_kl_out_of_the_reward():
    rewards = torch.tensor([1.0, 0.0])
    logp, ref = LOGP.repeat(2, 1), REF.repeat(2, 1)
    with_loss = compute_advantages(rewards, MASK.repeat(2, 1), "group_norm", 2, logp=logp, ref_logp=ref,
                                   kl_coef=0.5, use_kl_loss=True)
    without = compute_advantages(rewards, MASK.repeat(2, 1), "group_norm", 2, kl_coef=0.0)
    assert torch.allclose(with_loss.advantages, without.advantages)
    assert with_loss.kl.abs().sum() > 0


def test_overlong_penalty_ramps_to_the_factor():
    p = overlong_penalty(torch.tensor([10, 12, 14, 16]), max_len=16, buffer_len=4, factor=1.0)
    assert torch.allclose(p, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    assert torch.equal(overlong_penalty(torch.tensor([16]), 16, 0, 1.0), torch.zeros(1))


def test_dynamic_filter_drops_uniform_groups():
    groups = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    assert keep_group(groups, 0.0, 1.0).tolist() == [False, False, True]


def test_adaptive_kl_moves_towards_target():
    assert update_kl_coef(0.1, current_kl=1.0, target=0.1, horizon=100, n_samples=10) == pytest.approx(0.1 * 1.02)
    assert update_kl_coef(0.1, current_kl=0.0, target=0.1, horizon=100, n_samples=10) == pytest.approx(0.1 * 0.98)


def test_padding_helpers():
    assert length_mask([2, 0, 3]).tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    assert pad_right([torch.tensor([1.0]), torch.tensor([2.0, 3.0])]).tolist() == [[1, 0], [2, 3]]
