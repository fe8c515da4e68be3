"""The run's shape, and elastic runs (--elastic): a lost node that nothing replaces costs no one's time.

Without --elastic a restart with nowhere to go (NoRoom: no node took a lost node's bundle within
--ray_placement_timeout_s) stops the run. With it (Ray placement, ray_elastic.py), after
--elastic_wait_s:

    rollout engine        left out while another engine serves: its unfinished prompts already went to
                          the others (rollout_pool.py), and every step keeps its samples (the pool cuts a
                          step's prompts by the engines of the run, left-out ones included, so the
                          generation seeds stay those of the full run); the weight group is rebuilt
                          without it at the next push
    reward / reference    left out while another instance of each of its roles serves (the scoring
                          pools already moved its calls)
    learner ranks         the learner re-forms on the ranks whose nodes live (ray_elastic.py) and loads
                          the newest checkpoint; the loop rewinds to it (recovery.py), so with a
                          checkpoint every step at most the step under way is done again
    the last of a role    (an engine, a reward instance, every learner rank) cannot be left out: the run
                          stops as without --elastic

When a node joins, Ray moves the lost bundles to it. A watch here starts a left-out instance again
as soon as its bundle has a node; an engine is admitted with the current weights at the next step
start (recovery.py). The learner grows back at a step start: the last step's checkpoint is saved if
it was not, the learner restarts on its ranks and the left-out ones, loads it, and the step goes on
with no step done again.

Every change is an event in events.jsonl (elastic.shrink, elastic.grow: role, was, now, planned,
why), a Prometheus counter (rlmesh_coordinator_reshapes_total{role,change}) and the gauges of the
current shape; the control API's GetStatus reports the shape (rlmesh control status).
"""

from __future__ import annotations

import asyncio

import prometheus_client

from services.common.log import get_logger
from services.coordinator.fleet.supervisor import DRAINING, LOST, Instance
from services.coordinator.loop.run_state import RunShape

_log = get_logger("coordinator")
ROLES = ("rollout", "reward", "reference")
WATCH_S = 2.0  # how often left-out instances are checked for a node that took their place

ROLLOUT_ENGINES = prometheus_client.Gauge(
    "rlmesh_coordinator_rollout_engines", "Rollout engines the run uses now (serving, or dead and coming back); "
    "--elastic leaves out those whose node was lost until a node takes their place")
LEARNER_RANKS = prometheus_client.Gauge("rlmesh_coordinator_learner_ranks", "Ranks the learner trains on now")
LEFT_OUT = prometheus_client.Gauge("rlmesh_coordinator_left_out_instances",
                                   "Instances (rollout, reward, reference) or learner ranks left out now by --elastic "
                                   "because their node was lost", ["role"])
RESHAPES = prometheus_client.Counter("rlmesh_coordinator_reshapes_total",
                                     "Changes of the run's shape by --elastic: instances or learner ranks left out "
                                     "(change=shrink) or back (change=grow)", ["role", "change"])


class Elastic:
    """Keeps the run's shape (always) and, with --elastic, leaves out and brings back what a lost node held."""

    def __init__(self, recovery, placement, control):
        self.recovery, self.sup, self.placement, self.control = recovery, recovery.sup, placement, control
        self.config = recovery.config
        self.enabled = self.config.elastic
        self.reviving: set[str] = set()  # left-out instances starting again: still out until they serve
        self.reshapes = 0
        self._watch: asyncio.Task | None = None
        self._ranks_back = 0  # left-out learner ranks a node took (reported once per change)
        self.planned_ranks = self.config.actor_gpus()
        self.left_out = self._left_out_now()
        self.sup.on_restarted.append(self._restarted)
        # GetStatus shows the shape as it is (scaling changes the planned counts too).
        self._refresh_services, control.refresh_services = control.refresh_services, self._refresh
        if self.enabled:
            self.sup.may_leave_out = self._may_leave_out
            self.sup.on_left_out.append(self._instance_left_out)
            recovery.elastic = self
        self.publish()

    # ---- life cycle ----
    def start(self) -> None:
        if self.enabled:
            self._watch = asyncio.ensure_future(self._watch_left_out())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)

    # ---- the shape ----
    def learner_ranks(self) -> int:
        return self.placement.learner_ranks() if self.enabled else self.planned_ranks

    def _members(self, role: str) -> list[Instance]:
        return [i for i in self.sup.by_role(role) if i.state != DRAINING]

    def _out(self, instance: Instance) -> bool:
        return instance.state == LOST or instance.name in self.reviving

    def _left_out_now(self) -> dict[str, int]:
        out = {role: sum(self._out(i) for i in self._members(role)) for role in ROLES}
        out["learner"] = self.planned_ranks - self.learner_ranks()
        return out

    def update(self, why: str) -> None:
        """Records a change of shape (an event and a counter per role that changed) and publishes it."""
        now = self._left_out_now()
        for role, out in now.items():
            before = self.left_out.get(role, 0)
            if out == before:
                continue
            change = "shrink" if out > before else "grow"
            planned = self.planned_ranks if role == "learner" else len(self._members(role))
            RESHAPES.labels(role, change).inc()
            self.reshapes += 1
            self.sup.event(f"elastic.{change}", role=role, was=planned - before, now=planned - out, planned=planned,
                           why=why, step=self.control.global_step)
        self.left_out = now
        self.publish()

    def publish(self) -> None:
        """The gauges and the control API's shape."""
        counts = {}
        for role in ROLES:
            members = self._members(role)
            counts[role] = (len(members) - sum(self._out(i) for i in members), len(members))
        ranks = self.learner_ranks()
        ROLLOUT_ENGINES.set(counts["rollout"][0])
        LEARNER_RANKS.set(ranks)
        for role, out in self._left_out_now().items():
            LEFT_OUT.labels(role).set(out)
        left_out = sorted({i.name for role in ROLES for i in self._members(role) if self._out(i)})
        self.control.shape = RunShape(rollout_engines=counts["rollout"], learner_ranks=(ranks, self.planned_ranks),
                                      reward_instances=counts["reward"], reference_instances=counts["reference"],
                                      reshapes=self.reshapes, elastic=self.enabled, left_out=tuple(left_out))

    def _refresh(self) -> None:
        if self._refresh_services is not None:
            self._refresh_services()
        self.publish()

    # ---- shrinking ----
    def _may_leave_out(self, instance: Instance) -> bool:
        """An instance may be left out while another instance of each of its roles is in use (the
        learner re-forms in the placement instead: its NoRoom means no rank has a node)."""
        if "learner" in instance.roles:
            return False
        return all(any(i is not instance and not self._out(i) for i in self._members(role)) for role in instance.roles)

    def _instance_left_out(self, instance: Instance) -> None:
        self.reviving.discard(instance.name)  # a revival that found no room after all
        self.update(f"{instance.name}: its node was lost and no node took its place within --elastic_wait_s")

    async def _restarted(self, instance: Instance) -> None:
        if instance.name in self.reviving:
            self.reviving.discard(instance.name)
            self.update(f"{instance.name}: a node took its place")
        elif "learner" in instance.roles:
            self.update(f"the learner started on {self.learner_ranks()} of its {self.planned_ranks} ranks")
        else:
            self.publish()

    # ---- growing back ----
    async def _watch_left_out(self) -> None:
        """Starts a left-out instance again once a node took its bundle (admitted at a step start)."""
        while True:
            await asyncio.sleep(WATCH_S)
            for instance in [i for i in self.sup.instances.values() if i.state == LOST]:
                if self.placement.has_node(instance.name):
                    self.reviving.add(instance.name)
                    self.sup.event("elastic.node_back", service=instance.name, action="start it again")
                    self.sup.revive(instance)
            ranks = len(self.placement.ranks_to_add())
            if ranks and ranks != self._ranks_back:
                self.sup.event("elastic.node_back", role="learner", ranks=ranks,
                               action="the learner grows back at the next step start")
            self._ranks_back = ranks

    async def before_step(self) -> None:
        """At a step start: the learner grows back onto left-out ranks that a node took."""
        if not self.placement.ranks_to_add():
            return
        trainer = self.recovery.t
        step = trainer.state.global_step
        if step > 0 and self.config.disable_ds_ckpt:
            return  # nothing to carry the trained state to the new ranks: the learner keeps its shape
        if step > 0 and self.control.last_checkpoint_step != step:
            await trainer.save_checkpoint(step)  # the state the re-formed learner starts from
        await self.sup.reshape("learner", self.placement.grow_learner)
        await self.recovery.rewind_learner(step)
