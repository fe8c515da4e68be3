"""Supervision of a run's service instances: notice a death, restart through the placement, keep a budget.

One `Instance` per service process (rollout-0, rollout-1, reward-ref-0, learner, ...) with its
address, state, weight version and restarts so far. A watch task asks the placement every
--health_poll_s whether each instance still runs (local: the process has not exited; Ray: the
actor and its child are alive; static: the address answers grpc.health.v1). A death is restarted
through the same placement (local: the process is started again with the same command line; Ray:
the child, or a dead actor, is started again on its bundle; static: the deployment restarts it and
the supervisor waits for the address to serve again), after a back-off of --restart_backoff_s
doubled per restart since the instance last served in a finished step (a crash loop waits longer each
time; an instance that died after serving steps, however many times in a long run, waits the first
back-off again). Past --max_restarts restarts of one instance the run stops with an
error naming the instance, how it ended and the last lines of its log.

What a restart means for the loop (weights, rewinding to a checkpoint) is recovery.py's business:
this module only keeps the instances alive and tells its listeners when one is back.

    states:  serving --(death)--> dead --(back-off, restart)--> starting --> syncing (rollout) --> serving
                                                                         \\-> serving (others)
             draining: gets no new work and leaves once its in-flight work is done (scale down)
             lost:     (--elastic) its node was lost and no node took its place: the run goes on without
                       it; `revive` starts it again once a node did (fleet/elastic.py decides both)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import pathlib
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager

import prometheus_client

from services.common.log import get_logger, log_event
from services.common.ready_file import ServiceStartError

_log = get_logger("coordinator")

STARTING, SERVING, SYNCING, DRAINING, DEAD, LOST = "starting", "serving", "syncing", "draining", "dead", "lost"
MAX_BACKOFF_S = 60.0

RESTARTS = prometheus_client.Counter("rlmesh_coordinator_service_restarts_total",
                                     "Restarts of a service instance after it died", ["service"])
DEATHS = prometheus_client.Counter("rlmesh_coordinator_service_deaths_total",
                                   "Deaths of a service instance noticed by the supervisor", ["service"])
RESTART_SECONDS = prometheus_client.Histogram("rlmesh_coordinator_service_restart_duration_seconds",
                                              "From a death noticed to the instance serving again (back-off included)",
                                              ["service"], buckets=(1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200))
REDONE_STEPS = prometheus_client.Counter("rlmesh_coordinator_redone_steps_total",
                                         "Completed steps done again after the learner was rewound to a checkpoint")
RECOVERED_SAMPLES = prometheus_client.Counter(
    "rlmesh_coordinator_recovered_samples_total",
    "Samples lost with a failed service and generated again (prompts moved to another engine, or a step redone)")


class ServiceFailed(RuntimeError):
    """An instance died more often than --max_restarts allows (or could not be started again)."""


class NoRoom(ServiceStartError):
    """A restart that no retry can help: the placement has nowhere to put the instance (a lost node's
    bundle that no node took within the bound). The run stops with it at once."""


@dataclasses.dataclass
class Instance:
    """One service process of the run, as the supervisor sees it."""

    name: str  # e.g. "rollout-0", "reward-ref-0", "learner"
    roles: tuple[str, ...]  # rollout, reward, reference, learner
    address: str
    state: str = SERVING
    weight_version: int = 0  # rollout engines: the version verified on it
    restarts: int = 0
    backoff_level: int = 0  # restarts since it last served in a finished step: the back-off's exponent
    last_death: str = ""  # how it ended last time ("exit code -9")
    died_at: float = 0.0  # time.monotonic() of the last death noticed


class Supervisor:
    """Watches every instance of a placement and restarts the ones that die."""

    def __init__(self, placement, max_restarts: int, backoff_s: float, poll_s: float, run_dir: pathlib.Path):
        self.placement = placement
        self.max_restarts, self.backoff_s, self.poll_s = max_restarts, backoff_s, poll_s
        self.instances = {name: Instance(name, roles, address) for name, roles, address in placement.instances()}
        self.events_path = pathlib.Path(run_dir) / "events.jsonl"
        self.fatal: ServiceFailed | None = None
        # Called with the instance once it serves again (recovery.py swaps clients and syncs weights).
        self.on_restarted: list[Callable[[Instance], Awaitable[None]]] = []
        self.on_died: list[Callable[[Instance], None]] = []  # called at once when a death is noticed
        # Around each restart attempt and its listeners (recovery.py: an engine on the learner's GPUs
        # waits for the learner's offload).
        self.restart_guard: Callable[[Instance], AbstractAsyncContextManager] = lambda instance: contextlib.nullcontext()
        # Whether a restart with nowhere to go (NoRoom) leaves the instance out instead of stopping the run
        # (--elastic, fleet/elastic.py); then the on_left_out listeners are called with it.
        self.may_leave_out: Callable[[Instance], bool] = lambda instance: False
        self.on_left_out: list[Callable[[Instance], None]] = []
        self._changed = asyncio.Condition()
        self._restarts: dict[str, asyncio.Task] = {}
        self._watch: asyncio.Task | None = None

    # ---- life cycle ----
    def start(self) -> None:
        self._watch = asyncio.ensure_future(self._watch_loop())

    async def stop(self) -> None:
        tasks = [t for t in [self._watch, *self._restarts.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def event(self, kind: str, **fields) -> None:
        """One line in {run_dir}/events.jsonl and in the coordinator's log."""
        record = {"event": kind, "unix_time": time.time(), **fields}
        with open(self.events_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        log_event(_log, kind, level=30 if kind in ("service.died", "service.failed") else 20, **fields)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ---- noticing deaths ----
    async def _watch_loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.poll_s)

    async def check_all(self) -> list[Instance]:
        """Asks the placement about every live instance now; returns those not serving afterwards."""
        live = [i for i in self.instances.values() if i.state in (SERVING, SYNCING, DRAINING)]
        restarts = [i.restarts for i in live]
        results = await asyncio.gather(*(self.placement.check(i.name) for i in live), return_exceptions=True)
        for instance, how, restarts_before in zip(live, results, restarts):
            if self.instances.get(instance.name) is not instance:
                continue  # scaled down while it was asked: its stop is no death
            if isinstance(how, BaseException):
                how = f"its placement could not be asked ({type(how).__name__}: {how})"
            # Checks overlap (the watch loop's and a failed call's; a static check takes a second):
            # a death another check already reported, or one from before a restart, is not a new one.
            if how and instance.state in (SERVING, SYNCING, DRAINING) and instance.restarts == restarts_before:
                self._died(instance, how)
        return self.not_serving()

    def not_serving(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.state in (DEAD, STARTING)]

    def _died(self, instance: Instance, how: str) -> None:
        instance.state, instance.last_death, instance.died_at = DEAD, how, time.monotonic()
        DEATHS.labels(instance.name).inc()
        self.event("service.died", service=instance.name, address=instance.address, how=how,
                   restarts=instance.restarts, max_restarts=self.max_restarts)
        for listener in self.on_died:
            listener(instance)
        if instance.name not in self._restarts or self._restarts[instance.name].done():
            self._restarts[instance.name] = asyncio.ensure_future(self._restart(instance))

    # ---- restarting ----
    async def _give_up(self, instance: Instance, why: str,
                       fix: str = "Fix the cause and rerun with --load_checkpoint, or raise --max_restarts.") -> None:
        """Stops the run (the first instance to give up names it). `fix`: what the user can do; a
        restart that failed for want of room says so in `why` (more restarts would not help)."""
        # Off the event loop: asking a placement for the log may wait on a remote actor (Ray), and
        # the loop meanwhile serves the other instances' restarts and stops the run.
        tail = await asyncio.to_thread(self.placement.log_tail, instance.name)
        if self.fatal is None:  # the first to give up stops the run and names it; the others are events
            self.fatal = ServiceFailed(" ".join(part for part in (
                f"{instance.name} ({', '.join(instance.roles)}) {why}; the run stops.", fix, tail) if part))
        self.event("service.failed", service=instance.name, how=instance.last_death, restarts=instance.restarts,
                   why=why)

    async def _restart(self, instance: Instance, counted: bool = True) -> None:
        """Restarts a dead instance. counted False: a left-out instance whose place has a node again
        starts without back-off and without using its budget (its node was lost, it did not die)."""
        while True:
            if counted and instance.restarts >= self.max_restarts:
                await self._give_up(instance, f"died ({instance.last_death}) after {instance.restarts} restart(s) "
                                              f"of --max_restarts {self.max_restarts}")
                break
            delay = min(self.backoff_s * 2 ** instance.backoff_level, MAX_BACKOFF_S) if counted else 0.0
            await asyncio.sleep(delay)
            async with self.restart_guard(instance):
                instance.state = STARTING
                if counted:
                    instance.restarts += 1
                    instance.backoff_level += 1
                    RESTARTS.labels(instance.name).inc()
                t0 = time.monotonic()
                try:
                    address = await self.placement.restart(instance.name)
                except NoRoom as exc:
                    instance.state, instance.last_death = DEAD, f"restart failed: {exc}"
                    if self.may_leave_out(instance):
                        self._leave_out(instance, exc, counted)
                        break
                    await self._give_up(instance, f"could not be restarted: {exc}", fix="")
                    break
                except Exception as exc:  # noqa: BLE001 - a failed start uses a restart of the budget, then retries
                    instance.last_death = f"restart failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                    instance.state = DEAD
                    self.event("service.restart_failed", service=instance.name, error=str(exc).splitlines()[0],
                               restarts=instance.restarts)
                    counted = True
                    continue
                instance.address = address
                instance.state = SYNCING if "rollout" in instance.roles else SERVING
                seconds = time.monotonic() - instance.died_at
                RESTART_SECONDS.labels(instance.name).observe(seconds)
                self.event("service.restarted", service=instance.name, address=address, restarts=instance.restarts,
                           start_s=round(time.monotonic() - t0, 2), since_death_s=round(seconds, 2), backoff_s=delay)
                for listener in self.on_restarted:
                    await listener(instance)
            break
        await self._notify()

    def step_finished(self) -> None:
        """A step finished: every instance serving now took part in it (or stood ready), so its next
        death is no crash loop and its next restart waits the first back-off again."""
        for instance in self.instances.values():
            if instance.state == SERVING:
                instance.backoff_level = 0

    def _leave_out(self, instance: Instance, exc: NoRoom, counted: bool) -> None:
        """The run goes on without the instance (--elastic): no node took its place."""
        instance.state = LOST
        if counted:  # the attempt found no room: nothing was started, the budget is for deaths
            instance.restarts -= 1
            instance.backoff_level -= 1
        self.event("service.left_out", service=instance.name, roles=",".join(instance.roles),
                   why=str(exc).split(". ")[0][:300])
        for listener in self.on_left_out:
            listener(instance)

    def revive(self, instance: Instance) -> None:
        """Starts a left-out instance again (a node took its place); listeners as after a restart."""
        if instance.state != LOST:
            return
        instance.state, instance.died_at = DEAD, time.monotonic()
        self._restarts[instance.name] = asyncio.ensure_future(self._restart(instance, counted=False))

    async def reshape(self, name: str, start: Callable[[], Awaitable[str]]) -> None:
        """Starts a serving instance again in another shape (the learner on more ranks, --elastic): the
        stop is no death. `start` returns its new address; listeners as after a restart. A failed
        reshape is a death (the usual restart follows) and is raised."""
        instance = self.instances[name]
        instance.state = STARTING
        t0 = time.monotonic()
        try:
            instance.address = await start()
        except Exception as exc:
            instance.state = SERVING  # so that _died takes it: the restart brings it back in some shape
            self._died(instance, f"its reshape failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            raise
        instance.state = SERVING
        self.event("service.reshaped", service=name, address=instance.address, start_s=round(time.monotonic() - t0, 2))
        for listener in self.on_restarted:
            await listener(instance)
        await self._notify()

    async def wait_back(self, timeout_s: float) -> None:
        """Returns once no instance is dead or starting; raises ServiceFailed when one gave up."""
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while self.fatal is None and self.not_serving():
                left = deadline - time.monotonic()
                if left <= 0:
                    names = ", ".join(i.name for i in self.not_serving())
                    raise ServiceFailed(f"{names} did not serve again within {timeout_s:.0f} s "
                                        "(--service_start_timeout_s)")
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass
        self.raise_if_failed()

    async def run_unless_failed(self, work: Awaitable):
        """Awaits `work`, stopping it as soon as an instance gives up (ServiceFailed raised): whatever
        the loop waits on then (a scoring call's wait for an instance, a step's generation) would only
        time out later with a vaguer error."""
        task = asyncio.ensure_future(work)
        failed = asyncio.ensure_future(self._wait_failed())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            failed.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.raise_if_failed()
        return task.result()

    async def _wait_failed(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.fatal is not None)

    def raise_if_failed(self) -> None:
        if self.fatal is not None:
            raise self.fatal

    def by_role(self, role: str) -> list[Instance]:
        return [i for i in self.instances.values() if role in i.roles]
