"""Soak: a long GRPO run of the tiny model over the real services (local placement, CPU) with a
random service killed (`kill -9`) every few steps, watched from outside the whole time.

    python bench/soak.py [--steps 300] [--kill_every 5] [--seed 0] [--out runs/soak]

First the same run without faults (the baseline, same seed), then the soak run: every
--kill_every steps one of rollout-0, rollout-1, reward-ref-0 and learner, drawn with --seed, is
killed during a drawn phase (generate, score, train) of that step (tests/chaos/harness.py plans and
lands the kills). While it runs, a sampler reads /proc every --sample_s seconds: each service's
resident memory (its process and its children), open file descriptors and listening TCP ports, and
the checkpoint folder's size on disk. After the run it checks:

- every step is in metrics.jsonl exactly once, and each step.done of the run's log names a step once
  per time it was trained (a learner death redoes at most the step under way, counted apart);
- the per-step metrics (samples, rewards, losses, grad norms, pushed bytes) and the exported model
  equal the baseline's;
- memory: per service, the median RSS of the last tenth of the run is within --max_growth of the
  median just after warm-up (--warmup_steps);
- the checkpoint folder never holds more than --max_ckpt_num complete checkpoints plus the one being
  written, and its size at the end is within --max_growth of its size after warm-up;
- no process of the run is left once the coordinator exited.

It writes OUT/results.json and prints a short table; the exit code is 0 when every check holds.
Ray placement, with node losses in the same long run: bench/soak_ray.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import statistics
import sys
import threading
import time

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(__file__).resolve().parents[1] / "protos")]

import psutil  # noqa: E402

from services.common.tiny import make_data, make_tiny_model  # noqa: E402
from tests.chaos import harness  # noqa: E402
from tests.chaos.harness import Kill, differences, grpo_argv, model_difference, run_trial  # noqa: E402

SERVICES = ("rollout-0", "rollout-1", "reward-ref-0", "learner")
PHASES = ("generate", "score", "train")
READY = re.compile(r"--ready_file\s+\S*/(?:logs/([\w-]+)\.ready\.json|control\.json)")


def _alive_pid_of(run_dir: pathlib.Path, service: str, timeout_s: float = 600.0) -> int:
    """harness._pid_of, but a service killed a few steps ago may not be back yet (its ready file still
    names the dead process): waits until the file names a running process, then kills that one."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid = _pid_of(run_dir, service)
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return pid
        except (OSError, ValueError, psutil.Error):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{service}: no running process within {timeout_s} s")
        time.sleep(0.1)


_pid_of = harness._pid_of


def run_processes(out: pathlib.Path) -> dict[str, list[psutil.Process]]:
    """The run's processes by name (the coordinator as "coordinator"; a service by its ready file under
    out/run/logs), each with its children (a learner's other ranks, an engine's worker)."""
    roots: dict[int, tuple[str, psutil.Process]] = {}
    prefix = str(out)
    for p in psutil.process_iter(["cmdline"]):
        try:
            line = " ".join(p.info["cmdline"] or ())
            match = READY.search(line) if prefix in line else None
            if match and p.status() != psutil.STATUS_ZOMBIE:
                roots[p.pid] = (match.group(1) or "coordinator", p)
        except psutil.Error:
            continue
    found: dict[str, list[psutil.Process]] = {}
    for name, root in roots.values():
        procs, todo = [root], [root]
        while todo:  # descendants, but not another named process (the coordinator's services) or its own
            try:
                children = [c for c in todo.pop().children() if c.pid not in roots]
            except psutil.Error:
                continue
            procs += children
            todo += children
        found.setdefault(name, []).extend(procs)
    return found


def _dir_bytes(path: pathlib.Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


class Sampler(threading.Thread):
    """Every interval_s: per name, RSS (MiB), open fds and listening ports summed over its processes;
    the checkpoint folder's bytes and complete checkpoints; the steps recorded so far. `find`: the
    processes by name (default: run_processes, local placement)."""

    def __init__(self, out: pathlib.Path, interval_s: float, find=None):
        super().__init__(daemon=True)
        self.out, self.interval_s, self.samples, self.stop = out, interval_s, [], threading.Event()
        self.find = find or (lambda: run_processes(out))

    def run(self) -> None:
        t0 = time.monotonic()
        metrics, ckpt = self.out / "run" / "metrics.jsonl", self.out / "ckpt"
        while not self.stop.is_set():
            listening: dict[int, set[int]] = {}
            try:
                for c in psutil.net_connections("tcp"):
                    if c.status == psutil.CONN_LISTEN and c.pid:
                        listening.setdefault(c.pid, set()).add(c.laddr.port)
            except psutil.Error:
                pass
            services = {}
            for name, procs in self.find().items():
                rss, fds, ports = 0, 0, set()
                for p in procs:
                    try:
                        rss += p.memory_info().rss
                        fds += p.num_fds()
                        ports |= listening.get(p.pid, set())
                    except psutil.Error:
                        continue
                services[name] = {"rss_mb": round(rss / 2**20, 1), "fds": fds, "ports": len(ports),
                                  "pids": sorted(p.pid for p in procs)}
            try:
                steps = sum(1 for line in metrics.read_text().splitlines() if line.strip())
            except OSError:
                steps = 0
            folders = list(ckpt.glob("global_step_*")) if ckpt.is_dir() else []
            self.samples.append({"t_s": round(time.monotonic() - t0, 1), "steps": steps, "services": services,
                                 "ckpt_bytes": _dir_bytes(ckpt) if ckpt.is_dir() else 0,
                                 "ckpt_folders": len(folders),
                                 "ckpt_complete": sum((f / "learner.json").is_file() for f in folders)})
            self.stop.wait(self.interval_s)


def series_summary(samples: list[dict], key, warmup_steps: int, steps: int) -> dict:
    """start (first sample), after warm-up (median of the samples in the tenth of the run after
    warm-up), end (median of the samples of the last tenth of the steps, before the last step's
    record), max, and growth = end / after warm-up - 1."""
    points = [(s["steps"], v) for s in samples if (v := key(s)) is not None]
    if not points:
        return {}
    tenth = max(steps // 10, 1)
    warm = [v for n, v in points if warmup_steps <= n <= warmup_steps + tenth] or [points[len(points) // 2][1]]
    # Up to the last step's record: after it the run exports the model and its processes stop.
    end = [v for n, v in points if steps - tenth <= n < steps] or [v for n, v in points if n < steps][-1:] or [points[-1][1]]
    after, last = statistics.median(warm), statistics.median(end)
    return {"start": points[0][1], "after_warmup": after, "end": last, "max": max(v for _, v in points),
            "growth": round(last / after - 1, 4) if after else None}


def settled(samples: list[dict], settle_s: float) -> list[dict]:
    """The samples with, per name, only processes alive for settle_s or more (the same pids as
    settle_s before): a service restarted a moment ago is still loading, not in its steady state."""
    since: dict[str, tuple[tuple, float]] = {}
    kept = []
    for s in samples:
        services = {}
        for name, x in s["services"].items():
            pids = tuple(x["pids"])
            if since.get(name, ((), 0.0))[0] != pids:
                since[name] = (pids, s["t_s"])
            if s["t_s"] - since[name][1] >= settle_s:
                services[name] = x
        kept.append({**s, "services": services})
    return kept


def resources(samples: list[dict], warmup: int, steps: int, settle_s: float) -> tuple[dict, dict, dict, dict]:
    """Per process name: RSS, fds and listening ports over the run (settled samples); the checkpoint folder."""
    calm = settled(samples, settle_s)
    names = sorted({n for s in samples for n in s["services"]})
    per = {key: {n: series_summary(calm, lambda s, n=n, key=key: s["services"].get(n, {}).get(key), warmup, steps)
                 for n in names} for key in ("rss_mb", "fds", "ports")}
    disk = series_summary(samples, lambda s: s["ckpt_bytes"], warmup, steps)
    disk["max_complete_checkpoints"] = max((s["ckpt_complete"] for s in samples), default=0)
    disk["max_folders"] = max((s["ckpt_folders"] for s in samples), default=0)
    return per["rss_mb"], per["fds"], per["ports"], disk


def resource_checks(memory: dict, fds: dict, ports: dict, disk: dict, max_growth: float, max_ckpt_num: int) -> dict:
    grows = lambda x: x.get("growth") is not None and x["growth"] <= max_growth  # noqa: E731
    return {"memory_within_growth": all(grows(m) for m in memory.values()),
            "fds_within_growth": all(grows(f) for f in fds.values()),
            # A leak grows; a service restarted elsewhere may hold fewer (no weight-group store open).
            "ports_not_growing": all(p.get("end", 0) <= p.get("after_warmup", 0) for p in ports.values()),
            "pruning_holds": disk["max_complete_checkpoints"] <= max_ckpt_num + 1
                             and disk.get("final_folders", 0) <= max_ckpt_num and (disk.get("growth") or 0) <= max_growth}


def reanalyse(path: pathlib.Path, settle_s: float) -> int:
    """Recomputes the resource figures and checks of a results file from its samples."""
    r = json.loads(path.read_text())
    a = r["args"]
    final = r["checkpoint_disk"].get("final_folders", 0)
    # A run stopped early: its last tenth is that of the steps it recorded.
    r["memory_mb"], r["fds"], r["listening_ports"], r["checkpoint_disk"] = resources(
        r["samples"], r["warmup_steps"], min(a["steps"], r["steps"]["recorded"]), settle_s)
    r["checkpoint_disk"]["final_folders"] = final
    r["args"]["settle_s"] = settle_s
    r["checks"].update(resource_checks(r["memory_mb"], r["fds"], r["listening_ports"], r["checkpoint_disk"],
                                       a["max_growth"], a["max_ckpt_num"]))
    path.write_text(json.dumps(r, indent=1))
    print(table(r))
    return 0 if all(r["checks"].values()) else 1


def leftovers(out: pathlib.Path, timeout_s: float = 30.0) -> list[str]:
    """Processes of the run still there timeout_s after the coordinator exited (none expected)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = run_processes(out)
        if not left or time.monotonic() > deadline:
            return [f"{name} pid {p.pid}" for name, procs in left.items() for p in procs]
        time.sleep(0.5)


def exactly_once(trial) -> dict:
    steps = trial.steps
    done = [int(m) for m in re.findall(r"step\.done step=(\d+)", trial.log)]
    redone = trial.redone_steps
    return {"recorded": len(steps), "distinct": len(set(steps)), "in_order": steps == sorted(steps),
            "missing": sorted(set(range(1, max(steps, default=0) + 1)) - set(steps)),
            "duplicates": sorted({s for s in steps if steps.count(s) > 1}),
            "step_done_lines": len(done), "redone_steps": redone}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill_every", type=int, default=5, help="one kill per this many steps, from this step on")
    parser.add_argument("--seed", type=int, default=0, help="draws the kills (the run's own seed is 0 in both runs)")
    parser.add_argument("--warmup_steps", type=int, default=None, help="default: a tenth of --steps, at least 3")
    parser.add_argument("--max_growth", type=float, default=0.10)
    parser.add_argument("--max_ckpt_num", type=int, default=2)
    parser.add_argument("--sample_s", type=float, default=2.0)
    parser.add_argument("--max_restarts", type=int, default=1000, help="per service instance")
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--timeout_s", type=float, default=7200.0, help="per run")
    parser.add_argument("--settle_s", type=float, default=30.0,
                        help="a process's samples count from this many seconds after it appeared (a restarted service loads first)")
    parser.add_argument("--reanalyse", metavar="RESULTS_JSON", help="only recompute the resource figures of a results file")
    args = parser.parse_args(argv)
    if args.reanalyse:
        return reanalyse(pathlib.Path(args.reanalyse), args.settle_s)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(args.steps // 10, 3)
    root = pathlib.Path(args.out).resolve()
    shutil.rmtree(root, ignore_errors=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / "torch_extensions"))
    model, data = make_tiny_model(root / "model", seed=0), make_data(root / "data", seed=0)
    # grpo_argv takes 8 prompts a step: the tiny data's 2,000 training prompts are 250 steps a pass.
    passes = -(-args.steps * 8 // sum(1 for _ in open(data / "arith_train.jsonl")))
    extra = ["--max_ckpt_num", str(args.max_ckpt_num), "--max_restarts", str(args.max_restarts),
             "--num_episodes", str(passes)]
    t0 = time.time()

    base_out = root / "baseline"
    base = run_trial(grpo_argv(model, data, base_out, 2, args.steps, "hf", *extra), base_out, timeout_s=args.timeout_s)
    print(f"baseline: exit {base.returncode}, {len(base.steps)} steps in {base.seconds:.0f} s", flush=True)
    if base.returncode != 0:
        print(base.log[-4000:])
        return 1

    rng = random.Random(args.seed)
    kills = [Kill(rng.choice(SERVICES), rng.choice(PHASES), step, round(rng.uniform(0, 0.3), 2))
             for step in range(args.kill_every, args.steps, args.kill_every)]
    out = root / "soak"
    sampler = Sampler(out, args.sample_s)
    sampler.start()
    harness._pid_of = _alive_pid_of  # run_trial looks the name up at each kill
    try:
        trial = run_trial(grpo_argv(model, data, out, 2, args.steps, "hf", *extra), out, kills, timeout_s=args.timeout_s)
    finally:
        harness._pid_of = _pid_of
    left = leftovers(out)
    sampler.stop.set()
    sampler.join()
    print(f"soak: exit {trial.returncode}, {len(trial.steps)} steps in {trial.seconds:.0f} s, "
          f"{len(trial.killed_at_s)} of {len(kills)} kills landed", flush=True)

    diffs = differences(base, trial)
    model_diff = None
    if trial.returncode == 0 and (out / "model").is_dir() and (base_out / "model").is_dir():
        model_diff = model_difference(base_out / "model", out / "model")
    memory, fds, ports, disk = resources(sampler.samples, warmup, args.steps, args.settle_s)
    disk["final_folders"] = len(list((out / "ckpt").glob("global_step_*")))
    landed = [k.service for k, _ in zip(kills, trial.killed_at_s)]
    once = exactly_once(trial)
    deaths = {n: sum(e["event"] == "service.died" and e.get("service") == n for e in trial.events) for n in SERVICES}
    restarts = {n: sum(e["event"] == "service.restarted" and e.get("service") == n for e in trial.events) for n in SERVICES}
    checks = {
        "finished": trial.returncode == 0,
        "every_step_once": once["recorded"] == once["distinct"] == args.steps and once["in_order"],
        "every_kill_landed": len(trial.killed_at_s) == len(kills),
        "equal_to_fault_free": not diffs and model_diff is not None and model_diff < 1e-6,
        **resource_checks(memory, fds, ports, disk, args.max_growth, args.max_ckpt_num),
        "no_leftovers": not left,
    }
    results = {
        "command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "warmup_steps": warmup,
        "seconds": {"baseline": round(base.seconds, 1), "soak": round(trial.seconds, 1), "total": round(time.time() - t0, 1)},
        "steps": once, "kills_planned": len(kills), "kills_landed": len(trial.killed_at_s),
        "kills_by_service": {n: landed.count(n) for n in SERVICES}, "deaths": deaths, "restarts": restarts,
        "restart_s": sorted(e["since_death_s"] for e in trial.events if e["event"] == "service.restarted"),
        "differences": diffs[:20], "model_max_abs_difference": model_diff,
        "final_metrics": {"baseline": base.records[-1] if base.records else None,
                          "soak": trial.records[-1] if trial.records else None},
        "memory_mb": memory, "fds": fds, "listening_ports": ports, "checkpoint_disk": disk, "leftovers": left,
        "checks": checks, "samples": sampler.samples,
    }
    (root / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    if trial.returncode != 0:
        print(trial.log[-3000:])
    return 0 if all(checks.values()) else 1


def table(r: dict) -> str:
    s = r["steps"]
    lines = [f"steps: {s['recorded']} recorded, {s['distinct']} distinct, missing {s['missing'][:5]}, "
             f"duplicates {s['duplicates'][:5]}; learner rewinds redid {s['redone_steps']} step(s)",
             f"kills: {r['kills_landed']}/{r['kills_planned']} landed {r['kills_by_service']}; "
             f"restarts {r['restarts']}",
             f"vs fault-free: {len(r['differences'])} differing metric(s), model max |diff| {r['model_max_abs_difference']}",
             f"{'process':<14} {'RSS MiB start':>13} {'after warm-up':>13} {'end':>8} {'growth':>7}  "
             f"{'fds warm/end':>12}  {'ports warm/end':>14}"]
    for n, m in r["memory_mb"].items():
        f, p = r["fds"][n], r["listening_ports"][n]
        if not m:
            lines.append(f"{n:<14} (no settled sample)")
            continue
        lines.append(f"{n:<14} {m['start']:>13.0f} {m['after_warmup']:>13.0f} {m['end']:>8.0f} {m['growth']:>+7.1%}  "
                     f"{'%.0f/%.0f' % (f['after_warmup'], f['end']):>12}  {'%.0f/%.0f' % (p['after_warmup'], p['end']):>14}")
    d = r["checkpoint_disk"]
    lines.append(f"checkpoints: {d['after_warmup'] / 2**20:.1f} MiB after warm-up, {d['end'] / 2**20:.1f} MiB at the end, "
                 f"max {d['max'] / 2**20:.1f} MiB; at most {d['max_complete_checkpoints']} complete, "
                 f"{d['final_folders']} folder(s) at the end")
    lines.append(f"left behind: {r['leftovers'] or 'none'}")
    lines.append("checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r["checks"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
