"""GPU busy and memory over time, one panel per framework, from a vs_peers.py results.json:

    python3 bench/gpu/plot_timeline.py /tmp/logs/results.json --job B --out timeline-B.png

nvidia-smi's utilization.gpu (the share of time a kernel ran, sampled every 0.2 s) and memory.used
over each run, the step ends as dashed lines, and for rlmesh its phases (generate, score, train,
push, the learner's offload, ...) as shaded spans, placed as vs_peers.py's rlmesh_timeline places
them. Steps 2..N are the measured ones; the spans start after step 1.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

# one colour per rlmesh phase (vs_peers.rlmesh_phases' names); phases not listed are grey
PHASE_COLOURS = {"generate": "tab:blue", "rollout_sleep": "tab:cyan", "learner_reload": "tab:olive",
                 "score": "tab:orange", "logprobs": "gold", "advantages": "tab:pink", "train": "tab:green",
                 "push": "tab:red", "learner_offload": "tab:purple", "between": "lightgrey"}


def runs_of(results: dict, job: str) -> list[dict]:
    """The job's runs that have a GPU trace, in the order they ran."""
    runs = [r for r in results.get("results", []) if r.get("job") == job and r.get("gpu_trace")]
    if not runs:
        raise SystemExit(f"results.json has no run of job {job} with a gpu_trace (vs_peers.py records one per run "
                         "on a machine with nvidia-smi)")
    for r in runs:
        if len(r["gpu_trace"][0]) < 3:
            raise SystemExit(f"job {job} {r['framework']}: gpu_trace has no memory column (written by an older "
                             "vs_peers.py): run the benchmark again")
    return runs


def plot(results: dict, job: str, out: pathlib.Path) -> list[str]:
    """Writes the figure; returns the phases drawn for rlmesh (empty without an rlmesh run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    runs = runs_of(results, job)
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.6 * len(runs)), squeeze=False)
    drawn: list[str] = []
    for ax, run in zip(axes[:, 0], runs):
        t, util, mem = zip(*run["gpu_trace"])
        ax.plot(t, util, color="black", linewidth=0.7, label="GPU busy %")
        ax.set_ylim(0, 105)
        ax.set_ylabel("busy %")
        mem_ax = ax.twinx()
        mem_ax.plot(t, mem, color="tab:brown", linewidth=1.2, label="memory GiB")
        mem_ax.set_ylabel("GiB")
        mem_ax.set_ylim(0, max(mem) * 1.1 + 1)
        for step in run.get("steps", []):
            ax.axvline(step["t_end"], color="grey", linestyle="--", linewidth=0.8)
        for phase, t0, t1 in (run.get("rlmesh_timeline") or {}).get("windows", []):
            if t1 > t0:
                ax.axvspan(t0, t1, color=PHASE_COLOURS.get(phase, "grey"), alpha=0.3, linewidth=0)
                if phase not in drawn:
                    drawn.append(phase)
        step_s = run.get("step_median_s")
        title = f"job {job}: {run['framework']}" + (f", {step_s:.2f} s/step" if step_s else "")
        if run.get("gpu_busy") is not None:
            title += f", {run['gpu_busy']:.0%} busy over steps 2..N"
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, t[-1])
    axes[-1, 0].set_xlabel("seconds from the run's start (dashed: step ends)")
    handles = [Line2D([], [], color="black", linewidth=0.7, label="GPU busy %"),
               Line2D([], [], color="tab:brown", linewidth=1.2, label="memory used GiB")]
    handles += [Patch(color=PHASE_COLOURS.get(p, "grey"), alpha=0.3, label=f"rlmesh {p}") for p in drawn]
    columns = min(len(handles), 6)
    fig.legend(handles=handles, loc="lower center", fontsize=8, ncol=columns, frameon=False)
    legend_inches = 0.1 + 0.2 * -(-len(handles) // columns)  # its rows of entries, under the x label
    fig.tight_layout(rect=(0, legend_inches / fig.get_figheight(), 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("results", help="vs_peers.py's results.json")
    p.add_argument("--job", default="A", choices=["A", "B"])
    p.add_argument("--out", default="", help="PNG path (default: timeline-<job>.png beside results.json)")
    args = p.parse_args(argv)
    path = pathlib.Path(args.results)
    out = pathlib.Path(args.out) if args.out else path.parent / f"timeline-{args.job}.png"
    drawn = plot(json.loads(path.read_text()), args.job, out)
    print(f"wrote {out}" + (f" (rlmesh phases: {', '.join(drawn)})" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
