"""The entropy the learner measures as a metric: the same numbers as the entropy term's, taken
without an autograd graph, block by block. TrainActor's reports of it: tests/learner/test_learner_zero3.py
(full head: equal to a plain forward pass) and test_learner_zero2.py (fused head: NaN, not measured)."""

import torch

from services.common import rl_math
from services.learner import entropy_metric


def test_blockwise_entropy_without_grad_equals_the_entropy_term():
    logits = torch.randn(37, 50, requires_grad=True)
    for temperature in (1.0, 0.7):
        got = entropy_metric.entropy_without_grad(logits, temperature, block_rows=8)
        want = rl_math.entropy_from_logits(logits, temperature)
        assert not got.requires_grad and got.dtype == torch.float32
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=0)
    assert entropy_metric.entropy_without_grad(logits[:0], 1.0).shape == (0,)


def test_measured_where_the_logits_are_at_hand_and_no_term_is_trained():
    assert entropy_metric.measured("full", 0.0) and entropy_metric.measured("chunked", 0.0)
    assert not entropy_metric.measured("fused", 0.0)  # the kernel never keeps the logits
    assert not entropy_metric.measured("full", 0.01)  # the entropy term itself is reported
