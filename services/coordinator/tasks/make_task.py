"""`rlmesh make-task NAME --out DIR`: a built-in task's training and held-out splits as JSONL.

Rows are OpenRLHF's prompt/label layout plus `difficulty` (what `--group_metrics_key difficulty`
and the evaluation report break results down by):

    {"prompt": "...", "label": "...", "difficulty": 2, "task": "arith"}

Files: DIR/NAME_train.jsonl, DIR/NAME_heldout.jsonl and DIR/NAME_task.json (the settings, the
counts per difficulty, the reward rule to train and evaluate with, and the command that wrote them).
The same settings write the same files. Problems are drawn until each split is full; a problem whose
key (its arithmetic, not its wording) was drawn before is drawn again, so no problem is in both
splits, nor twice in one. The held-out split is filled first.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import tempfile

from services.common.config_error import ConfigError
from services.coordinator.tasks import arith, countdown

TASKS = {
    "arith": "arithmetic word problems in 4 levels of difficulty; graded by the `math` rule",
    "countdown": "reach a target from 3-4 numbers with + - * / (TinyZero's task); graded by the `countdown` rule",
}
REWARD_RULE = {"arith": "math", "countdown": "countdown"}
# Draws in a row that only found problems drawn before: the levels hold no more distinct problems.
_MAX_REPEATS = 20_000


def _arith_rows(args) -> tuple[callable, list[int]]:
    levels = _levels(args.levels, sorted(arith.LEVELS), "--levels")

    def draw(rng: random.Random) -> tuple[dict, tuple]:
        level = rng.choice(levels)
        question, answer, key = arith.problem(rng, level)
        prompt = f"{question}{args.instruction}"
        return {"prompt": prompt, "label": str(answer), "difficulty": level, "task": "arith"}, key

    return draw, levels


def _countdown_rows(args) -> tuple[callable, list[int]]:
    counts = _levels(args.levels or "3,4", range(2, 7), "--levels (numbers per problem)")

    def draw(rng: random.Random) -> tuple[dict, tuple]:
        count = rng.choice(counts)
        question, label, key, solution = countdown.problem(rng, count, args.low, args.high, args.max_target)
        return {"prompt": question, "label": label, "difficulty": count, "task": "countdown",
                "solution": solution}, key

    return draw, counts


def _levels(text: str, allowed, flag: str) -> list[int]:
    allowed = list(allowed)
    if not text:
        return allowed
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give whole numbers separated by commas, e.g. 1,2") from None
    bad = [x for x in levels if x not in allowed]
    if bad or not levels:
        raise ConfigError(f"{flag} {text!r}: {bad or 'none given'} not available; choose from {allowed}")
    return levels


def make_task(args) -> dict:
    draw, levels = (_arith_rows if args.name == "arith" else _countdown_rows)(args)
    rng = random.Random(f"{args.name}:{args.seed}")
    seen: set[tuple] = set()
    splits: dict[str, list[dict]] = {"heldout": [], "train": []}
    for split, size in (("heldout", args.heldout), ("train", args.train)):
        repeats = 0
        while len(splits[split]) < size:
            if repeats > _MAX_REPEATS:
                raise ConfigError(f"rlmesh make-task {args.name}: only {len(seen)} distinct problems found for "
                                  f"--heldout {args.heldout} + --train {args.train} at --levels {levels}; "
                                  "ask for fewer, or allow more levels")
            row, key = draw(rng)
            if key in seen:
                repeats += 1
                continue
            repeats = 0
            seen.add(key)
            splits[split].append(row)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {split: out / f"{args.name}_{split}.jsonl" for split in ("train", "heldout")}
    for split, path in files.items():
        _write_atomically(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in splits[split]))
    mix = {split: {str(level): sum(1 for r in rows if r["difficulty"] == level) for level in levels}
           for split, rows in splits.items()}
    about = {"task": args.name, "description": TASKS[args.name], "seed": args.seed, "levels": levels,
             "train": len(splits["train"]), "heldout": len(splits["heldout"]), "difficulty": mix,
             "reward_rule": REWARD_RULE[args.name], "label_key": "label", "input_key": "prompt",
             "files": {k: str(v) for k, v in files.items()},
             "command": "rlmesh make-task " + " ".join(sys.argv[1:] if args.argv is None else args.argv)}
    _write_atomically(out / f"{args.name}_task.json", json.dumps(about, indent=2) + "\n")
    return about


def _write_atomically(path: pathlib.Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlmesh make-task", allow_abbrev=False,
        description="Write a built-in task's training and held-out prompts (JSONL: prompt, label, difficulty), "
                    "generated here from a seed; the two splits never share a problem.",
        epilog="tasks: " + "; ".join(f"{k}: {v}" for k, v in TASKS.items()) + ". Train with --prompt_data "
               "DIR/NAME_train.jsonl --input_key prompt --label_key label --reward_func RULE, evaluate with "
               "--eval_dataset DIR/NAME_heldout.jsonl.")
    p.add_argument("name", choices=sorted(TASKS), help="which task")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--train", type=int, default=5000, help="training problems")
    p.add_argument("--heldout", type=int, default=500, help="held-out problems")
    p.add_argument("--seed", type=int, default=0, help="the same seed and settings write the same files")
    p.add_argument("--levels", default="", help="difficulties to draw from, comma-separated (arith: 1-4, all by "
                   "default; countdown: how many numbers, 3,4 by default)")
    p.add_argument("--instruction", default=" Give the final answer as a single number.",
                   help="arith: appended to every question")
    p.add_argument("--low", type=int, default=1, help="countdown: smallest number")
    p.add_argument("--high", type=int, default=99, help="countdown: largest number")
    p.add_argument("--max_target", type=int, default=999, help="countdown: largest target")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = argv
    for flag in ("train", "heldout"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag} {getattr(args, flag)} must be >= 0")
    if args.train + args.heldout == 0:
        raise ConfigError("--train and --heldout are both 0: nothing to write")
    if args.name == "countdown" and not 0 <= args.low <= args.high:
        raise ConfigError(f"--low {args.low} / --high {args.high}: need 0 <= low <= high")
    about = make_task(args)
    print(json.dumps({k: about[k] for k in ("task", "train", "heldout", "difficulty", "reward_rule", "files")}))
    return 0
