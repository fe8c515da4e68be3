"""How much a step time moves: within one run (mean, median, min-max over the measured steps) and
across leases (the runs of the same job and framework in several results files).

    python3 bench/gpu/spread.py lease1/results.json lease2/results.json [--job A] [--framework rlmesh]

vs_peers.py keeps every measured step's time (`step_s`, steps 2..N) and each phase's per step
(`phases_s`) in its results; run_items.py gathers several items' results into one file of the same
shape. This script reads any number of those files and prints, per job and framework, each lease's
median (min-max) and, over the leases, the median of their medians and its range: a figure measured
on one lease only says so.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys


def spread(values: list[float]) -> dict:
    """{"n", "mean", "median", "min", "max"} of the values; {} for none."""
    if not values:
        return {}
    return {"n": len(values), "mean": statistics.fmean(values), "median": statistics.median(values),
            "min": min(values), "max": max(values)}


def runs_of(results: dict) -> list[dict]:
    """The framework runs of one results file, vs_peers.py's own ("results") or run_items.py's
    (its items, each holding vs_peers.py's "results" list)."""
    runs = list(results.get("results", []))
    for item in results.get("items", []):
        runs.extend(item.get("results", []))
    return [r for r in runs if r.get("step_s")]


def across_leases(files: list[dict], job: str = "", framework: str = "") -> dict[tuple[str, str], dict]:
    """(job, framework) -> {"leases": [{date, commit, spread of its steps}], "medians": spread of the
    leases' medians}. A file is one lease."""
    out: dict[tuple[str, str], dict] = {}
    for results in files:
        for run in runs_of(results):
            if (job and run["job"] != job) or (framework and run["framework"] != framework):
                continue
            entry = out.setdefault((run["job"], run["framework"]), {"leases": []})
            entry["leases"].append({"date": results.get("date_utc", "?"), "commit": results.get("commit", "?"),
                                    **spread(run["step_s"])})
    for entry in out.values():
        entry["medians"] = spread([lease["median"] for lease in entry["leases"]])
    return out


def report(table: dict[tuple[str, str], dict]) -> str:
    lines = []
    for (job, framework), entry in sorted(table.items()):
        lines.append(f"job {job}, {framework}:")
        for lease in entry["leases"]:
            lines.append(f"  {lease['date']} {str(lease['commit'])[:9]:<9}  median {lease['median']:.2f} s  mean "
                         f"{lease['mean']:.2f}  range {lease['min']:.2f}-{lease['max']:.2f}  ({lease['n']} steps)")
        m = entry["medians"]
        if m["n"] > 1:
            lines.append(f"  across {m['n']} leases: median of medians {m['median']:.2f} s, range "
                         f"{m['min']:.2f}-{m['max']:.2f} ({(m['max'] - m['min']) / m['median']:.0%} of the median)")
        else:
            lines.append("  one lease only: no spread across leases")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="results.json files of vs_peers.py or run_items.py, one per lease")
    p.add_argument("--job", default="", help="only this job (A, B)")
    p.add_argument("--framework", default="", help="only this framework")
    args = p.parse_args(argv)
    files = []
    for name in args.results:
        path = pathlib.Path(name)
        if not path.is_file():
            print(f"spread.py: {name}: no such file", file=sys.stderr)
            return 2
        files.append(json.loads(path.read_text()))
    table = across_leases(files, args.job, args.framework)
    if not table:
        print("spread.py: no run with measured steps in these files (for this job / framework)", file=sys.stderr)
        return 1
    print(report(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
