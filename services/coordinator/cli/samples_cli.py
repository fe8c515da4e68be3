"""`rlmesh samples RUN_DIR [--step N] [--n K]`: the generated samples a training run wrote, readable.

RUN_DIR is the run folder (its --run_dir, by default runs/<run name>); the run writes up to
--log_samples samples of every step into RUN_DIR/samples/ (services/coordinator/loop/samples_log.py).
Without --step the latest step is shown; --step all shows every step; --json prints the records as
they are stored, one per line.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import textwrap

from services.common.user_errors import UserError
from services.coordinator.loop.samples_log import SAMPLES_DIR, logged_steps, read_samples


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    parts, start = [], None
    for i, step in enumerate(steps):
        start = step if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != step + 1:
            parts.append(str(step) if start == step else f"{start}-{step}")
            start = None
    return ", ".join(parts)


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def format_sample(record: dict, position: int, count: int) -> str:
    """One sample as a header line of its facts, then its prompt and response, indented."""
    facts = [f"step {record['step']}", f"sample {position}/{count}",
             f"prompt {record['prompt_uid']} #{record['sample_index']}", f"reward {_number(record['reward'])}"]
    if record.get("label"):
        facts.append(f"label {record['label']}")
    if record.get("difficulty"):
        facts.append(f"difficulty {record['difficulty']}")
    facts += [f"{record['response_tokens']} tokens" + (" (truncated)" if record["truncated"] else ""),
              f"weights v{record['weight_version']}"]
    extra = ", ".join(f"{k} {_number(v)}" for k, v in sorted(record.get("extra", {}).items()))
    lines = ["=" * 100, " | ".join(facts)] + ([f"reward logs: {extra}"] if extra else [])
    for name in ("prompt", "response"):
        text = record[name] if record[name] else "(empty)"
        lines += [f"{name}:", textwrap.indent(text.rstrip("\n"), "    ", lambda _: True)]
    return "\n".join(lines)


def chosen_steps(run_dir: pathlib.Path, step: str | None) -> list[int]:
    available = logged_steps(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such folder; RUN_DIR is the folder a training run wrote (its --run_dir, "
                        "by default runs/<run name>)")
    if not available:
        raise UserError(f"{run_dir / SAMPLES_DIR}: no samples yet; a run writes them after each step unless it "
                        "ran with --log_samples 0")
    if step is None:
        return available[-1:]
    if step == "all":
        return available
    if not step.isdigit() or int(step) not in available:
        raise UserError(f"--step {step}: no samples of that step in {run_dir / SAMPLES_DIR}; steps with samples: "
                        f"{_ranges(available)} (or --step all)")
    return [int(step)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="rlmesh samples", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="folder of a training run (holds samples/)")
    parser.add_argument("--step", default=None, help="the step to show, or all (default: the latest)")
    parser.add_argument("--n", type=int, default=0, help="at most this many samples per step (default: all written)")
    parser.add_argument("--json", action="store_true", help="the stored JSON records, one per line")
    args = parser.parse_args(argv)
    if args.n < 0:
        raise UserError(f"--n {args.n} must be >= 0 (0 = every sample written)")
    run_dir = pathlib.Path(args.run_dir)
    steps = chosen_steps(run_dir, args.step)
    if not args.json:
        print(f"{run_dir}: steps with samples {_ranges(logged_steps(run_dir))}")
    for step in steps:
        records = read_samples(run_dir, step)
        records = records[:args.n] if args.n else records
        for position, record in enumerate(records, 1):
            print(json.dumps(record, ensure_ascii=False) if args.json else format_sample(record, position, len(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
