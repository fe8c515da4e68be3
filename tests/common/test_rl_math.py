"""The RL maths against every reference value of reference/rl_math.md, plus properties."""

from __future__ import annotations

import pytest
import torch

from services.common import rl_math as rm

TOL = dict(rtol=0, atol=1e-5)

# Inputs of the reference table.
LOGP = torch.tensor([[-1.0, -0.5, -2.0, -0.1]])
REF_LOGP = torch.tensor([[-1.2, -0.4, -1.5, -0.1]])
MASK = torch.tensor([[1, 1, 1, 0]])
VALUES = torch.tensor([[0.5, 0.4, 0.3, 0.9]])


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype).reshape(actual.shape), **TOL)


def shaped_reward() -> torch.Tensor:
    kl = rm.kl_estimate(LOGP, REF_LOGP, MASK, "k1")
    return rm.kl_shaped_rewards(torch.tensor([1.0]), kl, MASK, kl_coef=0.1)


# ---------------------------------------------------------------------------------------------
# Reference values


@pytest.mark.parametrize(
    "estimator,expected",
    [
        ("k1", [0.2, -0.1, -0.5, 0]),
        ("k2", [0.02, 0.005, 0.125, 0]),
        ("k3", [0.018731, 0.005171, 0.148721, 0]),
    ],
)
def test_kl_estimators(estimator, expected):
    close(rm.kl_estimate(LOGP, REF_LOGP, MASK, estimator), expected)


def test_kl_shaped_reward():
    close(shaped_reward(), [-0.02, 0.01, 1.05, 0])


def test_gae_gamma_1_lambda_095():
    advantages, returns = rm.gae_advantages_and_returns(shaped_reward(), VALUES, MASK, gamma=1.0, lam=0.95)
    close(advantages, [0.471375, 0.6225, 0.75, 0])
    close(returns, [0.971375, 1.0225, 1.05, 0])


def test_gae_gamma_099_lambda_09():
    advantages, _ = rm.gae_advantages_and_returns(shaped_reward(), VALUES, MASK, gamma=0.99, lam=0.9)
    close(advantages, [0.388548, 0.57525, 0.75, 0])


def test_reinforce_returns():
    close(rm.discounted_returns(shaped_reward(), MASK, gamma=1.0), [1.04, 1.06, 1.05, 0])


def test_group_baselines():
    group = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    close(rm.rloo_advantages(group), [0.666667, -0.666667, -0.666667, 0.666667])
    close(rm.group_norm_advantages(group), [0.866025, -0.866025, -0.866025, 0.866025])
    close(rm.group_advantages(group, "rloo"), [0.666667, -0.666667, -0.666667, 0.666667])
    close(rm.group_advantages(group, "group_norm"), [0.866025, -0.866025, -0.866025, 0.866025])
    for name in ("reinforce_baseline", "dr_grpo"):
        close(rm.group_advantages(group, name), [0.5, -0.5, -0.5, 0.5])


NEW_LOGP = torch.tensor([[-0.9, -0.6, 0.0, -0.1]])
ADV = torch.tensor([[1.0, -1.0, -1.0, 0.5]])


def test_policy_loss_symmetric_clip():
    out = rm.policy_loss(NEW_LOGP, LOGP, ADV, MASK, eps_low=0.2)
    close(out.loss, 2.396241)
    close(out.clip_ratio, 0.0)
    close(out.ppo_kl, -0.666667)


def test_policy_loss_asymmetric_and_dual_clip():
    out = rm.policy_loss(NEW_LOGP, LOGP, ADV, MASK, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    close(out.loss, 0.933222)


def test_value_loss():
    v = torch.tensor([[1.0, 0.0, 2.0]])
    old_v = torch.tensor([[0.2, 0.1, 0.0]])
    returns = torch.full((1, 3), 0.5)
    close(rm.value_loss(v, old_v, returns, torch.ones(1, 3), value_clip=0.5), 0.458333)


# ---------------------------------------------------------------------------------------------
# Properties


def random_batch(seed: int = 0, B: int = 6, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()  # right-padded (B, T)
    return g, mask


def test_whitening_gives_zero_mean_unit_variance_over_masked_tokens():
    g, mask = random_batch()
    values = torch.randn(mask.shape, generator=g) * 3 + 5
    white = rm.masked_whiten(values, mask)
    m = mask.bool()
    assert abs(float(white[m].mean())) < 1e-5
    assert abs(float(white[m].var(unbiased=False)) - 1.0) < 1e-4
    assert (white[~m] == 0).all()
    centred = rm.masked_whiten(values, mask, std_norm=False)
    close(centred[m], values[m] - values[m].mean())
    assert not torch.allclose(centred[m].var(), torch.tensor(1.0))


def test_masked_positions_never_affect_results():
    g, mask = random_batch(seed=1)
    m = mask.bool()

    def scrambled(x: torch.Tensor) -> torch.Tensor:
        return torch.where(m, x, torch.full_like(x, float("nan")))

    logp = -torch.rand(mask.shape, generator=g) * 3
    old = logp + torch.randn(mask.shape, generator=g) * 0.3
    ref = logp + torch.randn(mask.shape, generator=g) * 0.3
    adv = torch.randn(mask.shape, generator=g)
    values = torch.randn(mask.shape, generator=g)
    reward = torch.randn(mask.shape[0], generator=g)

    def everything(logp, old, ref, adv, values):
        kl = rm.kl_estimate(logp, ref, mask, "k3")
        shaped = rm.kl_shaped_rewards(reward, rm.kl_estimate(logp, ref, mask, "k1"), mask, 0.05)
        gae = rm.gae_advantages_and_returns(shaped, values, mask, 0.99, 0.95)
        return [
            kl,
            shaped,
            *gae,
            rm.discounted_returns(shaped, mask, 0.99),
            rm.masked_whiten(adv, mask),
            *rm.policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0),
            rm.policy_loss(logp, old, adv, mask, ratio_type="sequence", level="sequence").loss,
            rm.value_loss(values, old, adv, mask, 0.2),
            rm.kl_loss(logp, ref, mask, "k2"),
        ]

    clean = everything(logp, old, ref, adv, values)
    dirty = everything(scrambled(logp), scrambled(old), scrambled(ref), scrambled(adv), scrambled(values))
    for a, b in zip(clean, dirty):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kl_k3_clamped_with_finite_gradient():
    logp = torch.tensor([[-50.0, 0.0, -0.3]], requires_grad=True)
    ref = torch.tensor([[0.0, -50.0, -0.2]])
    kl = rm.kl_estimate(logp, ref, torch.ones(1, 3), "k3")
    assert kl[0, 0] == 10.0 and kl[0, 1] == 10.0
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    close(logp.grad, [0.0, 0.0, 1 - torch.exp(torch.tensor(0.1)).item()])


def test_shaped_reward_lands_on_last_token_and_clips():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    out = rm.kl_shaped_rewards(torch.tensor([5.0, -7.0]), torch.zeros(2, 4), mask, 0.1, reward_clip=(-2.0, 3.0))
    close(out, [[0, 3.0, 0, 0], [0, 0, 0, -2.0]])
    # kl_coef <= 0: no KL term at all
    close(rm.kl_shaped_rewards(torch.tensor([1.0]), torch.ones(1, 3), torch.ones(1, 3), 0.0), [0, 0, 1.0])


def test_gae_with_lambda_one_equals_returns_minus_values():
    g, mask = random_batch(seed=2)
    rewards = torch.randn(mask.shape, generator=g)
    values = torch.randn(mask.shape, generator=g)
    adv, ret = rm.gae_advantages_and_returns(rewards, values, mask, gamma=0.9, lam=1.0)
    close(ret, rm.discounted_returns(rewards, mask, gamma=0.9))
    close(adv, (ret - values) * mask)


def test_group_norm_is_zero_mean_and_rejects_single_samples():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(5, 8, generator=g)
    adv = rm.group_norm_advantages(rewards)
    close(adv.mean(dim=1), torch.zeros(5))
    close(adv.std(dim=1), torch.ones(5))
    close(rm.rloo_advantages(rewards).mean(dim=1), torch.zeros(5))
    with pytest.raises(ValueError, match="n >= 2"):
        rm.group_norm_advantages(torch.ones(4, 1))
    with pytest.raises(ValueError):
        rm.group_advantages(rewards, "gae")


def test_policy_loss_gradient_and_on_policy_value():
    # On-policy (logp == old_logp) the loss is -mean(A) and the gradient of logp_t is -A_t / N.
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = torch.tensor([[1.0, -2.0, 0.5, 9.0], [3.0, -1.0, 7.0, 7.0]])
    logp = torch.log(torch.full((2, 4), 0.5)).requires_grad_()
    out = rm.policy_loss(logp, logp.detach(), adv, mask)
    close(out.loss, -(1 - 2 + 0.5 + 3 - 1) / 5)
    out.loss.backward()
    close(logp.grad, -adv * mask / 5)
    close(out.clip_ratio, 0.0)
    close(out.ppo_kl, 0.0)


def test_clip_ratio_counts_clipped_tokens():
    # ratio 2 with A > 0 is clipped (1.2 * A < 2 * A); ratio 0.5 with A < 0 is clipped too.
    logp = torch.log(torch.tensor([[2.0, 0.5, 1.0]]))
    out = rm.policy_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3))
    close(out.clip_ratio, 2 / 3)
    close(out.loss, -(1.2 - 0.8 + 1.0) / 3)


def test_gspo_uses_one_ratio_per_sequence():
    logp = torch.tensor([[-1.0, -2.0, -5.0]])
    old = torch.tensor([[-1.2, -1.9, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    close(rm.gspo_sequence_log_ratio(logp, old, mask), [[0.05]])
    adv = torch.ones(1, 3)
    out = rm.policy_loss(logp, old, adv, mask, ratio_type="sequence")
    close(out.loss, -torch.exp(torch.tensor(0.05)))


def test_aggregation_levels():
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    close(rm.aggregate_loss(loss, mask, "token"), 10 / 4)
    close(rm.aggregate_loss(loss, mask, "token", normalizer=8), 10 / 8)
    close(rm.aggregate_loss(loss, mask, "sequence"), (2 + 4) / 2)
    close(rm.aggregate_loss(loss, mask, "sequence", normalizer=4), (2 + 4) / 4)
    # Token level over micro-batches with the global token count == one big batch.
    total = rm.aggregate_loss(loss[:1], mask[:1], normalizer=4) + rm.aggregate_loss(loss[1:], mask[1:], normalizer=4)
    close(total, rm.aggregate_loss(loss, mask))


def test_sequence_sum_aggregation_and_micro_batches():
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    close(rm.aggregate_loss(loss, mask, "sequence_sum"), (6 + 4) / 2)
    # Sequence levels over micro-batches with the global sequence count == one big batch.
    for level in ("sequence", "sequence_sum"):
        parts = [rm.aggregate_loss(loss[i:i + 1], mask[i:i + 1], level, normalizer=2) for i in range(2)]
        close(parts[0] + parts[1], rm.aggregate_loss(loss, mask, level))
    with pytest.raises(ValueError, match="sequence_sum"):
        rm.aggregate_loss(loss, mask, "seq")


def test_gspo_with_openrlhf_aggregation_by_hand():
    # Two sequences of 2 and 1 response tokens. Sequence log-ratios: mean(0.1, 0.3) = 0.2 and 0.5.
    logp = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    old = torch.tensor([[-1.1, -1.3, 0.0], [-2.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.6, 0.0], [-2.3, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    r1, r2 = 1.2214027581601699, 1.6487212707001282  # exp(0.2), exp(0.5)
    # Sequence 1: A = 1, min(r1, 1.2) = 1.2 -> loss -1.2 on each token. Sequence 2: A = -2,
    # min(-2 r2, -2 * 1.2) = -2 r2 -> loss 2 r2. OpenRLHF's GSPO: mean over sequences of each
    # sequence's token mean.
    per_token = torch.tensor([[-1.2, -1.2, 0.0], [2 * r2, 0.0, 0.0]])
    assert r1 > 1.2
    out = rm.policy_loss(logp, old, adv, mask, eps_low=0.2, ratio_type="sequence", level="sequence")
    close(out.loss, (-1.2 + 2 * r2) / 2)
    # Token mean (rlmesh's default before --loss_agg_mode) differs: sum / 3 tokens.
    token = rm.policy_loss(logp, old, adv, mask, eps_low=0.2, ratio_type="sequence", level="token")
    close(token.loss, per_token.sum() / 3)
    # The KL term stays per token: k1 = logp - ref = 0, 0.6, 0.3 over the 3 tokens.
    close(rm.kl_loss(logp, ref, mask, "k1", level="token"), 0.9 / 3)
    close(rm.kl_loss(logp, ref, mask, "k1", level="sequence"), (0.3 + 0.3) / 2)
    close(rm.kl_loss(logp, ref, mask, "k1", level="sequence_sum"), (0.6 + 0.3) / 2)


def test_value_loss_without_clip_and_kl_loss():
    v = torch.tensor([[1.0, 0.0, 2.0]])
    close(rm.value_loss(v, torch.zeros(1, 3), torch.full((1, 3), 0.5), torch.ones(1, 3)), 0.5 * 2.75 / 3)
    close(rm.kl_loss(LOGP, REF_LOGP, MASK, "k2"), (0.02 + 0.005 + 0.125) / 3)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]])
    ent = rm.entropy_from_logits(logits)
    p = torch.softmax(logits[0, 2], -1)
    close(ent, [[torch.log(torch.tensor(4.0)).item(), 0.0, float(-(p * p.log()).sum())]])
    hot = rm.entropy_from_logits(logits, temperature=1000.0)
    assert hot[0, 2] > ent[0, 2]


def test_masked_mean_of_empty_row_is_zero():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    close(rm.masked_mean(x, torch.tensor([[1, 1], [0, 0]]), dim=1), [1.5, 0.0])
    close(rm.masked_mean(x, torch.tensor([[0, 1], [1, 0]])), 2.5)
