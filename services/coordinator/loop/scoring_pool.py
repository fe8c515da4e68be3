"""Reward and reference calls over the instances of one role, surviving an instance's death.

Each call goes to the serving instance with the fewest calls in flight. This pool is the one layer
that retries the coordinator -> reward / reference hop (its clients' channels do not retry):

- An instance fails a call when gRPC reports it UNAVAILABLE without the service's final trailer
  (connection refused or reset: the process died or is unreachable), or when the supervisor marks
  it dead while the call runs (the call is cancelled). The instance is then down: it gets no calls
  until its address answers health checks again (a restart at the same address; probed every
  `probe_interval_s`), or the supervisor marks it alive or replaces it. The call goes to another
  serving instance; with none, it waits for one.
- Bounds: at most `max_retries` moves per call, and a call waits at most `wait_s` in all for a
  serving instance (from when it was first sent); past either bound it fails, naming every
  instance and why it is down. Defaults (--scoring_retries, --scoring_wait_s): 4 moves, 300 s.
- Anything the service itself answers (its status carries the final trailer, e.g. a remote reward
  server that stayed down after the reward service's own retries) is final: it is raised at once
  as a ScoringError naming the service and instance.

A request sent again keeps its request id, so an instance that already scored it answers from
memory (services.reward.recent); every sample of a step gets exactly one result, since a call
returns one answer however many instances it went to.

For the supervisor: `mark_dead`, `mark_alive`, `replace`, `add` and `remove` (drain: no new calls,
wait for those in flight) change the instances while calls run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.client import make_channel, returned_by_service
from services.common.log import get_logger, log_event
from services.coordinator.loop import metrics as prom

_log = get_logger("coordinator")

SERVING, DOWN, DEAD, DRAINING = "serving", "down", "dead", "draining"


class ScoringError(RuntimeError):
    """A reward / reference call failed; the message names the service, the instance and the cause."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class _InstanceLost(Exception):
    pass


@dataclasses.dataclass(eq=False)
class Instance:
    role: str
    index: int
    address: str
    client: Any  # RewardClient or ReferenceClient
    state: str = SERVING
    in_flight: int = 0
    last_error: str = ""
    # Set when the instance stops serving, so the calls it has in flight move elsewhere.
    lost: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    probe: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def describe(self) -> str:
        return f"{self.role} service {self.name} at {self.address}"


class ScoringPool:
    """The instances of one role ("reward" or "reference") and the calls the loop makes on them."""

    def __init__(self, role: str, addresses: list[str], make_client: Callable[[str], Any], wait_s: float = 300.0,
                 max_retries: int = 4, probe_interval_s: float = 1.0):
        self.role = role
        self.make_client = make_client
        self.wait_s = wait_s
        self.max_retries = max_retries
        self.probe_interval_s = probe_interval_s
        self.instances = [Instance(role, i, a, make_client(a)) for i, a in enumerate(addresses)]
        self.retries = 0  # calls moved to another instance, over the pool's life
        # Where events go besides the log; the supervisor sets its own (a line in the run's events.jsonl).
        self.on_event: Callable[..., None] | None = None
        self._change = asyncio.Event()
        self._closing: set[asyncio.Task] = set()

    # ---- calls ----------------------------------------------------------------------------------

    async def call(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        """fn(client) on a serving instance; moved to another instance when this one dies."""
        started = time.monotonic()
        moves = 0
        while True:
            instance = await self._acquire(started)
            try:
                return await self._call_on(instance, fn)
            except _InstanceLost as lost:
                moves += 1
                self.retries += 1
                prom.RPC_RETRIES.labels(self.role).inc()
                self._event("scoring.retry", service=self.role, instance=instance.name, address=instance.address,
                          attempt=moves, error=str(lost))
                if moves > self.max_retries:
                    raise ScoringError(f"{instance.describe()} failed a call ({lost}); it was sent {moves} times "
                                       f"(--scoring_retries {self.max_retries}) and failed each time; see the "
                                       f"{self.role} services' logs") from None
            finally:
                instance.in_flight -= 1
                self._changed()

    async def _acquire(self, started: float) -> Instance:
        """The serving instance with the fewest calls in flight, waiting (bounded) while there is none."""
        waiting_logged = False
        while True:
            serving = [i for i in self.instances if i.state == SERVING]
            if serving:
                instance = min(serving, key=lambda i: (i.in_flight, i.index))
                instance.in_flight += 1
                return instance
            left = self.wait_s - (time.monotonic() - started)
            if left <= 0 or not self.instances:
                raise ScoringError(f"no {self.role} service instance has served for {self.wait_s:g} s "
                                   f"(--scoring_wait_s): {self._describe_all()}; check the services' logs, or that "
                                   "the supervisor can restart them (--max_restarts)")
            if not waiting_logged:
                self._event("scoring.waiting", service=self.role, wait_s=f"{left:.0f}", instances=self._describe_all())
                waiting_logged = True
            change = self._change
            try:
                await asyncio.wait_for(change.wait(), left)
            except TimeoutError:
                pass

    async def _call_on(self, instance: Instance, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        lost = instance.lost
        task = asyncio.ensure_future(fn(instance.client))
        watch = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise _InstanceLost(f"{instance.describe()} stopped serving: {instance.last_error or instance.state}")
        try:
            return task.result()
        except grpc.aio.AioRpcError as exc:
            if not returned_by_service(exc):
                # gRPC's own error; the channel already names the service and address in it.
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self._mark_down(instance, exc.details())
                    raise _InstanceLost(f"{instance.name}: {exc.details()}") from None
                raise ScoringError(f"{instance.name}: {exc.details()}", exc.code()) from None
            raise ScoringError(f"{instance.describe()}: {exc.code().name}: {exc.details()}", exc.code()) from None

    # ---- instance states ------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> None:
        if self.on_event is not None:
            self.on_event(kind, **fields)  # also logs
        else:
            log_event(_log, kind, **fields)

    def _changed(self) -> None:
        change, self._change = self._change, asyncio.Event()
        change.set()

    def _find(self, index: int) -> Instance:
        for instance in self.instances:
            if instance.index == index:
                return instance
        raise KeyError(f"no {self.role} instance {index} (have {[i.index for i in self.instances]})")

    def _stop_serving(self, instance: Instance, state: str, reason: str) -> None:
        instance.state, instance.last_error = state, reason
        instance.lost.set()
        if instance.probe is not None:
            instance.probe.cancel()
            instance.probe = None

    def _serve(self, instance: Instance, address: str | None = None) -> None:
        """Admits the instance with a fresh channel (an old one may sit in its reconnect back-off)."""
        old = instance.client
        instance.address = address or instance.address
        instance.client = self.make_client(instance.address)
        self._close_later(old)
        if instance.probe is not None and instance.probe is not asyncio.current_task():
            instance.probe.cancel()
        instance.probe = None
        instance.state, instance.last_error = SERVING, ""
        instance.lost = asyncio.Event()
        self._event("scoring.instance_serving", service=self.role, instance=instance.name, address=instance.address)
        self._changed()

    def _mark_down(self, instance: Instance, reason: str) -> None:
        if instance.state != SERVING:
            return
        self._stop_serving(instance, DOWN, reason)
        self._event("scoring.instance_down", service=self.role, instance=instance.name, address=instance.address,
                  error=reason)
        instance.probe = asyncio.ensure_future(self._probe(instance))
        self._changed()

    async def _probe(self, instance: Instance) -> None:
        """Health-checks a down instance's address until it serves again."""
        address = instance.address
        async with make_channel(address, default_timeout_s=5.0) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while instance.state == DOWN and instance.address == address:
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        self._serve(instance)
                        return
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(self.probe_interval_s)

    def mark_dead(self, index: int, reason: str = "marked dead") -> None:
        """The instance is dead (the supervisor saw it go): its calls move elsewhere; no probing."""
        instance = self._find(index)
        self._stop_serving(instance, DEAD, reason)
        self._event("scoring.instance_dead", service=self.role, instance=instance.name, address=instance.address,
                  reason=reason)
        self._changed()

    def mark_alive(self, index: int) -> None:
        """The instance serves again at its address (e.g. restarted there); no-op when it serves."""
        instance = self._find(index)
        if instance.state != SERVING:
            self._serve(instance)

    def replace(self, index: int, address: str) -> None:
        """Instance `index` now lives at `address` (a restart elsewhere); calls to the old one move."""
        instance = self._find(index)
        if instance.state == SERVING:
            self._stop_serving(instance, DEAD, f"replaced by {address}")
        self._serve(instance, address)

    def add(self, address: str) -> int:
        """A new serving instance; returns its index."""
        index = max((i.index for i in self.instances), default=-1) + 1
        self.instances.append(Instance(self.role, index, address, self.make_client(address)))
        self._event("scoring.instance_added", service=self.role, instance=f"{self.role}-{index}", address=address)
        self._changed()
        return index

    async def remove(self, address: str) -> None:
        """Drains the instance at `address`: no new calls; returns once those in flight are done."""
        instance = next((i for i in self.instances if i.address == address), None)
        if instance is None:
            raise KeyError(f"no {self.role} instance at {address} (have {[i.address for i in self.instances]})")
        if instance.probe is not None:
            instance.probe.cancel()
        instance.state = DRAINING
        self._changed()
        while instance.in_flight:
            change = self._change
            await change.wait()
        self.instances.remove(instance)
        await instance.client.close()
        self._event("scoring.instance_removed", service=self.role, instance=instance.name, address=address)

    def _describe_all(self) -> str:
        return "; ".join(f"{i.name} at {i.address} is {i.state}" + (f" ({i.last_error})" if i.last_error else "")
                         for i in self.instances) or "no instances"

    def _close_later(self, client) -> None:
        task = asyncio.ensure_future(client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for instance in self.instances:
            if instance.probe is not None:
                instance.probe.cancel()
        await asyncio.gather(*(i.client.close() for i in self.instances), *self._closing, return_exceptions=True)
