"""Node losses in Ray placement: a GRPO run of the tiny model on a local multi-node Ray cluster (one
machine, each node its own raylet on its own loopback address: services/coordinator/fleet/local_cluster.py),
with a node killed (raylet, agents, workers and services, all SIGKILLed) --node_kills times, each
at a later step, in turns: rollout-0's node while it generates, the learner's node while it trains;
spare nodes take the lost bundles.

    python bench/soak_nodes.py [--steps 8] [--node_kills 2] [--out runs/soak-nodes]

The same run without faults goes first, on the same cluster. It reports every step once, the per-step
metrics against the fault-free run (tests/chaos/harness.py's comparison), the seconds from each kill
to the next step's record, and the run's processes left behind (none, the cluster stopped too), in
OUT/results.json. bench/soak.py does the long run with service kills in local placement,
bench/soak_ray.py the long run with service kills and node losses together in Ray placement.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile
import time

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(__file__).resolve().parents[1] / "protos")]

from services.common.tiny import make_data, make_tiny_model  # noqa: E402
from services.coordinator.fleet.local_cluster import LocalCluster, free_port, node_processes  # noqa: E402
from tests.chaos.harness import Holds, Trial, _read_jsonl, differences, service_env  # noqa: E402
from tests.coordinator.test_ray_multinode import common_argv, start_submit, wait_for_step  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from soak import run_processes  # noqa: E402


def _names(pid: int, folder: pathlib.Path) -> bool:
    try:
        return str(folder) in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def grpo_ray_argv(model: pathlib.Path, data: pathlib.Path, out: pathlib.Path, steps: int) -> list[str]:
    """Learner, rollout-0 and rollout-1 on a GPU bundle each (a node each: one GPU per node), rule
    reward in a CPU instance (no KL: no reference model), a checkpoint every step."""
    argv = [*common_argv(model, data, out), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
            "--train_batch_size", "16", "--micro_train_batch_size", "8", "--reward_func", "math",
            "--label_key", "label", "--init_kl_coef", "0", "--actor_learning_rate", "1e-3",
            "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "2",
            "--vllm_tensor_parallel_size", "1", "--critic_num_nodes", "0", "--critic_num_gpus_per_node", "0",
            "--reward_num_nodes", "0", "--reward_num_gpus_per_node", "0", "--ref_num_nodes", "0",
            "--ref_num_gpus_per_node", "0", "--save_steps", "1", "--port", "0",
            "--ready_file", str(out / "control.json"), "--max_restarts", "8", "--restart_backoff_s", "0.1"]
    argv[argv.index("--max_steps") + 1] = str(steps)
    return argv


def new_cluster() -> LocalCluster:
    """A local Ray cluster in a fresh /tmp folder whose lost nodes Ray declares dead within ~3 s."""
    env = {k: v for k, v in service_env().items() if k in ("VLLM_CPU_KVCACHE_SPACE", "TOKENIZERS_PARALLELISM",
                                                          "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DS_ACCELERATOR",
                                                          "WANDB_MODE")}
    # A killed node is declared dead after 3 failed health checks 1 s apart (Ray's own: 5 x 3 s).
    env.update(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3",
               RAY_enable_metrics_collection="0")
    return LocalCluster(pathlib.Path(tempfile.mkdtemp(prefix="rls-", dir="/tmp")), env=env)


def cluster_up(cluster: LocalCluster, workers: int) -> list[str]:
    """A head and `workers` nodes of one logical GPU and 2 CPUs each; returns the nodes' addresses."""
    cluster.up(workers=workers, gpus_per_node=1, cpus_per_node=2, port=free_port(), dashboard_port=free_port(),
               head_env={"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "GLOO_SOCKET_IFNAME": "lo"})
    return [n.ip for n in cluster.state().nodes]


def this_clusters(ips: list[str], cluster: LocalCluster) -> list[str]:
    """This cluster's Ray processes still running: those that name its folder (Ray's session and socket
    paths); another local cluster on the machine may reuse a lost node's address."""
    return [f"ray pid {pid} ({ip})" for ip in ips for pid in node_processes(ip) if _names(pid, cluster.folder)]


def run_job(cluster: LocalCluster, argv: list[str], out: pathlib.Path, kill_steps: list[int], timeout_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    # Kills take turns: the node of rollout-0 while it generates, then the learner's while it trains.
    targets = ["rollout-0" if i % 2 == 0 else "learner" for i in range(len(kill_steps))]
    entries = [f"rollout.generate.started@rollout-0:step{k}" if t == "rollout-0" else f"learner.train.started@learner:step{k}"
               for t, k in zip(targets, kill_steps)]
    holds = Holds(out / "holds", *entries) if entries else None
    log, t0 = out / "submit.log", time.monotonic()
    proc = start_submit(cluster, argv, log, holds.env() if holds else None)
    kills = []
    try:
        for step, entry, target in zip(kill_steps, entries, targets):
            holds.wait(entry, proc, timeout_s=600)
            status = wait_for_step(proc, log, out / "control.json", out / "run", lambda s: True, t0)
            role = target.split("-")[0]
            node = next(s.address for s in status.services if s.role == role and (s.index == 0 or role == "learner")).rpartition(":")[0]
            killed = cluster.kill(node)
            kills.append({"step": step, "of": target, "node": node, "processes": killed,
                          "at_s": round(time.monotonic() - t0, 1), "unix_time": time.time()})
            print(f"  step {step}: node {node} of {target} killed ({killed} processes)", flush=True)
            holds.release(entry)
        code = proc.wait(timeout=max(timeout_s - (time.monotonic() - t0), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    records = _read_jsonl(out / "run" / "metrics.jsonl")
    for kill in kills:  # seconds from the kill to the next record of a step (the lost step's, redone)
        after = [r["unix_time"] for r in records if r.get("unix_time", 0) > kill["unix_time"]]
        kill["to_next_step_s"] = round(min(after) - kill["unix_time"], 1) if after else None
    return {"returncode": code, "seconds": round(time.monotonic() - t0, 1), "records": records,
            "events": _read_jsonl(out / "run" / "events.jsonl"), "kills": kills,
            "log": log.read_text(errors="replace")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--node_kills", type=int, default=2, help="at steps evenly spread over the run, from step 2")
    parser.add_argument("--spares", type=int, default=None, help="spare nodes; default: one per node kill and one more (the rule reward's instance takes a node's bundle too)")
    parser.add_argument("--out", default="runs/soak-nodes")
    parser.add_argument("--timeout_s", type=float, default=1200.0, help="per run")
    args = parser.parse_args(argv)
    root = pathlib.Path(args.out).resolve()
    shutil.rmtree(root, ignore_errors=True)
    model, data = make_tiny_model(root / "model", seed=0), make_data(root / "data", seed=0)
    kill_steps = sorted({2 + i * max((args.steps - 2) // max(args.node_kills, 1), 1) for i in range(args.node_kills)})
    cluster = new_cluster()
    workers = 3 + (args.spares if args.spares is not None else args.node_kills + 1)
    t0 = time.monotonic()
    ips = []
    try:
        ips = cluster_up(cluster, workers)
        print(f"cluster of {len(ips)} nodes up in {time.monotonic() - t0:.0f} s", flush=True)
        base = run_job(cluster, grpo_ray_argv(model, data, root / "baseline", args.steps), root / "baseline", [],
                       args.timeout_s)
        print(f"baseline: exit {base['returncode']}, {len(base['records'])} steps in {base['seconds']} s", flush=True)
        if base["returncode"] != 0:
            print(base["log"][-3000:])
            return 1
        faults = run_job(cluster, grpo_ray_argv(model, data, root / "faults", args.steps), root / "faults", kill_steps,
                         args.timeout_s)
        print(f"node kills: exit {faults['returncode']}, {len(faults['records'])} steps in {faults['seconds']} s",
              flush=True)
    finally:
        cluster.down()
    time.sleep(2)
    left = [f"{name} pid {p.pid}" for out in (root / "baseline", root / "faults")
            for name, procs in run_processes(out).items() for p in procs]
    left += this_clusters(ips, cluster)
    shutil.rmtree(cluster.folder, ignore_errors=True)

    as_trial = lambda r: Trial([], r["returncode"], r["records"], r["events"])  # noqa: E731
    diffs = differences(as_trial(base), as_trial(faults))
    steps = [r["global_step"] for r in faults["records"]]
    results = {
        "command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "nodes": len(ips),
        "kill_steps": kill_steps, "kills": faults["kills"], "steps": steps,
        "every_step_once": steps == list(range(1, args.steps + 1)),
        "samples_trained": [r.get("samples/trained") for r in faults["records"]],
        "differences": diffs[:20], "seconds": {"baseline": base["seconds"], "faults": faults["seconds"]},
        "restarted": [e["service"] for e in faults["events"] if e["event"] == "service.restarted"],
        "replaced": sorted({line.split("service=")[1].split()[0] for line in faults["log"].splitlines()
                            if "ray.actor_replaced service=" in line}),
        "leftovers": left,
    }
    results["checks"] = {"finished": faults["returncode"] == 0 and base["returncode"] == 0,
                         "every_kill_landed": len(faults["kills"]) == len(kill_steps),
                         "every_step_once": results["every_step_once"], "equal_to_fault_free": not diffs,
                         "no_leftovers": not left}
    (root / "results.json").write_text(json.dumps(results, indent=1))
    for kill in faults["kills"]:
        print(f"node {kill['node']} ({kill['of']}) killed in step {kill['step']} ({kill['processes']} processes): next step recorded "
              f"{kill['to_next_step_s']} s later")
    print(f"steps {steps}; {len(diffs)} differing metric(s) vs fault-free; replaced {results['replaced']}; "
          f"left behind: {left or 'none'}")
    print("checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in results["checks"].items()))
    if faults["returncode"] != 0:
        print(faults["log"][-3000:])
    return 0 if all(results["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
