"""The weight-transfer protocol: the learner's rank 0 sends the actor's weights to the rollout engines.

    build a group   InitWeightTransfer on the learner and on every member engine (one gloo/NCCL
                    group, or CUDA IPC handles when colocated); rebuilt from scratch whenever its
                    membership changes: a group cannot lose or gain a member in place
    push            PushWeights streams chunks from the learner; each chunk goes to every engine
                    (UpdateWeights) and is acknowledged back to the learner before the next one
    verify          every engine answers the pushed version and the learner's checksum, and
                    GetModelInfo says READY: "did the weights arrive" is never a matter of faith. An
                    engine's checksum is of what its model holds, read back from it after loading
                    (services/rollout/readback.py); a tensor it holds otherwise than it received
                    fails its UpdateWeights with the tensor named, and the run stops with that error

The run's version bookkeeping (state, control API, metrics) is the loop's (trainer.push_weights).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from rlmesh.common.v1 import common_pb2
from rlmesh.learner.v1 import learner_pb2
from rlmesh.rollout.v1 import rollout_pb2
from services.common.crash_points import crash_point
from services.common.log import get_logger, log_event
from services.common.tasks import gather_or_cancel
from services.coordinator.loop.run_state import WeightSyncError

_log = get_logger("coordinator")
BACKENDS = {"gloo": rollout_pb2.WEIGHT_BACKEND_GLOO, "nccl": rollout_pb2.WEIGHT_BACKEND_NCCL,
            "ipc": rollout_pb2.WEIGHT_BACKEND_IPC}
# How long the members of a group wait for each other at build time and in a collective.
GROUP_TIMEOUT_S = 300.0


class WeightSync:
    """One learner and the engines of its current weight group.

    `learner` is the learner's stub and `learner_info` its GetInfo reply; the loop sets both (again
    after a learner restart). `master` is the rendezvous host:port (--weight_sync_master), or None for
    the learner's rank-0 host and a port the placement picks.
    """

    def __init__(self, config, pool, master: tuple[str, int] | None = None):
        self.config, self.pool, self.master = config, pool, master
        self.learner = None
        self.learner_info: learner_pb2.GetInfoResponse | None = None
        self.weights_dtype = common_pb2.DTYPE_FLOAT32
        self.group_engines: list = []  # the members of the current group; [] = none usable

    def backend(self) -> str:
        """--vllm_sync_backend, or what the learner's devices allow: gloo on CPU, nccl (ipc when
        colocated) on GPUs. The learner knows, also for services this run did not start."""
        cfg = self.config
        if cfg.vllm_sync_backend != "auto":
            return cfg.vllm_sync_backend
        if self.learner_info.dist_backend != "nccl":
            return "gloo"
        return "ipc" if cfg.colocate_all_models else "nccl"

    def is_group(self, engines: list) -> bool:
        """Whether `engines` (in order) are the current group's members."""
        return [id(e) for e in engines] == [id(e) for e in self.group_engines]

    def drop_group(self) -> None:
        """The group is broken (a member died, a push failed): the next push builds a new one."""
        self.group_engines = []

    async def build_group(self, engines: list) -> None:
        """A new weight group of the learner and `engines`."""
        self.group_engines = []  # stale until the new group is complete
        backend = self.backend()
        if backend == "ipc":
            await asyncio.gather(
                self.learner.InitWeightTransfer(learner_pb2.InitWeightTransferRequest(backend=BACKENDS[backend]),
                                                timeout=120.0),
                *(e.stub.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(backend=BACKENDS[backend]),
                                            timeout=120.0) for e in engines))
            self.group_engines = list(engines)
            return
        world_size = 1 + sum(e.tensor_parallel_size for e in engines)
        # Unique per group: with a fixed rendezvous port (--weight_sync_master) the store of the group
        # being replaced may still answer, and a rank that reached it under the same name would read
        # the old group's gloo addresses (a name from the second of the build repeated within a second).
        group = f"rlmesh-weights-{uuid.uuid4().hex[:16]}"
        host, port = self.master or (self.learner_info.rank0_host, 0)
        if not port:
            raise RuntimeError("no port for the weight-transfer rendezvous; set --weight_sync_master HOST:PORT "
                               "(a free port on the learner's rank-0 host that the rollout engines can reach)")
        calls = [self.learner.InitWeightTransfer(learner_pb2.InitWeightTransferRequest(
            backend=BACKENDS[backend], master_address=host, master_port=port, world_size=world_size,
            group_name=group, timeout_s=GROUP_TIMEOUT_S), timeout=GROUP_TIMEOUT_S + 60.0)]
        offset = 1
        for engine in engines:
            calls.append(engine.stub.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(
                backend=BACKENDS[backend], master_address=host, master_port=port, world_size=world_size,
                rank_offset=offset, group_name=group, timeout_s=GROUP_TIMEOUT_S), timeout=GROUP_TIMEOUT_S + 60.0))
            offset += engine.tensor_parallel_size
        await gather_or_cancel(calls)
        crash_point("coordinator.push.group_built")
        self.group_engines = list(engines)
        log_event(_log, "weights.group_ready", backend=backend, master=f"{host}:{port}", world_size=world_size)

    async def push(self, engines: list, version: int) -> dict:
        """Pushes the actor's weights as `version` to `engines` (the group's members) and verifies
        version and checksum on each; returns the push's metrics."""
        t0 = time.monotonic()
        timeout = self.config.rpc_timeout_s
        requests: asyncio.Queue = asyncio.Queue()
        await requests.put(learner_pb2.PushWeightsRequest(start=learner_pb2.PushWeightsStart(
            version=version, weights_dtype=self.weights_dtype)))

        async def request_iter():
            while True:
                item = await requests.get()
                if item is None:
                    return
                yield item

        call = self.learner.PushWeights(request_iter(), timeout=timeout)
        replies: list[rollout_pb2.UpdateWeightsResponse] = []
        done = None
        failed: list = []  # the engine whose UpdateWeights failed, for the error

        async def update_engine(engine, update):
            try:
                return await engine.stub.UpdateWeights(update, timeout=timeout)
            except grpc.aio.AioRpcError:
                failed.append(engine)
                raise
        try:
            async for message in call:
                if message.HasField("chunk"):
                    update = message.chunk.update
                    update.pause_generation = self.config.partial_rollout  # running generations continue on it
                    crash_point("coordinator.push.chunk_from_learner")
                    replies = await gather_or_cancel([update_engine(e, update) for e in engines])
                    crash_point("coordinator.push.chunk_relayed")
                    await requests.put(learner_pb2.PushWeightsRequest(
                        ack=learner_pb2.PushWeightsAck(chunk_index=update.chunk_index)))
                else:
                    done = message.done
                    await requests.put(None)
        except grpc.aio.AioRpcError as exc:
            # An engine usually fails because the sender did: report the learner's own error first.
            # The request stream ends here: a learner that sent its chunk and waits for the ack ends
            # the call at once (INVALID_ARGUMENT: no ack, its ranks released), where it would
            # otherwise hold it until the wait below runs out. That code is this side's doing, not
            # the learner's failure (one before any chunk is `exc` itself).
            await requests.put(None)
            learner_error = ""
            try:
                code = await asyncio.wait_for(call.code(), 5.0)
                if code not in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT):
                    learner_error = f"the learner's PushWeights failed: {code.name}: {await call.details()}; "
            except (asyncio.TimeoutError, grpc.aio.AioRpcError):
                call.cancel()
            engine = f"rollout {failed[0].index} ({failed[0].address}): " if failed else ""
            raise WeightSyncError(f"weight push of version {version} failed: {learner_error}{engine}"
                                  f"{exc.code().name}: {exc.details()}") from None
        finally:
            await requests.put(None)
        if done is None:
            raise WeightSyncError("PushWeights ended without a 'done' message")
        for engine, reply in zip(engines, replies):
            if reply.weight_version != version or reply.weights_checksum != done.weights_checksum:
                raise WeightSyncError(f"rollout {engine.index} ({engine.address}) answered version "
                                      f"{reply.weight_version} checksum {reply.weights_checksum!r} to a push of version "
                                      f"{version} checksum {done.weights_checksum!r}: the weights it holds (its "
                                      "checksum is read back from its model) are not the ones the learner sent")
        await self.verify(version, done.weights_checksum, engines)
        crash_point("coordinator.push.version_committed")
        return {"weights/version": version, "weights/push_s": time.monotonic() - t0, "weights/bytes": done.bytes,
                "weights/learner_push_s": done.duration_s}

    async def verify(self, version: int, checksum: str, engines: list) -> None:
        """GetModelInfo on every engine: the pushed version and checksum, and ready to generate."""
        infos = await self.pool.model_infos(engines)
        for engine, info in zip(engines, infos):
            if (info.weight_version != version or info.weights_checksum != checksum
                    or info.weights_state != rollout_pb2.WEIGHTS_STATE_READY):
                raise WeightSyncError(
                    f"rollout {engine.index} ({engine.address}) reports version {info.weight_version}, checksum "
                    f"{info.weights_checksum!r}, state {rollout_pb2.WeightsState.Name(info.weights_state)} "
                    f"({info.weights_state_detail}); the learner pushed version {version} checksum {checksum!r}")
            engine.weight_version = version
