"""Who holds the GPUs' memory when the roles share them (--vllm_enable_sleep, --deepspeed_enable_sleep).

The loop sequences wake -> work -> sleep so vLLM and DeepSpeed never hold a GPU's memory at once:
the engines sleep after generating and wake (weights first, KV cache at the next generation); the
learner's states go to host memory after a step and come back before its log-probs or a checkpoint.
With --async_train only the learner sleeps (the engines generate on GPUs of their own), and a step's
training can overlap the next step's catch-up push: learner_in_use keeps its states on the GPUs
until the last such block ends.

A rollout engine restarted on the learner's GPUs (--colocate_all_models with both sleeps) does not
start while the learner works (from its reload to its offload) unless the loop waits for that
engine; it comes up asleep when the other engines sleep, and the learner's reload waits until such
a start is over. Its weights wake for the push that admits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from rlmesh.learner.v1 import learner_pb2
from services.common.log import get_logger, log_event

_log = get_logger("coordinator")


class Colocation:
    """The sleep state of the rollout engines and of the learner, and the calls that change it."""

    def __init__(self, config, pool):
        self.config, self.pool = config, pool
        self.learner = None  # the learner's stub (set by the loop, again after a learner restart)
        self.asleep: set[str] = set()  # what the engines have released: weights, kv_cache
        self.rollout_sleeps = config.vllm_enable_sleep  # False once an engine says it cannot sleep
        self.learner_offloaded = False  # learner states in host memory (--deepspeed_enable_sleep)
        self.learner_working = False  # from a reload to the next offload: no colocated engine starts
        self.learner_users = 0  # blocks that need the learner's states on its GPUs now (learner_in_use)
        self.offload_pending = False  # an offload asked for while a block used them: the last one out does it
        self.loop_waits = 0  # the loop waits for an engine to come back: its start cannot wait
        self.starting: set[str] = set()  # engines restarting on the learner's GPUs: its reload waits
        self._changed = asyncio.Condition()

    async def wake_rollout(self, tags: tuple[str, ...] | None = None) -> None:
        """Wakes what the engines released (`tags`: only those, e.g. ("weights",) before a push)."""
        wanted = self.asleep if tags is None else self.asleep & set(tags)
        if wanted:
            await self.pool.wake_up(tuple(sorted(wanted)))
            self.asleep -= wanted

    async def sleep_rollout(self) -> float:
        """Puts the engines to sleep (level 1) when the run asks for it; returns the seconds it took."""
        if not self.rollout_sleeps:
            return 0.0
        t0 = time.monotonic()
        try:
            await self.pool.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            self.rollout_sleeps = False
            log_event(_log, "rollout.sleep_unsupported", detail=exc.details(), action="continuing without sleep")
        return time.monotonic() - t0

    async def offload_learner(self) -> float:
        """Moves the learner's states off its GPUs (--deepspeed_enable_sleep); returns the seconds it took."""
        if not self.config.deepspeed_enable_sleep or self.learner_offloaded:
            self.offload_pending = False
            return 0.0
        if self.learner_users:  # async: the next step's catch-up push or this step's training still needs them
            self.offload_pending = True
            return 0.0
        self.offload_pending = False
        t0 = time.monotonic()
        await self.learner.Offload(learner_pb2.OffloadRequest(), timeout=120.0)
        self.learner_offloaded = True
        await self._set(learner_working=False)
        log_event(_log, "learner.offloaded", seconds=f"{time.monotonic() - t0:.3f}")
        return time.monotonic() - t0

    async def reload_learner(self) -> float:
        """Brings the learner's states back to its GPUs; returns the seconds it took (0 when they were there)."""
        if not self.learner_offloaded:
            return 0.0
        t0 = time.monotonic()
        if self.starting:
            log_event(_log, "learner.reload_waits", services=",".join(sorted(self.starting)),
                      until="their start is over")
        async with self._changed:
            await self._changed.wait_for(lambda: not self.starting)
            self.learner_working = True  # from here a colocated engine's restart waits for the offload
        await self.learner.Reload(learner_pb2.ReloadRequest(), timeout=120.0)
        self.learner_offloaded = False
        log_event(_log, "learner.reloaded", seconds=f"{time.monotonic() - t0:.3f}")
        return time.monotonic() - t0

    @contextlib.asynccontextmanager
    async def learner_in_use(self):
        """The learner's states on its GPUs while the block runs (yields the seconds the reload took).
        With --async_train such blocks overlap (a step's training, the next step's catch-up push): an
        offload asked for meanwhile waits until the last of them ends."""
        self.learner_users += 1
        try:
            yield await self.reload_learner()
        finally:
            self.learner_users -= 1
            if self.offload_pending and not self.learner_users:
                await self.offload_learner()

    @contextlib.asynccontextmanager
    async def learner_awake(self):
        """The learner's states on its GPUs for a push that comes while it sleeps (an engine admitted
        at a step's start), and back to host memory after it."""
        if self.learner_offloaded:
            self.offload_pending = True
        async with self.learner_in_use():
            yield

    # ---- an engine restarting on the learner's GPUs ----
    def gates_restarts(self) -> bool:
        """Whether a restarted engine shares the learner's GPUs and memory is handed over by sleeping."""
        c = self.config
        return bool(c.colocate_all_models and c.vllm_enable_sleep and c.deepspeed_enable_sleep and self.rollout_sleeps)

    async def _set(self, **fields) -> None:
        async with self._changed:
            for key, value in fields.items():
                setattr(self, key, value)
            self._changed.notify_all()

    def engine_start_waits(self) -> bool:
        """Whether a colocated engine's start must wait now: the learner works, the loop does not wait."""
        return self.learner_working and self.loop_waits == 0

    async def begin_engine_start(self, name: str) -> float:
        """Waits until the learner does not work (or the loop waits for an engine), then counts
        `name` as starting (the learner's reload waits for it); returns the seconds waited."""
        t0 = time.monotonic()
        async with self._changed:
            await self._changed.wait_for(lambda: not self.engine_start_waits())
            self.starting.add(name)
        return time.monotonic() - t0

    async def end_engine_start(self, name: str) -> None:
        async with self._changed:
            self.starting.discard(name)
            self._changed.notify_all()

    async def loop_waits_for_engine(self, waiting: bool) -> None:
        """The loop blocks on a restarted engine (no engine left, or a push without members): the
        engine's start goes ahead even while the learner holds its GPU memory."""
        async with self._changed:
            self.loop_waits += 1 if waiting else -1
            self._changed.notify_all()

    async def settle_restarted(self, engine) -> bool:
        """A restarted engine sleeps at once when the others do; True when it was put to sleep."""
        if not (self.rollout_sleeps and "weights" in self.asleep):
            return False
        await self.pool.sleep(level=1, engines=[engine])
        return True

    async def ready_for_admission(self, engines: list, sleep_levels: list[int]) -> None:
        """Engines about to get the push that admits them: the asleep ones wake their weights."""
        await self._wake_asleep(engines, sleep_levels, ("weights",))

    async def match_admitted(self, engines: list, sleep_levels: list[int]) -> None:
        """After that push: what the admitted engines hold awake, these hold too (their KV cache)."""
        await self._wake_asleep(engines, sleep_levels, tuple(sorted({"weights", "kv_cache"} - self.asleep)))

    async def _wake_asleep(self, engines: list, sleep_levels: list[int], tags: tuple[str, ...]) -> None:
        asleep = [e for e, level in zip(engines, sleep_levels) if level > 0]
        if tags and asleep:
            await self.pool.wake_up(tags, engines=asleep)
