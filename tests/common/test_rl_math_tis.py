"""Importance-sampling correction (--use_tis, OpenRLHF's --algo.advantage.is_correction_*) against
cases computed by hand from the definitions: tis (clamp into [low, high]), icepop (0 outside the
band), seq-mask-tis (whole sequences kept on their geometric-mean ratio, tokens weighted by the
unclamped ratio), and GSPO's sequence ratio taken from the engine's log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from services.common import rl_math as rm
from services.common.is_correction import is_correction_weights, rollout_kl

# Probabilities of the sampled tokens under the trained policy before the update (old) and as the
# engine reported them; the importance ratios w = old / rollout are
#   row 0: 0.25, 1, 2, 8 | 1000 (masked)    row 1: 0.25, 0.25, 0.6, 1 | 4 (masked)
OLD = torch.log(torch.tensor([[0.1, 0.5, 0.6, 0.8, 0.5], [0.1, 0.1, 0.24, 0.3, 0.8]]))
ROLLOUT = torch.log(torch.tensor([[0.4, 0.5, 0.3, 0.1, 0.0005], [0.4, 0.4, 0.4, 0.3, 0.2]]))
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
ADVANTAGES = torch.tensor([[1.0, -1.0, 2.0, 0.5, 3.0], [1.0, 1.0, -2.0, 1.0, 1.0]])
BAND = (0.5, 5.0)  # OpenRLHF's default --algo.advantage.is_correction_threshold

# Band [0.5, 5]. seq-mask-tis: row 0's geometric mean is (0.25 * 1 * 2 * 8) ** (1/4) = sqrt(2), inside
# (with the masked 1000 it would be 5.25, outside); row 1's is 0.0375 ** (1/4) = 0.44, outside (with
# the masked 4 it would be 0.68, inside): masked tokens take no part.
EXPECTED = {
    "tis": [[0.5, 1.0, 2.0, 5.0, 0.0], [0.5, 0.5, 0.6, 1.0, 0.0]],
    "icepop": [[0.0, 1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.6, 1.0, 0.0]],
    "seq-mask-tis": [[0.25, 1.0, 2.0, 8.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]],
}
# On-policy (ratio 1, nothing clipped) the token-mean loss is -sum(w * A) / 8 tokens:
#   tis: -(0.5 - 1 + 4 + 2.5 + 0.5 + 0.5 - 1.2 + 1) / 8 = -0.85
#   icepop: -(-1 + 4 - 1.2 + 1) / 8 = -0.35;  seq-mask-tis: -(0.25 - 1 + 4 + 4) / 8 = -0.90625
EXPECTED_LOSS = {"tis": -0.85, "icepop": -0.35, "seq-mask-tis": -0.90625}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_weights_of_each_type_hand_computed(kind):
    weights = is_correction_weights(OLD, ROLLOUT, MASK, kind, *BAND)
    torch.testing.assert_close(weights, torch.tensor(EXPECTED[kind]), rtol=0, atol=1e-5)
    assert not weights.requires_grad


@pytest.mark.parametrize("kind", sorted(EXPECTED_LOSS))
def test_policy_loss_weighted_by_each_type_hand_computed(kind):
    logp = OLD.clone().requires_grad_(True)
    weights = is_correction_weights(OLD, ROLLOUT, MASK, kind, *BAND)
    out = rm.policy_loss(logp, OLD, ADVANTAGES, MASK, eps_low=0.2, is_weights=weights)
    assert math.isclose(out.loss.item(), EXPECTED_LOSS[kind], abs_tol=1e-5)
    out.loss.backward()
    # d loss / d logp_t = -w_t * A_t * ratio_t / 8: a token with weight 0 gets no gradient.
    torch.testing.assert_close(logp.grad, -weights * ADVANTAGES / 8, rtol=0, atol=1e-6)


def test_low_bound_zero_is_a_cap_from_above_only():
    """tis with low 0 is veRL's truncated IS: min(w, cap); a weight below 1 is never raised."""
    weights = is_correction_weights(OLD, ROLLOUT, MASK, "tis", 0.0, 1.5)
    torch.testing.assert_close(weights, torch.tensor([[0.25, 1.0, 1.5, 1.5, 0.0], [0.25, 0.25, 0.6, 1.0, 0.0]]),
                               rtol=0, atol=1e-5)


def test_bad_band_or_type_is_refused():
    with pytest.raises(ValueError, match="0 <= low <= high"):
        is_correction_weights(OLD, ROLLOUT, MASK, "tis", 3.0, 2.0)
    with pytest.raises(ValueError, match="tis, icepop, seq-mask-tis"):
        is_correction_weights(OLD, ROLLOUT, MASK, "sequence", *BAND)


def test_rollout_kl_is_the_masked_mean_of_rollout_minus_old():
    # -log w over the 8 trained tokens: (log 4 + 0 - log 2 - log 8 + log 4 + log 4 - log 0.6 + 0) / 8
    expected = (3 * math.log(4) - math.log(2) - math.log(8) - math.log(0.6)) / 8
    assert math.isclose(rollout_kl(OLD, ROLLOUT, MASK).item(), expected, abs_tol=1e-6)


def test_gspo_takes_its_sequence_ratio_from_the_engine_logprobs():
    """With the correction, GSPO's ratio is exp(mean(logp - rollout_logp)), no token weights. On-policy
    for the learner (logp = old): row 0's ratio sqrt(2) clips to 1.2 where A > 0 and stays where A < 0;
    row 1's 0.0375 ** (1/4) = 0.44 stays where A > 0 and clips to 0.8 where A < 0. Per sequence:
      row 0: (1.2 - sqrt(2) + 2.4 + 0.6) / 4;  row 1: (3 * r1 - 1.6) / 4;  loss = -(row 0 + row 1) / 2."""
    r1 = 0.0375 ** 0.25
    expected = -((1.2 - math.sqrt(2) + 2.4 + 0.6) / 4 + (3 * r1 - 1.6) / 4) / 2
    out = rm.policy_loss(OLD.clone(), OLD, ADVANTAGES, MASK, eps_low=0.2, ratio_type="sequence", level="sequence",
                         behaviour_logp=ROLLOUT)
    assert math.isclose(out.loss.item(), expected, abs_tol=1e-5)
    assert out.ppo_kl.item() == 0.0  # the metric stays old vs new
    # Without the engine's log-probs the ratio is 1 and the loss -mean over sequences of mean(A).
    plain = rm.policy_loss(OLD.clone(), OLD, ADVANTAGES, MASK, eps_low=0.2, ratio_type="sequence", level="sequence")
    assert math.isclose(plain.loss.item(), -((1 - 1 + 2 + 0.5) / 4 + (1 + 1 - 2 + 1) / 4) / 2, abs_tol=1e-6)
    with pytest.raises(ValueError, match="GSPO's sequence ratio only"):
        rm.policy_loss(OLD.clone(), OLD, ADVANTAGES, MASK, behaviour_logp=ROLLOUT)
