"""Who holds the GPUs' memory when the roles share them (--vllm_enable_sleep, --deepspeed_enable_sleep).

The loop sequences wake -> work -> sleep so vLLM and DeepSpeed never hold a GPU's memory at once:
the engines sleep after generating and wake (weights first, KV cache at the next generation); the
learner's states go to host memory after a step and come back before its log-probs or a checkpoint.
"""

from __future__ import annotations

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
            return 0.0
        t0 = time.monotonic()
        await self.learner.Offload(learner_pb2.OffloadRequest(), timeout=120.0)
        self.learner_offloaded = True
        return time.monotonic() - t0

    async def reload_learner(self) -> float:
        """Brings the learner's states back to its GPUs; returns the seconds it took (0 when they were there)."""
        if not self.learner_offloaded:
            return 0.0
        t0 = time.monotonic()
        await self.learner.Reload(learner_pb2.ReloadRequest(), timeout=120.0)
        self.learner_offloaded = False
        return time.monotonic() - t0
