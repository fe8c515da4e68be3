"""One PNG of what a user judges an RL run by: held-out accuracy against wall-clock time and against
steps (with its 95% interval), and beside it the training reward, KL, response length with the
truncation rate, and the step time.

    from services.coordinator.cli.learning_curve import plot_learning_curve
    plot_learning_curve(run_dir, run_dir / "plots" / "learning_curve.png", title="SmolLM2-135M, arith")

It reads the run folder's metrics.jsonl (services.coordinator.cli.plot.read_metrics): the held-out
points are the records with eval/pass@1 (--eval_dataset with --eval_steps: before the first step,
every N steps, after the last), their interval eval/pass@1_ci_low / _ci_high. Wall-clock time is
counted from the first record's time (the evaluation before the first step), so it shows training
time, evaluations included, without the services' start.
"""

from __future__ import annotations

import pathlib

from services.coordinator.cli.plot import read_metrics, series

ACCURACY = "eval/pass@1"
PANELS = (("reward/mean", "training reward (mean of the samples)"), ("kl/mean", "KL to the reference"),
          ("response_length/mean", "response length (tokens)"), ("time/step_s", "step time (s)"))


def accuracy_points(records: list[dict]) -> dict[str, list[float]]:
    """The held-out evaluations: step, minutes since the first record, pass@1 and its interval."""
    start = records[0].get("unix_time", 0.0)
    points = {"step": [], "minutes": [], "accuracy": [], "low": [], "high": []}
    for r in records:
        if ACCURACY not in r:
            continue
        points["step"].append(r["global_step"])
        points["minutes"].append((r.get("unix_time", start) - start) / 60)
        points["accuracy"].append(r[ACCURACY])
        points["low"].append(r.get(f"{ACCURACY}_ci_low", r[ACCURACY]))
        points["high"].append(r.get(f"{ACCURACY}_ci_high", r[ACCURACY]))
    return points


def _accuracy_panel(ax, points: dict[str, list[float]], x: str, xlabel: str) -> None:
    ax.fill_between(points[x], points["low"], points["high"], alpha=0.25, label="95% interval")
    ax.plot(points[x], points["accuracy"], marker="o", label="greedy pass@1")
    for xi, yi in zip(points[x][:1] + points[x][-1:], points["accuracy"][:1] + points["accuracy"][-1:]):
        ax.annotate(f"{yi:.1%}", (xi, yi), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_title("held-out accuracy")
    ax.set_xlabel(xlabel)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)


def plot_learning_curve(run_dir: str | pathlib.Path, out: str | pathlib.Path, title: str = "") -> pathlib.Path:
    """Draws the figure into `out` (PNG) and returns its path. Raises ValueError when the run has no
    held-out evaluation (run it with --eval_dataset and --eval_steps)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = read_metrics(pathlib.Path(run_dir))
    points = accuracy_points(records)
    if not points["step"]:
        raise ValueError(f"{pathlib.Path(run_dir) / 'metrics.jsonl'} has no {ACCURACY}: the run evaluated nothing "
                         "(give --eval_dataset FILE and --eval_steps N)")
    fig, axes = plt.subplots(2, 3, figsize=(13.5, 6.6))
    _accuracy_panel(axes[0][0], points, "minutes", "wall-clock minutes")
    _accuracy_panel(axes[0][1], points, "step", "global step")
    for ax, (key, label) in zip([axes[0][2], *axes[1]], PANELS):
        steps, values = series(records, key)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None)
        if key == "response_length/mean":
            twin = ax.twinx()
            t_steps, truncated = series(records, "response_length/truncated_ratio")
            twin.plot(t_steps, truncated, color="tab:red", alpha=0.6, linestyle="--")
            twin.set_ylabel("truncated share (dashed)", color="tab:red", fontsize=8)
            twin.set_ylim(0, 1)
        ax.set_title(label)
        ax.set_xlabel("global step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
