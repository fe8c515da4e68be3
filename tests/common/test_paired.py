"""Before / after accuracy on the same problems: McNemar's exact p-value against values computed by
hand, and the gain criterion against the Wilson intervals it is built from."""

import pytest

from services.common.confidence import wilson_interval
from services.common.paired import compare, mcnemar_exact_p


@pytest.mark.parametrize("gained, lost, p", [
    (0, 0, 1.0),  # nothing changed
    (5, 0, 2 / 32),  # 2 * P(X <= 0), X ~ Bin(5, 1/2)
    (0, 5, 2 / 32),  # symmetric
    (9, 1, 2 * 11 / 1024),  # 2 * (C(10,0) + C(10,1)) / 2^10
    (3, 3, 1.0),  # capped at 1
    (12, 2, 2 * (1 + 14 + 91) / 2 ** 14),
])
def test_mcnemar_exact_p_values(gained, lost, p):
    assert mcnemar_exact_p(gained, lost) == pytest.approx(p, rel=1e-12)


def test_mcnemar_stays_exact_for_large_counts():
    # 400 changed verdicts split evenly: p is 1; split 250 / 150: far below 1e-3, and no float overflow.
    assert mcnemar_exact_p(200, 200) == 1.0
    assert 0 < mcnemar_exact_p(250, 150) < 1e-3


def test_compare_counts_the_changed_verdicts_and_uses_wilson_intervals():
    before = [True] * 30 + [False] * 70
    after = [True] * 25 + [False] * 5 + [True] * 40 + [False] * 30  # 5 lost, 40 gained
    c = compare(before, after)
    assert (c.problems, c.before, c.after, c.gained, c.lost) == (100, 0.30, 0.65, 40, 5)
    assert c.before_interval == wilson_interval(30, 100) and c.after_interval == wilson_interval(65, 100)
    assert c.gain == pytest.approx(0.35)
    assert c.margin == pytest.approx((c.before_interval[1] - c.before_interval[0]) / 2
                                     + (c.after_interval[1] - c.after_interval[0]) / 2)
    assert c.significant and c.mcnemar_p == mcnemar_exact_p(40, 5)
    assert c.as_dict()["significant"] is True


def test_a_small_gain_is_not_called_significant():
    before = [True] * 40 + [False] * 60
    after = [True] * 45 + [False] * 55  # +5 points on 100 problems: inside the intervals
    c = compare(before, after)
    assert c.gain == pytest.approx(0.05) and not c.significant and c.mcnemar_p == mcnemar_exact_p(5, 0)


def test_compare_refuses_unpaired_or_empty_verdicts():
    with pytest.raises(ValueError, match="same problems"):
        compare([True, False], [True])
    with pytest.raises(ValueError, match="no problems"):
        compare([], [])
    with pytest.raises(ValueError, match=">= 0"):
        mcnemar_exact_p(-1, 2)
