"""Job L's report: held-out accuracy against steps and against wall-clock seconds per framework, the
comparison with the best peer, a table and a PNG (learn_peers.py calls it after the evaluation; it
also runs on a results file alone):

    python3 bench/gpu/learn_report.py RESULTS.json [--out learning-L.png]

The goal it checks (rlmesh against the peer with the highest final accuracy, "the best peer"):
  - equal steps: at every step both evaluated, rlmesh's accuracy is at most 2 points below the peer's;
  - time: rlmesh reaches the peer's final accuracy in at most half the wall-clock seconds the peer
    took to reach it (seconds from each framework's start to the end of the save of the first
    checkpoint at or above that accuracy).
With 200 held-out problems one accuracy has a 95% interval of about +-6 points, wider than the 2-point
margin: the table prints the intervals beside the verdicts.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

PEER_ORDER = ("rlmesh", "openrlhf", "trl", "verl")


def curves(scores: list[dict]) -> dict[str, list[dict]]:
    """framework -> its points in step order: {"step", "t_s", "accuracy", "ci95"}. The base model's
    score is every framework's step 0 at 0 s; checkpoints with an error are left out."""
    base = next((s for s in scores if s["framework"] == "base" and s.get("accuracy") is not None), None)
    out: dict[str, list[dict]] = {}
    for s in scores:
        if s["framework"] == "base" or s.get("accuracy") is None:
            continue
        out.setdefault(s["framework"], []).append({k: s[k] for k in ("step", "t_s", "accuracy", "ci95")})
    for framework, points in out.items():
        points.sort(key=lambda p: p["step"])
        if base is not None:
            points.insert(0, {"step": 0, "t_s": 0.0, "accuracy": base["accuracy"], "ci95": base["ci95"]})
    return dict(sorted(out.items(), key=lambda kv: PEER_ORDER.index(kv[0]) if kv[0] in PEER_ORDER else 99))


def time_to_reach(points: list[dict], target: float) -> float | None:
    """Seconds at the first point (after step 0) whose accuracy is at least target; None if none is."""
    return next((p["t_s"] for p in points if p["step"] > 0 and p["accuracy"] >= target - 1e-12), None)


def compare(curve: dict[str, list[dict]], subject: str = "rlmesh", margin: float = 0.02) -> dict:
    """The subject against the best peer (highest accuracy at its last point)."""
    peers = {f: pts for f, pts in curve.items() if f != subject and len(pts) > 1}
    if subject not in curve or len(curve[subject]) < 2 or not peers:
        return {"verdict": f"no comparison: needs {subject} and a peer with evaluated checkpoints"}
    best = max(peers, key=lambda f: peers[f][-1]["accuracy"])
    mine, theirs = {p["step"]: p for p in curve[subject]}, {p["step"]: p for p in peers[best]}
    common = sorted(set(mine) & set(theirs) - {0})
    gaps = {step: mine[step]["accuracy"] - theirs[step]["accuracy"] for step in common}
    target = peers[best][-1]["accuracy"]
    t_peer, t_mine = time_to_reach(peers[best], target), time_to_reach(curve[subject], target)
    ratio = t_mine / t_peer if t_mine is not None and t_peer else None
    return {"best_peer": best, "best_peer_final_accuracy": target, "best_peer_final_step": peers[best][-1]["step"],
            "subject_final_accuracy": curve[subject][-1]["accuracy"], "steps_compared": common,
            "accuracy_gap_by_step": gaps, "worst_gap": min(gaps.values()) if gaps else None,
            "equal_steps_goal_met": bool(gaps) and min(gaps.values()) >= -margin,
            "best_peer_seconds_to_target": t_peer, "subject_seconds_to_target": t_mine, "time_ratio": ratio,
            "time_goal_met": ratio is not None and ratio <= 0.5}


def table(curve: dict[str, list[dict]], comparison: dict, subject: str = "rlmesh") -> str:
    lines = [f"{'framework':<10}{'step':>6}{'seconds':>9}{'accuracy':>10}  95% interval"]
    for framework, points in curve.items():
        for p in points:
            low, high = p["ci95"]
            lines.append(f"{framework:<10}{p['step']:>6}{p['t_s']:>9.0f}{p['accuracy']:>10.3f}  {low:.3f}-{high:.3f}")
    if "best_peer" not in comparison:
        return "\n".join(lines + [comparison["verdict"]])
    c = comparison
    worst = f"{c['worst_gap'] * 100:+.1f} points" if c["worst_gap"] is not None else "no common step"
    lines.append(f"best peer: {c['best_peer']} (final {c['best_peer_final_accuracy']:.3f} at step "
                 f"{c['best_peer_final_step']}); {subject} final {c['subject_final_accuracy']:.3f}")
    lines.append(f"equal steps: worst {subject} - {c['best_peer']} gap {worst} over steps {c['steps_compared']} "
                 f"(goal: >= -2 points): {'met' if c['equal_steps_goal_met'] else 'NOT met'}")
    if c["time_ratio"] is not None:
        lines.append(f"time to {c['best_peer']}'s final accuracy: {subject} {c['subject_seconds_to_target']:.0f} s, "
                     f"{c['best_peer']} {c['best_peer_seconds_to_target']:.0f} s, ratio {c['time_ratio']:.2f} "
                     f"(goal: <= 0.5): {'met' if c['time_goal_met'] else 'NOT met'}")
    else:
        lines.append(f"time: {subject} did not reach {c['best_peer']}'s final accuracy: goal NOT met")
    return "\n".join(lines)


def plot(curve: dict[str, list[dict]], out: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for framework, points in curve.items():
        acc = [100 * p["accuracy"] for p in points]
        low = [100 * p["ci95"][0] for p in points]
        high = [100 * p["ci95"][1] for p in points]
        for ax, xs in ((by_step, [p["step"] for p in points]), (by_time, [p["t_s"] for p in points])):
            line, = ax.plot(xs, acc, marker="o", label=framework)
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.12, linewidth=0)
    by_step.set_xlabel("optimizer step")
    by_time.set_xlabel("wall-clock seconds from the framework's start (checkpoint saved)")
    by_step.set_ylabel("held-out pass@1, greedy (%) - shaded: 95% interval")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("results", help="learn_peers.py's results.json (or run_items.py's, with a job L item)")
    p.add_argument("--out", default="", help="PNG path (default: learning-L.png beside the results)")
    args = p.parse_args(argv)
    path = pathlib.Path(args.results)
    data = json.loads(path.read_text())
    learn = data if "evaluation" in data else next((i for i in data.get("items", []) if "evaluation" in i), None)
    if learn is None or not learn["evaluation"].get("scores"):
        print(f"learn_report.py: {path} holds no job L evaluation", file=sys.stderr)
        return 1
    curve = curves(learn["evaluation"]["scores"])
    print(table(curve, compare(curve)))
    out = pathlib.Path(args.out) if args.out else path.parent / "learning-L.png"
    plot(curve, out, f"job L: {learn.get('model_name', 'model')}, {learn.get('date_utc', '')}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
