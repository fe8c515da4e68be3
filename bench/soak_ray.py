"""Soak in Ray placement: one long GRPO run of the tiny model on a local multi-node Ray cluster with a
random service killed every few steps AND nodes lost, in the same run, watched from outside.

    python bench/soak_ray.py [--steps 300] [--kill_every 5] [--node_kills 2] [--seed 0] [--out runs/soak-ray]

The cluster (services/coordinator/fleet/local_cluster.py: a head and worker nodes of one logical GPU
each, every node its own raylet on its own loopback address) runs bench/soak_nodes.py's job: the
learner, rollout-0 and rollout-1 on a node's GPU each, the rule reward (reward-0) on a CPU bundle, a
checkpoint every step, submitted with `ray job submit` as the multi-node guide does. The same run
without faults goes first, on the same cluster. Then the soak run:

- every --kill_every steps one of rollout-0, rollout-1, reward-0 and the learner, drawn with --seed,
  is SIGKILLed during a drawn phase (generate, score, train) of that step: the process that listens
  on the service's address in the coordinator's status, with its children (engine workers, ranks);
- --node_kills times, at steps spread over the run, a whole node is lost (raylet, agents, Ray workers
  and the services they started, all SIGKILLed): in turns the node of rollout-0 while it generates
  and the learner's node while it trains; spare nodes take the lost bundles.

While it runs a sampler reads /proc every --sample_s seconds: each service's resident memory (with
its children), open file descriptors and listening TCP ports, the coordinator's, and the checkpoint
folder's size. Afterwards it checks, as bench/soak.py does for local placement: every step in
metrics.jsonl exactly once, per-step metrics and the exported model equal to the fault-free run's,
memory and fds within --max_growth after warm-up, ports flat, checkpoint pruning, and no process of
the run or of the cluster left once it is down. It writes OUT/results.json, prints a table and exits 0
when every check holds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(__file__).resolve().parents[1] / "protos")]

import grpc  # noqa: E402
import psutil  # noqa: E402

from rlmesh.coordinator.v1 import coordinator_pb2 as pb  # noqa: E402
from rlmesh.coordinator.v1 import coordinator_pb2_grpc  # noqa: E402
from services.common.client import make_sync_channel  # noqa: E402
from services.common.security import ClientCredentials  # noqa: E402
from services.common.tiny import make_data, make_tiny_model  # noqa: E402
from tests.chaos.harness import PHASES, Trial, _read_jsonl, differences, model_difference  # noqa: E402
from tests.coordinator.test_ray_multinode import start_submit  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from soak import Sampler, exactly_once, resource_checks, resources, table  # noqa: E402
from soak_nodes import cluster_up, grpo_ray_argv, new_cluster, this_clusters  # noqa: E402

SERVICES = ("rollout-0", "rollout-1", "reward-0", "learner")
SERVICE_PHASES = ("generate", "score", "train")


@dataclasses.dataclass
class Fault:
    step: int  # the global step (1-based) during which it lands
    kind: str  # "service": the service's process; "node": the service's whole node
    target: str  # a name of SERVICES
    phase: str  # a key of PHASES
    delay_s: float = 0.0  # after the phase is seen


def plan(steps: int, kill_every: int, node_kills: int, seed: int) -> list[Fault]:
    """Service kills every kill_every steps (drawn with seed); node kills spread evenly over the run,
    each on a step of its own (the one after a service kill's step when they would coincide)."""
    rng = random.Random(seed)
    faults = [Fault(step, "service", rng.choice(SERVICES), rng.choice(SERVICE_PHASES), round(rng.uniform(0, 0.3), 2))
              for step in range(kill_every, steps, kill_every)] if kill_every > 0 else []
    for i in range(node_kills):
        step = max(2, round(steps * (i + 1) / (node_kills + 1)))
        while any(f.step == step for f in faults) and step < steps:
            step += 1
        target = "rollout-0" if i % 2 == 0 else "learner"
        faults.append(Fault(step, "node", target, "generate" if target == "rollout-0" else "train"))
    return sorted(faults, key=lambda f: f.step)


def service_name(s: pb.ServiceStatus) -> str:
    return "learner" if s.role == "learner" else f"{s.role}-{s.index}"


def listening_pids() -> dict[int, int]:
    """port -> pid of every listening TCP socket on the machine."""
    found = {}
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid:
            found.setdefault(c.laddr.port, c.pid)
    return found


class Control:
    """The run's control API (ready file OUT/control.json, token OUT/run/auth_token)."""

    def __init__(self, out: pathlib.Path, proc: subprocess.Popen, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not (out / "control.json").is_file() or not (out / "run" / "auth_token").is_file():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run in {out} did not open its control API")
            time.sleep(0.2)
        address = json.loads((out / "control.json").read_text())["address"]
        token = (out / "run" / "auth_token").read_text().strip()
        self.channel = make_sync_channel(address, credentials=ClientCredentials(token=token), default_timeout_s=30)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    def status(self) -> pb.GetStatusResponse | None:
        try:
            return self.stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        except grpc.RpcError:
            return None

    def close(self) -> None:
        self.channel.close()


def service_processes(status: pb.GetStatusResponse | None, coordinator: int | None) -> dict[str, list[psutil.Process]]:
    """Per service of the status (and "coordinator"): the process listening on its address's port and
    its descendants."""
    ports = listening_pids()
    roots = {service_name(s): ports.get(int(s.address.rpartition(":")[2])) for s in (status.services if status else ())
             if s.address and s.state not in ("dead", "lost", "starting")}
    if coordinator:
        roots["coordinator"] = coordinator
    found = {}
    for name, pid in roots.items():
        if not pid:
            continue
        try:
            root = psutil.Process(pid)
            found[name] = [root, *(c for c in root.children(recursive=True) if c.pid not in roots.values())]
        except psutil.Error:
            continue
    return found


def coordinator_pid(out: pathlib.Path) -> int | None:
    """The job's driver (train_ppo_ray), started by Ray's job supervisor: its command line names OUT."""
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or ())
        if "services.coordinator.train_ppo_ray" in line and str(out) in line and "job" not in line.split():
            return p.pid
    return None


class RayFinder:
    """Sampler's `find` for Ray placement: the processes come from the coordinator's status (the last
    one answered, while the control API does not answer)."""

    def __init__(self, out: pathlib.Path, control: Control):
        self.out, self.control, self.last_status = out, control, None

    def __call__(self) -> dict[str, list[psutil.Process]]:
        self.last_status = self.control.status() or self.last_status
        return service_processes(self.last_status, coordinator_pid(self.out))


def _wait_moment(control: Control, fault: Fault, proc: subprocess.Popen, deadline: float) -> pb.GetStatusResponse | None:
    """The status once step fault.step is in fault.phase (or already past it); None if the run ended."""
    while time.monotonic() < deadline and proc.poll() is None:
        status = control.status()
        if status is not None:
            if status.global_step + 1 >= fault.step and status.phase == PHASES[fault.phase]:
                return status
            if status.global_step >= fault.step:
                return status  # the phase passed between two polls: the kill lands later in the same run
        time.sleep(0.03)
    return None


def _serving_pid(control: Control, name: str, proc: subprocess.Popen, deadline: float) -> tuple[int, str] | None:
    """The pid listening on the service's address once it serves (a service killed a few steps ago may
    still be restarting), and its address."""
    while time.monotonic() < deadline and proc.poll() is None:
        status = control.status()
        for s in status.services if status else ():
            if service_name(s) == name and s.state == "serving" and s.address:
                pid = listening_pids().get(int(s.address.rpartition(":")[2]))
                if pid:
                    return pid, s.address
        time.sleep(0.1)
    return None


def run_job(cluster, argv: list[str], out: pathlib.Path, faults: list[Fault], timeout_s: float,
            sample_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    log, t0 = out / "submit.log", time.monotonic()
    deadline = t0 + timeout_s
    proc = start_submit(cluster, argv, log)
    control = Control(out, proc, 600)
    sampler = Sampler(out, sample_s, RayFinder(out, control))
    sampler.start()
    landed = []
    try:
        for fault in faults:
            if _wait_moment(control, fault, proc, deadline) is None:
                break
            time.sleep(fault.delay_s)
            found = _serving_pid(control, fault.target, proc, deadline)
            if found is None:
                break
            pid, address = found
            if fault.kind == "node":
                what = cluster.kill(address.rpartition(":")[0])
            else:
                what = 0
                for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                    with contextlib.suppress(psutil.Error, ProcessLookupError):
                        p.send_signal(signal.SIGKILL)
                        what += 1
            landed.append({**dataclasses.asdict(fault), "address": address, "processes": what,
                           "at_s": round(time.monotonic() - t0, 1), "unix_time": time.time()})
            print(f"  step {fault.step}: {fault.kind} of {fault.target} ({address}) killed in {fault.phase} "
                  f"({what} processes)", flush=True)
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        sampler.stop.set()
        sampler.join()
        control.close()
    records = _read_jsonl(out / "run" / "metrics.jsonl")
    for kill in landed:  # seconds from the kill to the next record of a step
        after = [r["unix_time"] for r in records if r.get("unix_time", 0) > kill["unix_time"]]
        kill["to_next_step_s"] = round(min(after) - kill["unix_time"], 1) if after else None
    return {"returncode": code, "seconds": round(time.monotonic() - t0, 1), "records": records,
            "events": _read_jsonl(out / "run" / "events.jsonl"), "kills": landed, "samples": sampler.samples,
            "log": log.read_text(errors="replace")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill_every", type=int, default=5, help="one service kill per this many steps, from this step on")
    parser.add_argument("--node_kills", type=int, default=2, help="nodes lost, at steps spread evenly over the run")
    parser.add_argument("--seed", type=int, default=0, help="draws the service kills (the run's own seed is 0 in both runs)")
    parser.add_argument("--spares", type=int, default=None, help="spare nodes; default: one per node kill and one more")
    parser.add_argument("--warmup_steps", type=int, default=None, help="default: a tenth of --steps, at least 3")
    parser.add_argument("--max_growth", type=float, default=0.10)
    parser.add_argument("--max_ckpt_num", type=int, default=2)
    parser.add_argument("--sample_s", type=float, default=2.0)
    parser.add_argument("--settle_s", type=float, default=30.0,
                        help="a process's samples count from this many seconds after it appeared (a restarted service loads first)")
    parser.add_argument("--out", default="runs/soak-ray")
    parser.add_argument("--timeout_s", type=float, default=7200.0, help="per run")
    args = parser.parse_args(argv)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(args.steps // 10, 3)
    root = pathlib.Path(args.out).resolve()
    shutil.rmtree(root, ignore_errors=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / "torch_extensions"))
    model, data = make_tiny_model(root / "model", seed=0), make_data(root / "data", seed=0)
    passes = -(-args.steps * 8 // sum(1 for _ in open(data / "arith_train.jsonl")))

    def job_argv(out: pathlib.Path) -> list[str]:
        job = grpo_ray_argv(model, data, out, args.steps)
        job[job.index("--max_restarts") + 1] = "1000"
        return [*job, "--max_ckpt_num", str(args.max_ckpt_num), "--num_episodes", str(passes)]

    faults = plan(args.steps, args.kill_every, args.node_kills, args.seed)
    cluster = new_cluster()
    workers = 3 + (args.spares if args.spares is not None else args.node_kills + 1)
    t0 = time.monotonic()
    ips: list[str] = []
    try:
        ips = cluster_up(cluster, workers)
        print(f"cluster of {len(ips)} nodes up in {time.monotonic() - t0:.0f} s", flush=True)
        base = run_job(cluster, job_argv(root / "baseline"), root / "baseline", [], args.timeout_s, args.sample_s)
        print(f"baseline: exit {base['returncode']}, {len(base['records'])} steps in {base['seconds']} s", flush=True)
        if base["returncode"] != 0:
            print(base["log"][-3000:])
            return 1
        soak = run_job(cluster, job_argv(root / "soak"), root / "soak", faults, args.timeout_s, args.sample_s)
        print(f"soak: exit {soak['returncode']}, {len(soak['records'])} steps in {soak['seconds']} s, "
              f"{len(soak['kills'])} of {len(faults)} kills landed", flush=True)
    finally:
        cluster.down()
    time.sleep(2)
    left = [f"pid {p.pid} {' '.join(p.cmdline()[:4])}" for p in psutil.process_iter()
            if _names_any(p, (root / "baseline", root / "soak"))]
    left += this_clusters(ips, cluster)
    shutil.rmtree(cluster.folder, ignore_errors=True)

    as_trial = lambda r: Trial([], r["returncode"], r["records"], r["events"], log=r["log"])  # noqa: E731
    trial = as_trial(soak)
    diffs = differences(as_trial(base), trial)
    model_diff = None
    if soak["returncode"] == 0 and (root / "soak" / "model").is_dir() and (root / "baseline" / "model").is_dir():
        model_diff = model_difference(root / "baseline" / "model", root / "soak" / "model")
    memory, fds, ports, disk = resources(soak["samples"], warmup, args.steps, args.settle_s)
    disk["final_folders"] = len(list((root / "soak" / "ckpt").glob("global_step_*")))
    once = exactly_once(trial)
    events = soak["events"]
    count = lambda kind, n: sum(e["event"] == kind and e.get("service") == n for e in events)  # noqa: E731
    checks = {
        "finished": soak["returncode"] == 0,
        "every_step_once": once["recorded"] == once["distinct"] == args.steps and once["in_order"],
        "every_kill_landed": len(soak["kills"]) == len(faults),
        "equal_to_fault_free": not diffs and model_diff is not None and model_diff < 1e-6,
        **resource_checks(memory, fds, ports, disk, args.max_growth, args.max_ckpt_num),
        "no_leftovers": not left,
    }
    results = {
        "command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "warmup_steps": warmup,
        "nodes": len(ips), "seconds": {"baseline": base["seconds"], "soak": soak["seconds"],
                                       "total": round(time.monotonic() - t0, 1)},
        "steps": once, "kills_planned": len(faults), "kills_landed": len(soak["kills"]), "kills": soak["kills"],
        "kills_by_service": {n: sum(k["target"] == n and k["kind"] == "service" for k in soak["kills"]) for n in SERVICES},
        "deaths": {n: count("service.died", n) for n in SERVICES},
        "restarts": {n: count("service.restarted", n) for n in SERVICES},
        "restart_s": sorted(e["since_death_s"] for e in events if e["event"] == "service.restarted"),
        "replaced": sorted({line.split("service=")[1].split()[0] for line in soak["log"].splitlines()
                            if "ray.actor_replaced service=" in line}),
        "differences": diffs[:20], "model_max_abs_difference": model_diff,
        "final_metrics": {"baseline": base["records"][-1] if base["records"] else None,
                          "soak": soak["records"][-1] if soak["records"] else None},
        "memory_mb": memory, "fds": fds, "listening_ports": ports, "checkpoint_disk": disk, "leftovers": left,
        "checks": checks, "samples": soak["samples"],
    }
    (root / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    for kill in soak["kills"]:
        if kill["kind"] == "node":
            print(f"node {kill['address']} of {kill['target']} lost in step {kill['step']}: next step recorded "
                  f"{kill['to_next_step_s']} s later")
    if soak["returncode"] != 0:
        print(soak["log"][-3000:])
    return 0 if all(checks.values()) else 1


def _names_any(p: psutil.Process, folders) -> bool:
    try:
        line = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return any(str(f) in line for f in folders) and p.pid != os.getpid()


if __name__ == "__main__":
    sys.exit(main())
