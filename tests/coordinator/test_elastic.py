"""--elastic's decisions (services/coordinator/fleet/elastic.py with the supervisor), against a
placement that stands for a Ray cluster whose nodes are lost and join: an instance that no node
takes is left out while another of its role serves, and started again once a node takes its place;
the last of a role still stops the run. Every change is an event, a counter and the shape that
GetStatus reports. The learner's ranks on real nodes: tests/coordinator/test_ray_elastic.py."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from services.coordinator.fleet import elastic
from services.coordinator.fleet.ray_elastic import learner_world
from services.coordinator.fleet.supervisor import LOST, SYNCING, NoRoom, ServiceFailed, Supervisor
from services.coordinator.loop.run_state import RunControl


class Cluster:
    """Two rollout engines, a reward instance and a one-rank learner; `lost` instances are dead at every
    check and have nowhere to restart until their name is in `back` (a node took their bundle)."""

    def __init__(self):
        self.lost: set[str] = set()
        self.back: set[str] = set()
        self.started: list[str] = []

    def instances(self):
        return [("learner", ("learner",), "10.0.0.1:1"), ("rollout-0", ("rollout",), "10.0.0.2:1"),
                ("rollout-1", ("rollout",), "10.0.0.3:1"), ("reward-0", ("reward",), "10.0.0.1:2")]

    async def check(self, name: str) -> str | None:
        return "its Ray actor died (ActorDiedError)" if name in self.lost and name not in self.back else None

    async def restart(self, name: str) -> str:
        if name in self.lost and name not in self.back:
            raise NoRoom(f"{name}: no node took its bundle within --elastic_wait_s 1 s")
        self.started.append(name)
        return "10.0.0.9:1"

    def log_tail(self, name: str) -> str:
        return ""

    def learner_ranks(self) -> int:
        return 1

    def has_node(self, name: str) -> bool:
        return name in self.back

    def ranks_to_add(self) -> list:
        return []


def elastic_run(cluster: Cluster, tmp_path, enabled: bool = True):
    supervisor = Supervisor(cluster, max_restarts=3, backoff_s=0.0, poll_s=0.01, run_dir=tmp_path)
    config = types.SimpleNamespace(elastic=enabled, actor_gpus=lambda: 1)
    recovery = types.SimpleNamespace(sup=supervisor, config=config, elastic=None)
    control = RunControl("ray")
    return supervisor, elastic.Elastic(recovery, cluster, control), control


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "not within the bound"
        await asyncio.sleep(0.01)


def events(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def test_a_lost_engine_is_left_out_and_comes_back_when_a_node_takes_its_place(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic, "WATCH_S", 0.02)
    cluster = Cluster()
    shrinks = elastic.RESHAPES.labels("rollout", "shrink")._value.get()
    grows = elastic.RESHAPES.labels("rollout", "grow")._value.get()

    async def run():
        supervisor, shape, control = elastic_run(cluster, tmp_path)
        supervisor.start()
        shape.start()
        try:
            assert control.shape.rollout_engines == (2, 2) and control.shape.elastic
            cluster.lost.add("rollout-1")
            await until(lambda: supervisor.instances["rollout-1"].state == LOST)
            assert supervisor.fatal is None  # the run goes on
            assert control.shape.rollout_engines == (1, 2) and control.shape.left_out == ("rollout-1",)
            assert elastic.ROLLOUT_ENGINES._value.get() == 1
            assert supervisor.instances["rollout-1"].restarts == 0  # no start was made: the budget is for deaths
            cluster.back.add("rollout-1")  # a node joined and took its bundle
            await until(lambda: supervisor.instances["rollout-1"].state == SYNCING)
            assert control.shape.rollout_engines == (2, 2) and control.shape.left_out == ()
            assert elastic.ROLLOUT_ENGINES._value.get() == 2 and control.shape.reshapes == 2
        finally:
            await shape.stop()
            await supervisor.stop()

    asyncio.run(run())
    assert cluster.started == ["rollout-1"]
    changes = [(e["event"], e.get("role"), e.get("was"), e.get("now")) for e in events(tmp_path)
               if e["event"].startswith("elastic.")]
    assert changes == [("elastic.shrink", "rollout", 2, 1), ("elastic.node_back", None, None, None),
                       ("elastic.grow", "rollout", 1, 2)], changes
    assert elastic.RESHAPES.labels("rollout", "shrink")._value.get() == shrinks + 1
    assert elastic.RESHAPES.labels("rollout", "grow")._value.get() == grows + 1


def test_the_last_of_a_role_still_stops_the_run(tmp_path):
    """Both engines lost: one is left out, the other would leave none, so the run stops naming it."""
    cluster = Cluster()

    async def run() -> str:
        supervisor, shape, _ = elastic_run(cluster, tmp_path)
        supervisor.start()
        try:
            cluster.lost |= {"rollout-0", "rollout-1"}
            with pytest.raises(ServiceFailed) as failed:
                await asyncio.wait_for(supervisor.run_unless_failed(asyncio.sleep(30)), 10)
            return str(failed.value)
        finally:
            await supervisor.stop()

    message = asyncio.run(run())
    assert message.startswith("rollout-") and "could not be restarted" in message, message
    assert "no node took its bundle" in message, message
    left_out = [e["service"] for e in events(tmp_path) if e["event"] == "service.left_out"]
    failed = [e["service"] for e in events(tmp_path) if e["event"] == "service.failed"]
    assert len(left_out) == 1 and left_out[0].startswith("rollout-"), left_out
    assert failed == sorted({"rollout-0", "rollout-1"} - set(left_out)), failed  # the other engine: the last one


def test_without_elastic_a_lost_node_stops_the_run(tmp_path):
    cluster = Cluster()

    async def run() -> None:
        supervisor, _, control = elastic_run(cluster, tmp_path, enabled=False)
        supervisor.start()
        try:
            cluster.lost.add("rollout-1")
            with pytest.raises(ServiceFailed, match="rollout-1 .rollout. could not be restarted"):
                await asyncio.wait_for(supervisor.run_unless_failed(asyncio.sleep(30)), 10)
            assert not control.shape.elastic and control.shape.rollout_engines == (2, 2)
        finally:
            await supervisor.stop()

    asyncio.run(run())


def test_the_learner_reforms_on_ranks_that_keep_the_global_batch():
    # train_batch_size 16, micro 4: 4 ranks accumulate once, 2 twice, 1 four times; 3 cannot split 16.
    assert [learner_world(n, 16, 4) for n in range(0, 6)] == [0, 1, 2, 2, 4, 4]
    assert learner_world(3, 24, 4) == 3 and learner_world(5, 24, 4) == 3
