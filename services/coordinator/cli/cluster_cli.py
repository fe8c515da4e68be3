"""`rlmesh cluster`: a Ray cluster of several nodes on this machine, to try the multi-node guide
on a laptop (services/coordinator/fleet/local_cluster.py does the work).

    rlmesh cluster up --workers 4 --gpus_per_node 2      head 127.0.0.2 + workers 127.0.0.3-6
    ray status --address 127.0.0.2:6379                  4 workers of 2 (logical) GPUs
    ray job submit --address http://127.0.0.1:8265 --runtime-env-json '{"working_dir": "."}' \\
        -- python3 -m services.coordinator.train_ppo_ray --device cpu ...
    rlmesh cluster kill 127.0.0.4                        that node and everything on it, as a lost machine
    rlmesh cluster join --gpus 2                         a new node (next free address)
    rlmesh cluster status                                the nodes and the addresses to use
    rlmesh cluster down                                  every node
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from services.coordinator.fleet.local_cluster import ClusterError, LocalCluster

DEFAULT_DIR = "/tmp/rlmesh-cluster"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlmesh cluster", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=DEFAULT_DIR, help="folder of the cluster's state and node logs")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", allow_abbrev=False, help="start a head and worker nodes")
    up.add_argument("--workers", type=int, default=2, help="worker nodes")
    up.add_argument("--gpus_per_node", type=int, default=2, help="(logical) GPUs each worker declares")
    up.add_argument("--head_gpus", type=int, default=0, help="GPUs the head declares (0: the driver's node only)")
    up.add_argument("--cpus_per_node", type=int, default=1, help="CPUs each node declares")
    up.add_argument("--object_store_mb", type=int, default=80, help="object store per node, MiB (Ray's least is 75)")
    up.add_argument("--port", type=int, default=6379, help="the head's GCS port (workers join HEAD:PORT)")
    up.add_argument("--dashboard_port", type=int, default=8265, help="dashboard / job submission port on 127.0.0.1")
    join = sub.add_parser("join", allow_abbrev=False, help="start one more worker node")
    join.add_argument("--gpus", type=int, default=2, help="(logical) GPUs it declares")
    join.add_argument("--cpus", type=int, default=1, help="CPUs it declares")
    kill = sub.add_parser("kill", allow_abbrev=False, help="SIGKILL a worker node and every process on it (a lost machine)")
    kill.add_argument("ip", help="the node's address, e.g. 127.0.0.4 (`rlmesh cluster status` lists them)")
    sub.add_parser("status", allow_abbrev=False, help="the nodes, the GCS address and the job-submission URL")
    sub.add_parser("down", allow_abbrev=False, help="stop every node")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cluster = LocalCluster(pathlib.Path(args.dir))
    try:
        if args.action == "up":
            cluster.up(args.workers, args.gpus_per_node, args.head_gpus, args.cpus_per_node, args.object_store_mb,
                       args.port, args.dashboard_port)
        elif args.action == "join":
            print(f"joined {cluster.join(args.gpus, args.cpus)}")
        elif args.action == "kill":
            print(f"killed {args.ip}: {cluster.kill(args.ip)} processes")
        elif args.action == "down":
            cluster.down()
            print("down")
            return 0
        if args.action in ("up", "status"):
            state = cluster.state()
            print(json.dumps({"address": cluster.address, "dashboard": cluster.dashboard_url,
                              "nodes": [{"ip": n.ip, "gpus": n.gpus, "cpus": n.cpus, "head": n.head}
                                        for n in state.nodes],
                              "alive": sorted(cluster.alive_nodes())}, indent=1))
    except ClusterError as exc:
        print(f"rlmesh cluster {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0
