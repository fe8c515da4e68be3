"""How long the coordinator waits for a Ray actor (services/coordinator/fleet/ray_cluster.py
actor_node), on a local Ray instance: a bundle that no node holds is given up after
--ray_placement_timeout_s with the cluster's resources; an actor whose bundle has a node but whose
process starts slowly (a loaded node starts its worker processes one at a time) is waited for up to
--service_start_timeout_s, not reported as unplaced."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from services.coordinator.fleet.launcher import ServiceStartError
from services.coordinator.fleet.ray_cluster import actor_node


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _host(init_s: float):
    class Host:
        def __init__(self):
            time.sleep(init_s)

        def node_ip(self) -> str:
            return ray.util.get_node_ip_address()

    return ray.remote(num_cpus=0.5)(Host)


def _on(group, host_cls):
    return host_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0)).remote()


def test_a_slow_actor_on_a_placed_bundle_is_waited_for(local_ray):
    group = placement_group([{"CPU": 0.5}])
    ray.get(group.ready(), timeout=60)
    try:
        t0 = time.monotonic()
        node = asyncio.run(actor_node(_on(group, _host(6.0)), group, 0, "rollout-0", "the actor", 1.0, 120.0))
        assert node == ray.util.get_node_ip_address()
        assert time.monotonic() - t0 >= 5.0  # waited past the placement bound: the bundle had a node
    finally:
        remove_placement_group(group)


def test_an_actor_past_the_start_bound_is_named(local_ray):
    group = placement_group([{"CPU": 0.5}])
    ray.get(group.ready(), timeout=60)
    try:
        with pytest.raises(ServiceStartError, match=r"rollout-1: its Ray actor did not start within "
                                                    r"--service_start_timeout_s 3 s though its bundle has a node"):
            asyncio.run(actor_node(_on(group, _host(60.0)), group, 0, "rollout-1", "the actor", 1.0, 3.0))
    finally:
        remove_placement_group(group)


def test_a_bundle_no_node_holds_fails_within_the_placement_bound(local_ray):
    group = placement_group([{"CPU": 8}])  # more than any node has: never placed
    try:
        t0 = time.monotonic()
        with pytest.raises(ServiceStartError) as error:
            asyncio.run(actor_node(_on(group, _host(0.0)), group, 0, "reward-ref-0", "the actor (--actor_num_nodes 1)",
                                   2.0, 120.0))
        took = time.monotonic() - t0
        message = str(error.value)
        assert message.startswith('reward-ref-0: no node took its bundle (1 bundle(s) of {"CPU": 8.0} (8 CPU in all) '
                                  "of the actor (--actor_num_nodes 1)) within --ray_placement_timeout_s 2 s"), message
        assert "the cluster has 1 live node(s) with 0 GPU and 2 CPU in all; free now (free/total): 0/0 GPU, " \
               "2/2 CPU; per node: " in message, message  # free beside total, in all and per node
        # The node to add joins the address this cluster really has (not Ray's default port).
        assert f"(`ray start --address {ray.get_runtime_context().gcs_address}`)" in message, message
        assert "more restarts cannot help" in message and "--load_checkpoint" in message, message
        assert 2.0 <= took < 10.0, took
    finally:
        remove_placement_group(group)
