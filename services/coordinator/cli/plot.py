"""`rlmesh plot RUN_DIR`: PNG curves of a run's metrics.jsonl (reward, KL, length, step time, ...).

RUN_DIR is an RL run folder (records with "global_step") or an offline trainer's --save_path
(records with "step").

Writes RUN_DIR/plots/<metric>.png for each chosen metric and RUN_DIR/plots/summary.png with the
four main curves side by side; prints the paths.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

SUMMARY = ("reward/mean", "kl/mean", "response_length/mean", "time/step_s")


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file; RUN_DIR is the folder a training run wrote "
                                "(its --run_dir, by default runs/<run name>)")
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        raw = json.loads(line)
        # RL runs write "global_step"; the offline trainers (SFT, RM, DPO) write "step".
        step = raw.get("global_step", raw.get("step"))
        if step is None:
            continue
        numbers = {k: float(v) for k, v in raw.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("global_step", "step")}
        # A step may have several records (training, then an evaluation after the data ran out) and a
        # resumed run may have rewritten steps: records merge, the last value of each metric wins.
        by_step.setdefault(int(step), {"global_step": int(step)}).update(numbers)
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["global_step"], r[key]) for r in records if key in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _safe_name(key: str) -> str:
    return key.replace("/", "_")


def draw_curve(ax, records: list[dict], key: str) -> None:
    """One metric against the global step on a matplotlib axis."""
    from matplotlib.ticker import MaxNLocator

    steps, values = series(records, key)
    ax.plot(steps, values, marker="o" if len(steps) < 30 else None)
    ax.set_title(key)
    ax.set_xlabel("global step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def plot_run(run_dir: pathlib.Path, keys: list[str] | None = None) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no steps yet")
    available = sorted({k for r in records for k in r} - {"global_step", "unix_time"})
    keys = keys or available
    missing = [k for k in keys if k not in available]
    if missing:
        raise KeyError(f"metrics {missing} are not in the run; available: {available}")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    summary_keys = [k for k in SUMMARY if k in available]
    if summary_keys:
        fig, axes = plt.subplots(1, len(summary_keys), figsize=(4.2 * len(summary_keys), 3.2), squeeze=False)
        for ax, key in zip(axes[0], summary_keys):
            draw_curve(ax, records, key)
        fig.tight_layout()
        fig.savefig(out_dir / "summary.png", dpi=110)
        plt.close(fig)
        written.append(out_dir / "summary.png")
    for key in keys:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        draw_curve(ax, records, key)
        fig.tight_layout()
        path = out_dir / f"{_safe_name(key)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="rlmesh plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="folder of a training run (holds metrics.jsonl)")
    parser.add_argument("--metrics", nargs="*", default=None,
                        help="metric names to plot (default: all in the file), e.g. reward/mean kl/mean")
    args = parser.parse_args(argv)
    try:
        written = plot_run(pathlib.Path(args.run_dir), args.metrics)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"rlmesh plot: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
