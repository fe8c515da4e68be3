"""What the Ray cluster holds, as the coordinator's placement asks it: the live nodes, whether a
placement group's bundle has one, the wait for a service's actor to run (bounded apart for a bundle
without a node and for an actor slow to start), and the resources named in errors."""

from __future__ import annotations

import asyncio
import json

import ray
import ray._private.state as ray_state  # per-node free resources (ray is pinned)
from ray.util.placement_group import placement_group_table

from services.coordinator.fleet.launcher import ServiceStartError
from services.coordinator.fleet.supervisor import NoRoom


def describe_bundles(bundles: list[dict]) -> str:
    """[{GPU: 1, CPU: 0.1}] x 4 -> '4 bundles of {GPU: 1, CPU: 0.1} (4 GPU, 0.4 CPU in all)'."""
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0) + v
    kinds = {json.dumps(b, sort_keys=True) for b in bundles}
    shape = next(iter(kinds)) if len(kinds) == 1 else "mixed bundles"
    return (f"{len(bundles)} bundle(s) of {shape} ("
            + ", ".join(f"{v:g} {k}" for k, v in sorted(total.items())) + " in all)")


async def actor_node(actor, group, index: int, name: str, group_role: str, placement_timeout_s: float,
                     start_timeout_s: float, bound_flag: str = "--ray_placement_timeout_s") -> str:
    """The node of an instance's actor, once Ray placed it and its process runs. A bundle without a
    live node (its node was lost, or the cluster is full) may wait placement_timeout_s (the flag
    `bound_flag`, named in the error) for one; an actor whose bundle has a node may take
    start_timeout_s to start its process (a loaded node starts its worker processes one at a time)."""
    call = asyncio.ensure_future(actor.node_ip.remote())
    loop = asyncio.get_running_loop()
    give_up = loop.time() + start_timeout_s
    unplaced_since = None
    while True:
        done, _ = await asyncio.wait([call], timeout=1.0)
        if done:
            return call.result()
        now = loop.time()
        unplaced_since = None if bundle_has_live_node(group, index) else (unplaced_since or now)
        if unplaced_since is not None and now - unplaced_since >= placement_timeout_s:
            call.cancel()
            bundle = group.bundle_specs[index]
            gpus = bundle.get("GPU", 0)
            raise NoRoom(
                f"{name}: no node took its bundle ({describe_bundles([bundle])} of {group_role}) within "
                f"{bound_flag} {placement_timeout_s:.0f} s; {cluster_summary()}. Its node was lost or the "
                "cluster is full, so more restarts cannot help (--max_restarts does not matter): a node with "
                f"room for the bundle must join (`{join_command(f'{gpus:g}' if gpus else '')}`). "
                f"One that joins within {bound_flag} takes the bundle and the run goes on (raise the "
                "bound to wait longer); once the run stopped, add it and resume with --load_checkpoint")
        if now >= give_up:
            call.cancel()
            raise ServiceStartError(
                f"{name}: its Ray actor did not start within --service_start_timeout_s {start_timeout_s:.0f} s "
                "though its bundle has a node; `ray status` and the node's raylet log "
                "(/tmp/ray/session_latest/logs) say why")


def bundle_has_live_node(group, index: int) -> bool:
    """Whether the placement group's bundle is reserved on a node that is alive now. A group whose node
    was lost is RESCHEDULING until another node takes the lost bundles; its other bundles stay where
    they are, and actors on them run and start as before."""
    table = placement_group_table(group)
    node = table.get("bundles_to_node_id", {}).get(index)
    return bool(node) and node in {n["NodeID"] for n in live_nodes()}


def live_nodes() -> list[dict]:
    """ray.nodes() of the nodes the cluster counts alive now (a lost one stays listed, not alive)."""
    return [n for n in ray.nodes() if n.get("Alive")]


def live_node_ips() -> set[str]:
    return {n["NodeManagerAddress"] for n in live_nodes()}


def join_command(gpus: str = "") -> str:
    """The `ray start` a node runs to join this cluster: the GCS address the driver is connected to
    (a cluster started on another port than Ray's default 6379 is named as it is); gpus: its
    --num-gpus, if any."""
    command = f"ray start --address {ray.get_runtime_context().gcs_address}"
    return f"{command} --num-gpus {gpus}" if gpus else command


def cluster_summary() -> str:
    """What the cluster has: GPUs and CPUs free now beside their totals, in all and per live node."""
    total, free = ray.cluster_resources(), ray.available_resources()
    nodes = live_nodes()
    free_by_node = ray_state.available_resources_per_node()  # node id -> free now; Alive nodes only

    def free_of_total(free_now: dict, whole: dict) -> str:
        return ", ".join(f"{free_now.get(k, 0):g}/{whole.get(k, 0):g} {k}" for k in ("GPU", "CPU"))

    per_node = "; ".join(f"{n['NodeManagerAddress']}: {free_of_total(free_by_node.get(n['NodeID'], {}), n['Resources'])}"
                         for n in nodes)
    return (f"the cluster has {len(nodes)} live node(s) with {total.get('GPU', 0):g} GPU and {total.get('CPU', 0):g} "
            f"CPU in all; free now (free/total): {free_of_total(free, total)}; per node: {per_node}")
