"""Arithmetic word problems in graded difficulty (`rlmesh make-task arith`).

Difficulty levels (the `difficulty` key of each row; `--levels` chooses which are written):

  1  one addition or subtraction, numbers up to 20, stated plainly ("What is 14 + 5?")
  2  one operation in a short story: two-digit addition or subtraction, or a product by 2-9
  3  two operations in a story, two-digit numbers (bought, then gave away; packs, then extra)
  4  three operations in a story with a product or an exact division

Every answer is a whole number >= 0. The key of a problem is its arithmetic (the operations and
numbers, not the names or wording): the held-out split holds no problem whose key is in the training
split, so a held-out problem is never a training one with other names.
"""

from __future__ import annotations

import random

NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam",
         "Maya", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yara", "Zoe")
THINGS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells", "cards", "coins",
          "beads", "eggs", "flowers", "toy cars", "balloons")
CONTAINERS = ("boxes", "bags", "packs", "jars", "baskets", "crates")


def _level1(rng: random.Random) -> tuple[str, int, tuple]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b, ("+", a, b)
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b, ("-", a, b)


def _level2(rng: random.Random) -> tuple[str, int, tuple]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return (f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
                a + b, ("+", a, b))
    if kind == 1:
        a = rng.randint(20, 99)
        b = rng.randint(10, a)
        return (f"{name} had {a} {thing} and gave {b} of them away. How many {thing} are left?",
                a - b, ("-", a, b))
    n, k = rng.randint(2, 9), rng.randint(2, 12)
    box = rng.choice(CONTAINERS)
    return (f"{name} has {n} {box} with {k} {thing} in each. How many {thing} is that in all?",
            n * k, ("*", n, k))


def _level3(rng: random.Random) -> tuple[str, int, tuple]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    if rng.random() < 0.5:
        a, b = rng.randint(10, 60), rng.randint(10, 60)
        c = rng.randint(5, a + b)
        return (f"{name} has {a} {thing}, buys {b} more, then gives {c} to a friend. "
                f"How many {thing} does {name} have now?", a + b - c, ("+-", a, b, c))
    n, k, e = rng.randint(2, 9), rng.randint(3, 15), rng.randint(1, 30)
    box = rng.choice(CONTAINERS)
    return (f"{name} buys {n} {box} of {thing} with {k} in each, and already had {e}. "
            f"How many {thing} does {name} have in total?", n * k + e, ("*+", n, k, e))


def _level4(rng: random.Random) -> tuple[str, int, tuple]:
    name, other, thing = *rng.sample(NAMES, 2), rng.choice(THINGS)
    box = rng.choice(CONTAINERS)
    if rng.random() < 0.5:
        n, k, friends = rng.randint(3, 12), rng.randint(4, 15), rng.randint(2, 6)
        share = rng.randint(1, (n * k - 1) // friends)  # an exact share, and at least one used
        left = share * friends
        spent = n * k - left
        return (f"{name} has {n} {box} of {thing} with {k} in each. {name} uses {spent} of them and shares "
                f"the rest equally among {friends} friends. How many {thing} does each friend get?",
                left // friends, ("*-/", n, k, spent, friends))
    a, b, m = rng.randint(10, 50), rng.randint(10, 50), rng.randint(2, 5)
    c = rng.randint(1, (a + b) * m)
    return (f"{name} collects {a} {thing} and {other} collects {b}. Together they then get {m} times as many "
            f"as they had, and lose {c}. How many {thing} do they have now?", (a + b) * m - c, ("+*-", a, b, m, c))


LEVELS = {1: _level1, 2: _level2, 3: _level3, 4: _level4}


def problem(rng: random.Random, level: int) -> tuple[str, int, tuple]:
    """(question, answer, key) of one problem at a level; the key is its arithmetic alone."""
    question, answer, key = LEVELS[level](rng)
    assert answer >= 0 and float(answer).is_integer(), (question, answer)
    return question, int(answer), (level, *key)
