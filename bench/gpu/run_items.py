"""Several benchmark items in one detached run on one GPU machine, with ONE results file:

    python3 bench/gpu/run_items.py --out /tmp/logs/run --item L:rlmesh,openrlhf,trl --item A:rlmesh,openrlhf
    python3 bench/gpu/run_items.py --plan --item L:rlmesh,openrlhf,trl --item A:rlmesh,openrlhf   # plan only

An item is JOB:FRAMEWORK[,FRAMEWORK...]. Jobs A and B (step time) run bench/gpu/vs_peers.py, job L
(learning) bench/gpu/learn_peers.py, one child process per item, in the order given; the frameworks
of an item run in the order given. Before anything starts the runner prints its plan from the
per-framework estimates in bench/gpu/estimates.json (build + start-up + steps x s/step + teardown,
and job L's evaluation) and warns when the plan cannot fit the 30 minutes one GPU machine is held
(less the staging) or --budget_s. Run it with --plan here first, before staging anything.

--out gets: results.json (every item's results in one file, rewritten after each item), plan.txt,
each item's folder (N-JOB/: its logs, its own results.json and table.txt), the PNGs (timeline-N-JOB.png
for A and B, learning-N-L.png for L) and estimates-measured.json (the start-ups and s/step this run
measured, in estimates.json's shape). $RLMESH_COMMIT names the commit of the code (stage_peers.sh
sets it; the copy on the GPU machine has no .git).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from peer_run import commit_id

HERE = pathlib.Path(__file__).resolve().parent
JOB_SCRIPTS = {"A": "vs_peers.py", "B": "vs_peers.py", "L": "learn_peers.py"}
FRAMEWORKS = ("rlmesh", "openrlhf", "trl", "verl")
DEFAULT_STEPS = {"A": 4, "B": 4, "L": 20}
DEFAULT_EVAL_EVERY = 4


@dataclass(frozen=True)
class Item:
    job: str
    frameworks: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.job}:{','.join(self.frameworks)}"


def parse_item(text: str) -> Item:
    job, sep, names = text.partition(":")
    frameworks = tuple(n.strip() for n in names.split(",") if n.strip())
    if not sep or job not in JOB_SCRIPTS or not frameworks:
        raise argparse.ArgumentTypeError(f"{text!r}: write JOB:FRAMEWORK[,FRAMEWORK...] with JOB one of "
                                         f"{', '.join(JOB_SCRIPTS)}, e.g. L:rlmesh,openrlhf,trl")
    unknown = [n for n in frameworks if n not in FRAMEWORKS]
    if unknown or len(set(frameworks)) != len(frameworks):
        raise argparse.ArgumentTypeError(f"{text!r}: frameworks are {', '.join(FRAMEWORKS)}, each once "
                                         f"(unknown: {', '.join(unknown) or 'none'})")
    return Item(job, frameworks)


def parse_per_job(values: list[str], flag: str, kind=int) -> dict[str, object]:
    """["L=20", "A=3"] -> {"L": 20, "A": 3}; SystemExit naming the flag when one is malformed."""
    out = {}
    for value in values:
        job, sep, rest = value.partition("=")
        if not sep or job not in JOB_SCRIPTS:
            raise SystemExit(f"run_items: {flag} {value!r}: write JOB=VALUE with JOB one of {', '.join(JOB_SCRIPTS)}")
        try:
            out[job] = kind(rest)
        except ValueError:
            raise SystemExit(f"run_items: {flag} {value!r}: {rest!r} is not a {kind.__name__}") from None
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--item", type=parse_item, action="append", required=True,
                   help="JOB:FRAMEWORK[,FRAMEWORK...], repeated; run in the order given")
    p.add_argument("--steps", action="append", default=[], metavar="JOB=N",
                   help=f"optimizer steps per framework run of a job (defaults: {DEFAULT_STEPS})")
    p.add_argument("--eval_every", type=int, default=DEFAULT_EVAL_EVERY,
                   help="job L: a checkpoint and a held-out score every N steps (a divisor of its steps)")
    p.add_argument("--timeout_s", type=float, default=0.0,
                   help="wall-clock limit of ONE framework's run (its start-up, steps and saves), for every run; "
                        "a run past it is stopped and reported. 0 = per item, 1.5 x the slowest framework's "
                        "estimate + 60 s. Not included: the item's build, the ~40 s teardown after each run, job "
                        "L's evaluation")
    p.add_argument("--budget_s", type=float, default=0.0,
                   help="wall-clock limit of this whole detached run: builds, framework runs, teardowns and "
                        "evaluations. An item gets what is left less its build, teardowns and evaluation (as "
                        "estimated); one that would get under 60 s is reported as not run. 0 = the lease "
                        "(estimates.json: lease_s - staging_s - poll_margin_s)")
    p.add_argument("--args", action="append", default=[], metavar="JOB=OPTIONS",
                   help="more options for a job's script, one quoted string, e.g. L='--learning_rate 3e-6' or "
                        "A='--rlmesh_engines 1'")
    p.add_argument("--out", default="/tmp/logs/run", help="the run's folder (small files: bring it back as one tarball)")
    p.add_argument("--scratch", default="/tmp/vs_peers_scratch", help="models, data and checkpoints (GBs)")
    p.add_argument("--estimates", default=str(HERE / "estimates.json"), help="the per-framework estimates (JSON)")
    p.add_argument("--plan", action="store_true", help="print the plan and its warnings, run nothing")
    p.add_argument("--dry_run", action="store_true", help="each item builds its inputs and writes its commands only")
    args = p.parse_args(argv)
    args.steps = {**DEFAULT_STEPS, **parse_per_job(args.steps, "--steps")}
    args.args = parse_per_job(args.args, "--args", str)
    for item in args.item:
        if item.job == "L" and args.steps["L"] % args.eval_every:
            p.error(f"--steps L={args.steps['L']} must be a multiple of --eval_every {args.eval_every}")
    return args


# ----------------------------------------------------------------------------------------------
# The plan


def framework_estimate(estimates: dict, job: str, framework: str, steps: int) -> float:
    e = estimates["frameworks"][job][framework]
    return e["startup_s"] + steps * e["step_s"]


def item_reserve_s(item: Item, estimates: dict, steps: int, eval_every: int) -> float:
    """What an item needs beside its framework runs: its build, a teardown per run, job L's evaluation."""
    reserve = estimates["build_s"][item.job] + estimates["teardown_s"] * len(item.frameworks)
    if item.job == "L":
        reserve += estimates["eval_start_s"] + estimates["eval_per_checkpoint_s"] * (
            1 + len(item.frameworks) * (steps // eval_every))
    return reserve


def item_timeout_s(item: Item, estimates: dict, steps: int) -> float:
    return 1.5 * max(framework_estimate(estimates, item.job, f, steps) for f in item.frameworks) + 60


def available_s(estimates: dict) -> float:
    return estimates["lease_s"] - estimates["staging_s"] - estimates["poll_margin_s"]


def plan(items: list[Item], estimates: dict, steps: dict[str, int], eval_every: int) -> list[dict]:
    rows = []
    for i, item in enumerate(items):
        n = steps[item.job]
        runs = {f: framework_estimate(estimates, item.job, f, n) for f in item.frameworks}
        rows.append({"index": i, "item": str(item), "steps": n, "runs_s": runs,
                     "reserve_s": item_reserve_s(item, estimates, n, eval_every),
                     "total_s": sum(runs.values()) + item_reserve_s(item, estimates, n, eval_every),
                     "sources": {f: estimates["frameworks"][item.job][f]["source"] for f in item.frameworks}})
    return rows


def plan_text(rows: list[dict], budget_s: float, estimates: dict) -> tuple[str, list[str]]:
    """The plan as lines, and its warnings."""
    lines, warnings, t = [], [], 0.0
    for row in rows:
        runs = ", ".join(f"{f} {s:.0f} s" for f, s in row["runs_s"].items())
        t += row["total_s"]
        lines.append(f"item {row['index']} {row['item']} ({row['steps']} steps): {row['total_s']:.0f} s = runs [{runs}] "
                     f"+ build, teardowns{', evaluation' if row['item'].startswith('L') else ''} "
                     f"{row['reserve_s']:.0f} s; ends at ~{t:.0f} s ({t / 60:.1f} min)")
        guessed = [f for f, source in row["sources"].items() if "guess" in source]
        if guessed:
            lines.append(f"  (estimates partly guessed for {', '.join(guessed)}: see estimates.json)")
    room = available_s(estimates)
    if t > room:
        warnings.append(f"WARNING: the plan takes ~{t / 60:.1f} min; one GPU machine is held {estimates['lease_s'] / 60:.0f} "
                        f"min, of which ~{room / 60:.1f} min are left after staging and polls: the last items will "
                        "not run. Fewer steps or items, or a lease of their own.")
    if budget_s and t > budget_s:
        warnings.append(f"WARNING: the plan takes ~{t:.0f} s, more than --budget_s {budget_s:.0f}: items past the "
                        "budget are reported as not run")
    return "\n".join(lines), warnings


# ----------------------------------------------------------------------------------------------
# Running the items


def item_command(item: Item, args, out: pathlib.Path, scratch: pathlib.Path, budget_s: float,
                 timeout_s: float) -> list[str]:
    cmd = [sys.executable, str(HERE / JOB_SCRIPTS[item.job]), "--frameworks", *item.frameworks,
           "--steps", str(args.steps[item.job]), "--budget_s", f"{budget_s:.0f}", "--out", str(out),
           "--scratch", str(scratch)]
    if item.job == "L":
        cmd += ["--eval_every", str(args.eval_every), "--timeout_s", f"{timeout_s:.0f}"]
    else:
        cmd += ["--jobs", item.job, "--timeout_s", f"{timeout_s:.0f}", f"{timeout_s:.0f}"]
    if args.dry_run:
        cmd.append("--dry_run")
    return cmd + shlex.split(args.args.get(item.job, ""))


def measured(item_results: list[dict], date: str) -> dict:
    """{job: {framework: {"startup_s", "step_s", "source"}}} from the runs that logged 2+ steps."""
    out: dict[str, dict] = {}
    for r in item_results:
        stats = r.get("step_stats") or {}
        if not stats or not r.get("steps"):
            continue
        startup = r.get("startup_s", max(r["steps"][0]["t_end"] - stats["median"], 0.0))
        out.setdefault(r["job"], {})[r["framework"]] = {"startup_s": round(startup, 1), "step_s": round(stats["median"], 2),
                                                        "source": f"{date} (run_items.py)"}
    return out


def draw(item: Item, folder: pathlib.Path, out: pathlib.Path, label: str) -> None:
    """The item's PNG next to results.json (best effort: a plot that fails does not lose the run)."""
    if item.job == "L":
        if (folder / "learning-L.png").exists():
            shutil.copyfile(folder / "learning-L.png", out / f"learning-{label}.png")
        return
    subprocess.run([sys.executable, str(HERE / "plot_timeline.py"), str(folder / "results.json"), "--job", item.job,
                    "--out", str(out / f"timeline-{label}.png")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(args, estimates: dict, rows: list[dict]) -> dict:
    out, scratch = pathlib.Path(args.out).resolve(), pathlib.Path(args.scratch).resolve()
    budget = args.budget_s or available_s(estimates)
    report = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "commit": commit_id(), "budget_s": budget, "plan": rows, "items": []}
    t0 = time.monotonic()
    for i, item in enumerate(args.item):
        label = f"{i}-{item.job}"
        steps = args.steps[item.job]
        reserve = item_reserve_s(item, estimates, steps, args.eval_every)
        item_budget = budget - (time.monotonic() - t0) - reserve
        entry = {"item": str(item), "job": item.job, "folder": label}
        if item_budget < 60:
            entry["error"] = f"not run: {item_budget + reserve:.0f} s of --budget_s left, {reserve:.0f} s needed besides its runs"
        else:
            timeout = args.timeout_s or item_timeout_s(item, estimates, steps)
            cmd = item_command(item, args, out / label, scratch / label, item_budget, timeout)
            print(f"=== item {label} {item}: budget {item_budget:.0f} s, {timeout:.0f} s per framework run ===", flush=True)
            t1 = time.monotonic()
            with (out / f"{label}.out").open("w") as f:
                done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
            entry.update(command=cmd, returncode=done.returncode, wall_s=round(time.monotonic() - t1, 1))
            item_results = out / label / "results.json"
            if item_results.exists():
                entry.update(json.loads(item_results.read_text()))
            if done.returncode != 0:
                entry["error"] = f"exit code {done.returncode} (see {label}.out)"
            if not args.dry_run:
                draw(item, out / label, out, label)
        report["items"].append(entry)
        report["measured"] = measured([r for e in report["items"] for r in e.get("results", [])], report["date_utc"])
        (out / "results.json").write_text(json.dumps(report, indent=1))
        (out / "estimates-measured.json").write_text(json.dumps(report["measured"], indent=1))
    report["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    estimates = json.loads(pathlib.Path(args.estimates).read_text())
    missing = [f"{item.job}:{f}" for item in args.item for f in item.frameworks
               if f not in estimates["frameworks"].get(item.job, {})]
    if missing:
        raise SystemExit(f"run_items: {args.estimates} has no estimate for {', '.join(missing)}")
    rows = plan(args.item, estimates, args.steps, args.eval_every)
    text, warnings = plan_text(rows, args.budget_s, estimates)
    print(text + ("\n" + "\n".join(warnings) if warnings else ""), flush=True)
    if args.plan:
        return 0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.txt").write_text(text + "\n" + "\n".join(warnings) + "\n")
    report = run(args, estimates, rows)
    for entry in report["items"]:
        print(f"item {entry['folder']} {entry['item']}: " + (entry.get("error") or "done"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
