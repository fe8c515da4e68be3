"""Countdown (`rlmesh make-task countdown`): reach a target from given numbers with + - * / and
brackets, each number used exactly once (the task of TinyZero and of the numbers round of the TV
game). Graded by the `countdown` reward rule (services/reward/countdown.py).

Each problem is built from a random expression over its numbers, so it has at least one solution;
the label is JSON, {"target": T, "numbers": [...]}, which the rule reads. The difficulty is the count
of numbers (3 or 4 by default). The key of a problem is its sorted numbers and its target.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction

_OPS = ("+", "-", "*", "/")


def _combine(rng: random.Random, items: list[tuple[Fraction, str]]) -> tuple[Fraction, str] | None:
    """Joins the (value, text) items in a random order of random binary operations."""
    items = list(items)
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (a, ta), (b, tb) = items[i], items[j]
        op = rng.choice(_OPS)
        if op == "/" and b == 0:
            return None
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [(value, f"({ta} {op} {tb})")]
    return items[0]


def problem(rng: random.Random, count: int, low: int = 1, high: int = 99,
            max_target: int = 999) -> tuple[str, str, tuple, str]:
    """(question, label, key, one solution) of a problem with `count` numbers."""
    while True:
        numbers = [rng.randint(low, high) for _ in range(count)]
        made = _combine(rng, [(Fraction(n), str(n)) for n in numbers])
        if made is None:
            continue
        value, text = made
        if value.denominator != 1 or not 1 <= value <= max_target:
            continue
        target = int(value)
        shown = sorted(numbers) if rng.random() < 0.5 else numbers
        question = (f"Use the numbers {shown} to make {target}. You may use +, -, * and / and brackets, and "
                    f"each number must be used exactly once. Think it through in <think> </think>, then give "
                    f"only the expression in <answer> </answer>, for example <answer> (7 - 2) * 3 </answer>.")
        label = json.dumps({"target": target, "numbers": shown})
        return question, label, (tuple(sorted(numbers)), target), text[1:-1] if text.startswith("(") else text
