"""What a service's death and restart mean for the training loop (the supervisor keeps them alive).

    rollout engine dies   during Generate: its unfinished prompts go to the other engines (rollout_pool);
                          with none left, generation waits here until the restarted one is admitted.
                          during a weight push: the push is redone on a new weight group of the engines
                          that are left (and any restarted one); the step is not trained twice.
                          at any other time (asleep, idle): nothing waits for it.
                          A restarted engine is admitted (gets prompts) only after the current weights
                          were pushed to it and its version and checksum verified, at the next step
                          start or push, or at once when generation has no engine.
    reward / reference    in-flight calls fail; the step's generation and scoring are redone from the
                          same prompts and seeds after the restart (nothing was trained yet), so every
                          sample is scored once in the step's result.
    learner (any rank)    restarted, it loads the newest complete checkpoint; the coordinator rewinds to
                          that checkpoint's coordinator.json (step, data position, KL coefficient; every
                          seed derives from --seed and the step) and redoes the steps since; the engines
                          get the checkpoint's weights as a new version. With fixed seeds the run ends
                          with the model of a run without the crash.

    during start-up       (the first weight group, the first push, a resume's checkpoint load) the
                          start-up is done again once the dead service serves again.
    a lost node (--elastic, elastic.py)  what no node replaces is left out: an engine like a dead one that
                          never comes back, the learner re-formed on fewer ranks like a restarted one
                          (rewind); the learner growing back at a step start rewinds to that step.

A death counts for a failed call even when the supervisor restarted the service before the call's
failure surfaced (a push that waits on a dead member's socket can outlast the restart).

Every weight group is rebuilt from scratch (InitWeightTransfer on the learner and every admitted
engine) whenever its membership changes: a gloo/NCCL group cannot lose or gain a member in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import grpc

from rlmesh.rollout.v1 import rollout_pb2
from services.common.crash_points import crash_point
from services.coordinator.loop.run_state import ServiceEntry, WeightSyncError
from services.coordinator.fleet.supervisor import (RECOVERED_SAMPLES, REDONE_STEPS, SERVING, SYNCING, Instance,
                                                    ServiceFailed, Supervisor)

# How long a failed call waits for the supervisor to see the death that caused it: a killed
# process is usually gone before its connection resets, but a busy machine can lag.
DEATH_GRACE_S = 3.0
# Longer while the learner does not report SERVING: after losing a rank it fails the call, stops
# serving and exits (its ranks may be out of step), which a loaded machine can take seconds to do.
LEARNER_EXIT_S = 60.0


class LearnerRestarted(RuntimeError):
    """The learner lost its state since the last step: the loop rewinds to the checkpoint."""


class Recovery:
    """Binds a Trainer to a Supervisor: swaps clients on restarts and repairs the step.

    It changes the loop only through the Trainer's named calls (attach_recovery, rewind, ...) and
    its `members` (services/coordinator/loop/members.py: which instances the loop uses)."""

    def __init__(self, trainer, supervisor: Supervisor):
        self.t, self.sup = trainer, supervisor
        self.members = trainer.members
        self.config = trainer.config
        supervisor.on_restarted.append(self._on_restarted)
        supervisor.on_died.append(self._on_died)
        supervisor.restart_guard = self._restart_guard
        self.colocation = trainer.colocation_state()
        # Scoring retries and instance changes go to the run's events.jsonl too.
        trainer.attach_recovery(self, self._prompts_moved, self._generate_refused, supervisor.event,
                                self.refresh_status)
        self.rollout_index = {i.name: k for k, i in enumerate(supervisor.by_role("rollout"))}
        self.reward_index = {i.name: k for k, i in enumerate(supervisor.by_role("reward"))}
        self.reference_index = {i.name: k for k, i in enumerate(supervisor.by_role("reference"))}
        self.learner_restarted = False
        self._sync_lock = asyncio.Lock()
        self._step_mark: dict[str, tuple[int, float]] = {}  # deaths seen when the step started
        self.elastic = None  # --elastic: fleet/elastic.py (the learner grows back at a step start)
        self._rewinding = False  # the repair under way rewinds the learner (recover)

    def refresh_status(self) -> None:
        """The control API's service list, with the supervisor's state and restarts of each."""
        sup = self.sup
        entries = []
        for role, index in (("rollout", self.rollout_index), ("reward", self.reward_index),
                            ("reference", self.reference_index)):
            for name, i in sorted(index.items(), key=lambda item: item[1]):
                instance = sup.instances.get(name)
                if instance is None:
                    continue
                version = self.members.engine(i).weight_version if role == "rollout" else 0
                entries.append(ServiceEntry(role, i, instance.address, version, instance.state, instance.restarts))
        learner = sup.instances.get("learner")
        if learner is not None:
            entries.append(ServiceEntry("learner", 0, learner.address, 0, learner.state, learner.restarts))
        self.t.show_services(entries)

    # ---- deaths: no new work for the dead ----
    def _roles_of(self, instance: Instance):
        """(role, index in the loop) of each role the instance serves."""
        for role, index in (("rollout", self.rollout_index), ("reward", self.reward_index),
                            ("reference", self.reference_index)):
            if instance.name in index:
                yield role, index[instance.name]

    def _on_died(self, instance: Instance) -> None:
        for role, i in self._roles_of(instance):
            self.members.instance_died(role, i, f"{instance.name} died ({instance.last_death})")

    # ---- restarts: new addresses ----
    @contextlib.asynccontextmanager
    async def _restart_guard(self, instance: Instance):
        """An engine on the learner's GPUs starts while the learner's states are in host memory, and
        the learner's reload waits until the start (and its sleep, see _on_restarted) is over."""
        gated = "rollout" in instance.roles and self.colocation.gates_restarts()
        if gated:
            if self.colocation.engine_start_waits():
                self.sup.event("rollout.restart_waits", service=instance.name, until="the learner's offload")
            waited = await self.colocation.begin_engine_start(instance.name)
            if waited > 0.05:
                self.sup.event("rollout.restart_proceeds", service=instance.name, waited_s=round(waited, 2))
        try:
            yield
        finally:
            if gated:
                await self.colocation.end_engine_start(instance.name)

    @contextlib.asynccontextmanager
    async def _blocked_on_restarts(self):
        """The loop waits for restarted services: an engine on the learner's GPUs starts at once."""
        await self.colocation.loop_waits_for_engine(True)
        try:
            yield
        finally:
            await self.colocation.loop_waits_for_engine(False)

    async def _on_restarted(self, instance: Instance) -> None:
        for role, i in self._roles_of(instance):
            self.members.instance_moved(role, i, instance.address)
            if role == "rollout":
                try:
                    if await self.colocation.settle_restarted(self.members.engine(i)):
                        self.sup.event("rollout.started_asleep", service=instance.name,
                                       why="the other engines sleep while the learner works")
                except grpc.aio.AioRpcError as exc:  # it died again: the supervisor sees to it
                    self.sup.event("rollout.sleep_failed", service=instance.name, error=exc.details())
        if "learner" in instance.roles:
            # The loop keeps calling the dead address (and failing) until it has rewound: a call to
            # the restarted learner before it loaded the checkpoint would use --pretrain's weights.
            self.learner_restarted = True
        self.refresh_status()

    def _prompts_moved(self, engine, request_id: str, prompts: int, lost_samples: int) -> None:
        """A failed engine's unfinished prompts are generated again on the others."""
        RECOVERED_SAMPLES.inc(lost_samples)
        name = next((n for n, k in self.rollout_index.items() if k == engine.index), f"rollout-{engine.index}")
        self.sup.event("rollout.prompts_moved", service=name, request_id=request_id, prompts=prompts,
                       lost_samples=lost_samples)

    def _lost_weights(self, engine, why: str) -> None:
        """An admitted engine no longer holds the pushed weights: it restarted faster than two
        health checks a second apart notice (static placement: the deployment brought it back on
        the same address). It is treated as restarted: out of the pool, and admitted again after a
        new weight group and the current weights."""
        if engine not in self.members.engines() or engine.syncing:
            return
        instance = self._instance_of(engine)
        self.sup.event("rollout.lost_state", service=instance.name, address=engine.address, error=why[:300],
                       expected=self.t.weight_version(), action="push the current weights before its next prompt")
        # A new channel; and a new weight group (_group_stale).
        self.members.instance_moved("rollout", engine.index, engine.address)
        instance.state = SYNCING
        self.refresh_status()

    def _generate_refused(self, engine, why: str) -> bool:
        """A Generate refused for expected_weight_version ("... the engine holds version N, not M",
        services/rollout/server.py): whether the engine lost the pushed weights (it holds an older
        version than the run's: restarted unseen), in which case it is out. A newer version is no loss."""
        held = re.search(r"holds version (\d+)", why)
        if held is None or int(held.group(1)) >= self.t.weight_version():
            return False
        self._lost_weights(engine, why)
        return True

    def _instance_of(self, engine) -> Instance:
        name = next(n for n, k in self.rollout_index.items() if k == engine.index)
        return self.sup.instances[name]

    def _mark(self) -> dict[str, tuple[int, float]]:
        """Each instance's (restarts, time of the last death): what _failed_since compares with."""
        return {name: (i.restarts, i.died_at) for name, i in self.sup.instances.items()}

    async def _failed_since(self, mark: dict[str, tuple[int, float]]) -> list[Instance]:
        """The instances down now (_dead_now) and those that died since `mark` and are back already."""
        down = await self._dead_now()
        back = [i for name, i in self.sup.instances.items()
                if name in mark and mark[name] != (i.restarts, i.died_at) and i not in down]
        return down + back

    async def _dead_now(self) -> list[Instance]:
        """The instances that are down, after giving the supervisor DEATH_GRACE_S to notice one
        (up to LEARNER_EXIT_S while the learner is not serving)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            down = await self.sup.check_all()
            waited = loop.time() - start
            if down or waited > LEARNER_EXIT_S or (waited > DEATH_GRACE_S and await self.t.learner_serving()):
                break
            await asyncio.sleep(0.25)
        for instance in down:
            if instance.name in self.rollout_index:
                self.members.instance_died("rollout", self.rollout_index[instance.name], "down")
        return down

    # ---- admitting engines: a new weight group and the current weights ----
    def _members(self) -> list:
        """Engines for the next weight group: admitted ones, and restarted ones that wait to be."""
        return [e for e in self.members.engines() if (e.healthy or e.syncing) and not e.draining]

    async def _sync(self, version: int | None) -> dict:
        """Admits the engines waiting to be (restarted or added). version None: a new weight group
        over every member and a new version pushed to all. Otherwise a catch-up: a group of the
        waiting engines alone gets `version`, the one the others hold (0: nothing was pushed yet,
        so a fresh engine already holds it); the next push rebuilds the group over everyone."""
        t, handle = self.t, self.members
        async with self._sync_lock:
            members = self._members()
            waiting = [e for e in members if e.syncing]
            if version is not None and not waiting:
                return {}
            sleep_levels = []
            if waiting:
                infos = await handle.engine_infos(waiting)
                for engine, info in zip(waiting, infos):
                    engine.tensor_parallel_size = max(1, info.tensor_parallel_size)
                sleep_levels = [info.sleep_level for info in infos]
                await self.colocation.ready_for_admission(waiting, sleep_levels)  # came up asleep: weights back
            group = members if version is None else waiting
            if version is None:
                # The version each engine holds, not the one last booked: a push whose answer was
                # lost (the learner died after the engines took it) left them a version ahead.
                for engine, info in zip(members, await handle.engine_infos(members)):
                    engine.weight_version = info.weight_version
            # A new rendezvous port: the learner's store of the old group may still hold the old one.
            master = await self.sup.placement.weight_sync_master(handle.current_endpoints())
            await handle.build_weight_group(group, master)
            metrics = {}
            if version is None or version > 0:
                metrics = await t.push_weights(group, version or 0)
            else:
                infos = await handle.engine_infos(waiting)
                for engine, info in zip(waiting, infos):
                    if info.weight_version != 0 or info.weights_state != rollout_pb2.WEIGHTS_STATE_READY:
                        raise RuntimeError(f"restarted rollout {engine.index} ({engine.address}) holds version "
                                           f"{info.weight_version}, not the initial weights the run still uses")
            await self.colocation.match_admitted(waiting, sleep_levels)
            for engine in waiting:
                instance = self._admit(engine)
                instance.weight_version = t.weight_version()
                self.sup.event("rollout.admitted", service=instance.name, address=engine.address,
                               version=t.weight_version())
                crash_point("coordinator.push.engine_admitted")
            return metrics

    def _admit(self, engine) -> Instance:
        """The engine gets prompts from now on (its weights were pushed or checked)."""
        engine.syncing, engine.healthy = False, True
        instance = self._instance_of(engine)
        instance.state = SERVING
        return instance

    def _group_stale(self) -> bool:
        return not self.members.weight_group_is(self._members())

    def step_finished(self) -> None:
        """After each finished step: the instances serving now start their restart back-off afresh."""
        self.sup.step_finished()

    async def before_step(self) -> None:
        """At a step's start: fail if a service gave up; admit restarted engines; with no engine
        admitted, wait for one."""
        self.sup.raise_if_failed()
        self._step_mark = self._mark()
        if self.learner_restarted:
            raise LearnerRestarted("the learner restarted since the last step")
        # A learner restarted faster than a health check notices (static placement: same address)
        # no longer holds the last pushed version. (Newer is fine: with --async_train a push may be
        # under way while the next step starts.)
        held = await self.t.learner_weight_version()
        if held < self.t.weight_version():
            self.learner_restarted = True
            self.sup.event("learner.lost_state", learner_version=held,
                           expected=self.t.weight_version(), action="rewind to the last checkpoint")
            raise LearnerRestarted(f"the learner holds weight version {held}, not "
                                   f"{self.t.weight_version()}: it restarted")
        if self.elastic is not None:
            await self.elastic.before_step()
        # The same for a rollout engine: one that no longer holds the pushed version is admitted again.
        engines = self.members.admitted_engines()
        infos = await asyncio.gather(*(self.members.engine_infos([e]) for e in engines), return_exceptions=True)
        for engine, engine_info in zip(engines, infos):
            if isinstance(engine_info, BaseException):
                continue  # a dead one is the supervisor's; its Generate moves its prompts meanwhile
            if engine_info[0].weight_version < self.t.weight_version():
                self._lost_weights(engine, f"the engine holds weight version {engine_info[0].weight_version}")
        if not self.members.admitted_engines():
            await self.wait_for_engine()
        elif any(e.syncing for e in self._members()):
            await self._sync(self.t.weight_version())

    async def setup(self, resume: bool) -> None:
        """The trainer's start-up, done again after a service died during it: the supervisor
        restarts the service, and the first weight group, push and checkpoint load are redone with it."""
        attempts = 0
        while True:
            self.sup.raise_if_failed()
            mark = self._mark()
            try:
                await self.t.setup(resume=resume)
                self.refresh_status()
                return
            except (grpc.RpcError, WeightSyncError, ConnectionError, asyncio.TimeoutError) as exc:
                down = await self._failed_since(mark)
                attempts += 1
                if not (down or self.learner_restarted) or attempts > self.config.max_restarts + 1:
                    raise
                self.sup.event("setup.failed", services=",".join(i.name for i in down) or "learner",
                               error=f"{type(exc).__name__}: {str(exc)[:300]}",
                               action="start up again once they serve")
            async with self._blocked_on_restarts():
                await self.sup.wait_back(self.config.service_start_timeout_s + 120.0)
            if self.learner_restarted:
                self.t.reconnect_learner(self.sup.instances["learner"].address)
                self.learner_restarted = False
            # A restarted engine takes part in the start-up again like the others: its weights are
            # checked (checksum) or pushed there, as theirs are.
            for engine in self._members():
                if engine.syncing:
                    self._admit(engine)
            self.members.drop_weight_group()
            self.members.use_rendezvous(await self.sup.placement.weight_sync_master(self.members.current_endpoints()))

    async def wait_for_engine(self) -> None:
        """No engine is admitted (generation would stop): wait for a restart and admit it with the
        weights the step generates with."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.service_start_timeout_s + 60.0
        async with self._blocked_on_restarts():
            while not self.members.admitted_engines():
                self.sup.raise_if_failed()
                if any(e.syncing for e in self._members()):
                    await self._sync(self.t.weight_version())
                    continue
                if loop.time() > deadline:
                    raise RuntimeError("no rollout engine came back within --service_start_timeout_s")
                await self.sup.check_all()
                await asyncio.sleep(0.25)

    async def push_weights(self) -> dict:
        """The step's push, redone on a new group when an engine dies during it (the learner keeps
        the trained weights, so nothing is trained twice). A dead learner is re-raised: the run
        rewinds to its checkpoint."""
        failures = 0
        while True:
            self.sup.raise_if_failed()
            mark = self._mark()
            try:
                if self._group_stale():
                    return await self._sync(None)
                return await self.t.push_weights(self._members())
            except Exception as exc:
                down = await self._failed_since(mark)
                failures += 1
                # Bounded: each retry follows a death, and deaths are bounded by --max_restarts.
                limit = len(self.members.engines()) * (self.config.max_restarts + 1) + 1
                if not down or any("learner" in i.roles for i in down) or self.learner_restarted or failures > limit:
                    raise
                self.sup.event("weights.push_failed", error=f"{type(exc).__name__}: {str(exc)[:300]}",
                               services=",".join(i.name for i in down), action="push again on a new weight group")
                self.members.drop_weight_group()  # a failed push breaks the group on every member
                if not self._members():
                    await self.wait_for_engine_serving()

    async def wait_for_engine_serving(self) -> None:
        """Until some engine is admitted or restarted (syncing)."""
        async with self._blocked_on_restarts():
            while not self._members():
                self.sup.raise_if_failed()
                await self.sup.check_all()
                await asyncio.sleep(0.25)

    # ---- a failed step ----
    async def recover(self, exc: Exception, step: int) -> int:
        """After step `step + 1` failed: restarts what died and returns the step to continue from
        (`step`, or the checkpoint's step after a learner restart). Re-raises failures no restart
        explains, and those after training when the learner lives (a redo would train twice).

        A service that dies while the repair runs (a node lost right after a restart, an engine
        during the rewind's weight push) is repaired in turn; once a learner rewind began, the
        repair that follows rewinds again (the checkpoint is loaded again, the engines get it)."""
        rewind = False
        while True:
            mark = self._mark()
            try:
                return await self._repair(exc, step, rewind)
            except ServiceFailed:
                raise
            except Exception as again:  # noqa: BLE001 - a death during the repair: repair again
                rewind = rewind or self._rewinding
                if again is exc or (not self.learner_restarted and not await self._failed_since(mark)):
                    raise  # no death explains it (the repair gave the failure back as it came)
                self._step_mark = mark
                self.sup.event("recovery.interrupted", step=step + 1, rewind=rewind,
                               error=f"{type(again).__name__}: {str(again)[:300]}")
                exc = again

    async def _repair(self, exc: Exception, step: int, rewind: bool) -> int:
        """One attempt of recover's repair; rewind True: a rewind began in an earlier attempt."""
        t, cfg = self.t, self.config
        self._rewinding = False
        down = await self._failed_since(self._step_mark)
        learner = rewind or self.learner_restarted or any("learner" in i.roles for i in down)
        if not down and not learner:
            raise exc
        trained_step, lost_samples = t.step_attempt()
        if not learner and trained_step == step + 1:
            raise exc
        self._rewinding = learner
        self.sup.event("step.failed", step=step + 1, services=",".join(i.name for i in down) or "learner",
                       error=f"{type(exc).__name__}: {str(exc)[:300]}")
        async with self._blocked_on_restarts():
            await self.sup.wait_back(cfg.service_start_timeout_s + 120.0)
        RECOVERED_SAMPLES.inc(lost_samples)
        if learner:
            return await self._rewind(step)
        t.retry_step()
        self.sup.event("step.retried", step=step + 1, lost_samples=lost_samples)
        return step

    async def rewind_learner(self, step: int) -> int:
        """The learner was started again on purpose (--elastic: on more ranks) after step `step` was
        saved: it loads that checkpoint and the engines get its weights; no step is done again."""
        return await self._rewind(step)

    async def _rewind(self, step: int) -> int:
        """The restarted learner loads the newest complete checkpoint; the loop goes back to it."""
        t = self.t
        t.reconnect_learner(self.sup.instances["learner"].address)
        self.learner_restarted = False
        saved_step = await t.rewind()
        to_step = saved_step or 0
        redone = step - to_step
        REDONE_STEPS.inc(redone)
        # Engines get the checkpoint's weights as a new version (a restarted engine joins here too).
        if not self._members():
            await self.wait_for_engine_serving()
        await self._sync(None)
        self.sup.event("learner.rewound", from_step=step, to_step=to_step, redone_steps=redone,
                       checkpoint=saved_step if saved_step is not None else "none (pretrained weights)",
                       version=t.weight_version())
        return to_step
