"""The `countdown` rule: does the response's expression reach the target with the given numbers?

The label is JSON, {"target": T, "numbers": [n1, n2, ...]} (what `rlmesh make-task countdown`
writes). The expression is the content of the response's last <answer>...</answer>, else of its last
\\boxed{...}. It may hold whole numbers, + - * / (also x, ×, ÷), brackets and spaces, and is
evaluated exactly (fractions, so 7 / 2 * 2 is 7); it must use each given number exactly once and no
other number.

Rewards, as TinyZero grades the task: 1.0 when the expression equals the target and uses the numbers
as asked; 0.1 (--countdown_format_reward) when an expression was given but is wrong, uses other numbers
or cannot be evaluated; 0 when the response gives no expression. Per-sample metrics: accuracy,
no_answer, and bad_numbers (an expression that does not use the given numbers exactly once).
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ALLOWED = re.compile(r"^[\d\s+\-*/().]+$")
_LONGEST = 200  # characters: a longer "expression" is not evaluated


class LabelError(ValueError):
    """A label that is not countdown's JSON."""


def parse_label(label: str) -> tuple[Fraction, list[int]]:
    """(target, numbers) of a label; LabelError saying what is wrong otherwise."""
    try:
        data = json.loads(label)
        target, numbers = data["target"], data["numbers"]
        if not isinstance(numbers, list) or not numbers or not all(isinstance(n, int) for n in numbers):
            raise TypeError
        return Fraction(target), [int(n) for n in numbers]
    except (ValueError, TypeError, KeyError):
        raise LabelError(f"{label[:80]!r} is not {{\"target\": T, \"numbers\": [whole numbers]}}") from None


def extract_expression(response: str, boxed: str | None = None) -> str | None:
    """The last <answer>...</answer>'s content, else `boxed` (the response's last \\boxed{...} content,
    which the caller extracts); None if neither."""
    found = _ANSWER.findall(response)
    if found:
        return found[-1].strip()
    return boxed.strip() if boxed is not None else None


def evaluate(expression: str) -> tuple[Fraction, list[int]] | None:
    """(value, numbers used) of an arithmetic expression, exactly; None if it is not one."""
    text = (expression.replace("×", "*").replace("x", "*").replace("X", "*").replace("÷", "/")
            .replace("\\times", "*").replace("\\div", "/").replace("\\cdot", "*"))
    if "=" in text:  # "(7 - 2) * 3 = 15": the left side is the expression
        text = text.split("=")[0]
    text = text.strip()
    if not text or len(text) > _LONGEST or not _ALLOWED.match(text) or "**" in text or "//" in text:
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    used: list[int] = []

    def value(node) -> Fraction:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if right == 0:
                raise ZeroDivisionError
            return left / right
        raise ValueError("not + - * / of whole numbers")

    try:
        return value(tree), used
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def grade(response: str, label: str, boxed: str | None = None,
          format_reward: float = 0.1) -> tuple[float, dict[str, float]]:
    """(reward, metrics) of one response (boxed: its last \\boxed{} content, if any); LabelError for
    a label that is not countdown's JSON."""
    target, numbers = parse_label(label)
    expression = extract_expression(response, boxed)
    if expression is None:
        return 0.0, {"accuracy": 0.0, "no_answer": 1.0, "bad_numbers": 0.0}
    result = evaluate(expression)
    if result is None:
        return format_reward, {"accuracy": 0.0, "no_answer": 0.0, "bad_numbers": 0.0}
    value, used = result
    numbers_ok = Counter(used) == Counter(numbers)
    correct = numbers_ok and value == target
    return (1.0 if correct else format_reward), {"accuracy": float(correct), "no_answer": 0.0,
                                                 "bad_numbers": float(not numbers_ok)}
