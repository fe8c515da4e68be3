"""Generation across every rollout engine, balanced by outstanding samples, streamed.

A batch of prompts is cut into chunks in a fixed way (so a chunk's seed, and with it its samples,
do not depend on timing); each chunk becomes one streamed Generate call on the engine with the
fewest samples still outstanding. Every sample is handed to `on_sample` the moment it arrives, so
scoring and log-probs run while generation continues. When an engine fails (UNAVAILABLE), the
prompts of its unfinished calls are generated again on the others; with none left, the pool waits
for the supervisor to bring one back (`wait_for_engine`, set by recovery.py) instead of failing.

`healthy` engines are the admitted ones: they hold the current weights and get prompts. A restarted
or added engine is `syncing` (serving, not yet holding the current weights) until a push verified
on it admits it; a `draining` one gets no new prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
from collections.abc import Awaitable, Callable

import grpc
import torch

from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.client import make_channel
from services.common.log import get_logger, log_event
from services.common.tasks import gather_or_cancel
from services.common.tensors import to_proto
from services.coordinator.loop.data import Prompt

_log = get_logger("coordinator")
ROLLOUT_SERVICE = "rlmesh.rollout.v1.RolloutService"
IDEMPOTENT = ("GetModelInfo", "Sleep", "WakeUp")


@dataclasses.dataclass
class Engine:
    index: int
    address: str
    stub: rollout_pb2_grpc.RolloutServiceStub
    channel: grpc.aio.Channel
    outstanding: int = 0  # samples requested and not yet received
    healthy: bool = True  # admitted: gets prompts and weight pushes
    weight_version: int = 0
    tensor_parallel_size: int = 1  # workers in the weight group
    syncing: bool = False  # serving again (restarted or added) and waiting for the current weights
    draining: bool = False  # leaves once its in-flight samples are done


def chunk_seed(seed: int, step: int, round_index: int, chunk_index: int) -> int:
    """A 31-bit seed for one Generate call, fixed by where the chunk sits in the run."""
    digest = hashlib.blake2b(f"{seed}/{step}/{round_index}/{chunk_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class RolloutPool:
    """The rollout engines of a run and the calls the loop makes on them."""

    def __init__(self, addresses: list[str], timeout_s: float, max_message_mb: int = 256):
        self.timeout_s, self.max_message_mb = timeout_s, max_message_mb
        self.engines = [self._connect(i, address) for i, address in enumerate(addresses)]
        # Awaited when no engine is admitted; returns once one is (None: fail instead).
        self.wait_for_engine: Callable[[], Awaitable[None]] | None = None
        # (engine, error) -> whether the engine lost its weights (then it is out, as if it had died);
        # set by recovery.py (see run_chunk)
        self.on_lost_weights: Callable[[Engine, str], bool] | None = None
        # Called with (engine, request id, prompts moved, samples received and dropped) when a
        # failed engine's unfinished prompts go to the others (recovery.py counts and logs them).
        self.on_prompts_moved: Callable[[Engine, str, int, int], None] | None = None
        self.lost_samples = 0  # samples received from an engine that then failed, generated again

    def _connect(self, index: int, address: str) -> Engine:
        channel = make_channel(address, ROLLOUT_SERVICE, idempotent_methods=IDEMPOTENT,
                               default_timeout_s=self.timeout_s, max_message_mb=self.max_message_mb)
        return Engine(index, address, rollout_pb2_grpc.RolloutServiceStub(channel), channel)

    def replace(self, index: int, address: str) -> Engine:
        """A restarted engine at `index` (new address, new channel): syncing until a push admits it."""
        position = next(k for k, e in enumerate(self.engines) if e.index == index)
        old = self.engines[position]
        engine = self._connect(index, address)
        engine.healthy, engine.syncing = False, True
        self.engines[position] = engine
        # With a grace: calls still running on the old channel end by themselves (an engine that died
        # fails them, one that lost its weights refuses them) and are handled as failures; closing at
        # once would cancel them, which reads as a cancellation of the whole generation.
        asyncio.ensure_future(old.channel.close(grace=self.timeout_s))
        return engine

    def add(self, address: str) -> Engine:
        """A new engine: syncing until a push admits it."""
        engine = self._connect(max((e.index for e in self.engines), default=-1) + 1, address)
        engine.healthy, engine.syncing = False, True
        self.engines.append(engine)
        return engine

    async def remove(self, engine: Engine) -> None:
        """Out of the pool; calls still open on it end first (a Generate whose last sample arrived
        still has its status to read: closing without a grace would cancel it, and with it the step)."""
        self.engines.remove(engine)
        await engine.channel.close(grace=self.timeout_s)

    def engine(self, index: int) -> Engine:
        return next(e for e in self.engines if e.index == index)

    def admitted(self) -> list[Engine]:
        return [e for e in self.engines if e.healthy]

    async def close(self) -> None:
        await asyncio.gather(*(e.channel.close() for e in self.engines), return_exceptions=True)

    async def _least_loaded(self) -> Engine:
        while True:
            healthy = [e for e in self.engines if e.healthy and not e.draining]
            if healthy:
                return min(healthy, key=lambda e: (e.outstanding, e.index))
            if self.wait_for_engine is None:
                raise RuntimeError("every rollout engine failed; see the errors above and the services' logs")
            await self.wait_for_engine()

    async def generate(self, prompts: list[Prompt], n: int, sampling: rollout_pb2.SamplingOptions,
                       expected_version: int | None, seed: int, step: int, round_index: int,
                       on_sample: Callable[[Prompt, rollout_pb2.GenerateResponse], Awaitable[None] | None],
                       on_retry: Callable[[Prompt], None] | None = None, chunk_prompts: int = 0) -> None:
        """Generates n samples for every prompt; returns once all have been handed to on_sample.

        on_retry(prompt) is called before a prompt is generated again after an engine failure
        (the caller drops that prompt's samples received so far). expected_version None: any weight
        version may generate (--async_train), else the engines must hold that one.
        """
        if not prompts:
            return
        size = chunk_prompts or max(1, math.ceil(len(prompts) / (2 * len(self.engines))))
        chunks = [prompts[i:i + size] for i in range(0, len(prompts), size)]
        pending = [(i, chunk) for i, chunk in enumerate(chunks)]
        failures = 0

        async def run_chunk(chunk_index: int, chunk: list[Prompt]) -> None:
            nonlocal failures
            engine = await self._least_loaded()
            sampling_i = rollout_pb2.SamplingOptions()
            sampling_i.CopyFrom(sampling)
            sampling_i.seed = chunk_seed(seed, step, round_index, chunk_index)
            request = rollout_pb2.GenerateRequest(
                request_id=f"step{step}-r{round_index}-c{chunk_index}", n=n, sampling=sampling_i,
                expected_weight_version=expected_version,  # None leaves the field unset
                prompts=[rollout_pb2.Prompt(prompt_id=p.uid, token_ids=to_proto(torch.tensor(p.token_ids, dtype=torch.int64)))
                         for p in chunk])
            by_id = {p.uid: p for p in chunk}
            received: dict[str, int] = {p.uid: 0 for p in chunk}
            engine.outstanding += len(chunk) * n
            remaining = len(chunk) * n
            try:
                async for sample in engine.stub.Generate(request, timeout=self.timeout_s):
                    remaining -= 1
                    engine.outstanding -= 1
                    received[sample.prompt_id] += 1
                    result = on_sample(by_id[sample.prompt_id], sample)
                    if asyncio.iscoroutine(result):
                        await result
            except grpc.aio.AioRpcError as exc:
                # An engine that lost its weights (restarted faster than a health check notices:
                # same address, initial weights) is out until a push admits it again, like a dead one.
                lost_weights = (exc.code() == grpc.StatusCode.FAILED_PRECONDITION and self.on_lost_weights is not None
                                and (exc.details() or "").startswith("expected_weight_version")
                                and self.on_lost_weights(engine, exc.details()))
                if not lost_weights and exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise RuntimeError(f"rollout {engine.index} ({engine.address}) Generate {request.request_id} "
                                       f"failed: {exc.code().name}: {exc.details()}") from None
                engine.healthy = False
                failures += 1
                log_event(_log, "rollout.engine_failed", engine=engine.index, address=engine.address,
                          error=exc.details(), request_id=request.request_id)
                if self.wait_for_engine is None and failures > 2 * len(self.engines):
                    raise RuntimeError(f"rollout engines keep failing (last: {engine.address}: {exc.details()})") from None
                unfinished = [p for p in chunk if received[p.uid] < n]
                lost = sum(received[p.uid] for p in unfinished)
                self.lost_samples += lost
                if self.on_prompts_moved is not None and unfinished:
                    self.on_prompts_moved(engine, request.request_id, len(unfinished), lost)
                for p in unfinished:
                    if on_retry is not None:
                        on_retry(p)
                if unfinished:
                    await run_chunk(chunk_index, unfinished)
            finally:
                engine.outstanding -= remaining

        await gather_or_cancel([run_chunk(i, chunk) for i, chunk in pending])

    async def model_infos(self, engines: list[Engine] | None = None) -> list[rollout_pb2.GetModelInfoResponse]:
        engines = self.admitted() if engines is None else engines
        return list(await asyncio.gather(*(e.stub.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=60.0)
                                           for e in engines)))

    async def sleep(self, level: int = 1, engines: list[Engine] | None = None) -> None:
        engines = self.admitted() if engines is None else engines
        await asyncio.gather(*(e.stub.Sleep(rollout_pb2.SleepRequest(level=level), timeout=300.0) for e in engines))

    async def wake_up(self, tags: tuple[str, ...] = (), engines: list[Engine] | None = None) -> None:
        engines = self.admitted() if engines is None else engines
        await asyncio.gather(*(e.stub.WakeUp(rollout_pb2.WakeUpRequest(tags=list(tags)), timeout=300.0)
                               for e in engines))
