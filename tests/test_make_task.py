"""`rlmesh make-task`: built-in tasks, their held-out split and their verifier.

The generator's answers are checked against an independent computation from each problem's
arithmetic, and Countdown's against the `countdown` rule itself (every problem's own solution must
score 1); the two splits must share no problem, not even one with other names.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.coordinator.tasks import arith
from services.reward import countdown
from services.reward.rules import RuleRewardSource, last_boxed
from services.reward.source import ScoreBatch

ROOT = Path(__file__).resolve().parents[1]


def make_task(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos")])}
    return subprocess.run([sys.executable, "-m", "services.cli", "make-task", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


# What each arithmetic shape computes, written independently of the generator.
SHAPES = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
          "+-": lambda a, b, c: a + b - c, "*+": lambda n, k, e: n * k + e,
          "*-/": lambda n, k, used, f: (n * k - used) / f, "+*-": lambda a, b, m, c: (a + b) * m - c}


def test_arith_answers_are_the_arithmetic_of_their_question():
    rng = random.Random(7)
    for level in arith.LEVELS:
        for _ in range(300):
            question, answer, key = arith.problem(rng, level)
            assert key[0] == level
            shape, numbers = key[1], key[2:]
            assert SHAPES[shape](*numbers) == answer >= 0, (question, answer, key)
            # The numbers appear in the question, in order.
            assert [int(n) for n in re.findall(r"\d+", question)] == list(numbers), question


def test_splits_never_share_a_problem_and_the_same_seed_writes_the_same_files(tmp_path):
    done = make_task("arith", "--out", str(tmp_path / "a"), "--train", "3000", "--heldout", "400", "--seed", "3")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    train, heldout = rows(tmp_path / "a" / "arith_train.jsonl"), rows(tmp_path / "a" / "arith_heldout.jsonl")
    assert len(train) == 3000 and len(heldout) == 400 and summary["reward_rule"] == "math"
    assert {r["difficulty"] for r in heldout} == {1, 2, 3, 4}
    assert all(set(r) == {"prompt", "label", "difficulty", "task"} for r in train + heldout)
    prompts = [r["prompt"] for r in train + heldout]
    assert len(set(prompts)) == len(prompts)
    # Not even with other names: the numbers of a question (its arithmetic) are never in both splits.
    words = re.compile("|".join(sorted(arith.NAMES + arith.THINGS + arith.CONTAINERS, key=len, reverse=True)))
    arithmetic = lambda r: words.sub("X", r["prompt"])  # noqa: E731
    assert not {arithmetic(r) for r in train} & {arithmetic(r) for r in heldout}
    about = json.loads((tmp_path / "a" / "arith_task.json").read_text())
    assert about["difficulty"]["heldout"] == {str(d): sum(r["difficulty"] == d for r in heldout) for d in (1, 2, 3, 4)}

    again = make_task("arith", "--out", str(tmp_path / "b"), "--train", "3000", "--heldout", "400", "--seed", "3")
    other = make_task("arith", "--out", str(tmp_path / "c"), "--train", "3000", "--heldout", "400", "--seed", "4")
    assert again.returncode == 0 and other.returncode == 0
    for name in ("arith_train.jsonl", "arith_heldout.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()


def test_countdown_problems_are_solvable_and_graded_by_the_rule(tmp_path):
    done = make_task("countdown", "--out", str(tmp_path), "--train", "1500", "--heldout", "300")
    assert done.returncode == 0, done.stderr
    train, heldout = rows(tmp_path / "countdown_train.jsonl"), rows(tmp_path / "countdown_heldout.jsonl")
    key = lambda r: (tuple(sorted(json.loads(r["label"])["numbers"])), json.loads(r["label"])["target"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in heldout}
    assert {r["difficulty"] for r in train} == {3, 4}
    for r in train + heldout:
        label = json.loads(r["label"])
        assert len(label["numbers"]) == r["difficulty"] and str(label["target"]) in r["prompt"]
        reward, metrics = countdown.grade(f"<think>...</think> <answer>{r['solution']}</answer>", r["label"])
        assert reward == 1.0 and metrics["accuracy"] == 1.0, r


LABEL = json.dumps({"target": 24, "numbers": [4, 6, 1, 1]})


@pytest.mark.parametrize("response, reward, accuracy, bad_numbers", [
    ("<answer>4 * 6 * 1 * 1</answer>", 1.0, 1, 0),
    ("<answer>(4 * 6) / (1 * 1) = 24</answer>", 1.0, 1, 0),       # "= target" tolerated
    ("first <answer>4+6</answer>, then <answer>6 × 4 × (1 ÷ 1)</answer>", 1.0, 1, 0),  # the last one counts
    ("so \\boxed{(6 - 1 - 1) * 4 + 8}", 0.1, 0, 1),              # 8 is not given
    ("\\boxed{4 * 6}", 0.1, 0, 1),                                # reaches 24 without the ones
    ("<answer>4 * 6 + 1 - 1</answer>", 1.0, 1, 0),
    ("<answer>4 * 6 + 1 + 1</answer>", 0.1, 0, 0),                # 26
    ("<answer>4 / (1 - 1) * 6</answer>", 0.1, 0, 0),              # division by zero: no value
    ("<answer>__import__('os')</answer>", 0.1, 0, 0),             # not arithmetic: never evaluated
    ("<answer>4 ** 6 - 1 - 1</answer>", 0.1, 0, 0),
    ("It is 24.", 0.0, 0, 0),
])
def test_countdown_grading(response, reward, accuracy, bad_numbers):
    got, metrics = countdown.grade(response, LABEL, last_boxed(response))
    assert (got, metrics["accuracy"], metrics["bad_numbers"]) == (reward, accuracy, bad_numbers)


def test_countdown_division_is_exact():
    label = json.dumps({"target": 7, "numbers": [7, 2, 2]})
    assert countdown.grade("<answer>7 / 2 * 2</answer>", label)[0] == 1.0
    assert countdown.grade("<answer>7 // 2 * 2</answer>", label)[0] == 0.1


def test_countdown_rule_in_the_reward_source_and_a_bad_label():
    import asyncio

    import grpc

    from services.common.errors import ServiceError

    source = RuleRewardSource(["countdown"])
    batch = ScoreBatch.from_texts(["q"] * 3, ["<answer>4*6*1*1</answer>", "<answer>4+6</answer>", "no"], [LABEL] * 3)
    out = asyncio.run(source.score(batch))
    np.testing.assert_array_equal(out.rewards, [1.0, 0.1, 0.0])
    np.testing.assert_array_equal(out.extra["accuracy"], [1, 0, 0])
    np.testing.assert_array_equal(out.extra["no_answer"], [0, 0, 1])
    bad = ScoreBatch.from_texts(["q", "q"], ["<answer>1</answer>"] * 2, [LABEL, "24"], sample_ids=["a", "b"])
    with pytest.raises(ServiceError) as err:
        asyncio.run(source.score(bad))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "samples[1].label" in err.value.message and "make-task countdown" in err.value.message


def test_bad_options_are_one_line_errors(tmp_path):
    for args, words in ((["arith", "--levels", "1,7"], "--levels '1,7': [7] not available"),
                        (["arith", "--levels", "1", "--train", "100000"], "distinct problems"),
                        (["arith", "--train", "-1"], "--train -1 must be >= 0")):
        done = make_task(*args, "--out", str(tmp_path / "x"))
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
