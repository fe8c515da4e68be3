"""The coordinator's control API (rlmesh.coordinator.v1.CoordinatorService), served from the
run state the loop keeps (services/coordinator/loop/run_state.py: RunControl)."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.coordinator.v1 import coordinator_pb2 as pb
from rlmesh.coordinator.v1 import coordinator_pb2_grpc
from services.common.client import make_channel
from services.common.errors import ServiceError, handle_errors
from services.coordinator.loop.run_state import RunControl, RunShape

SERVICE_NAME = "rlmesh.coordinator.v1.CoordinatorService"


async def _health(address: str, timeout_s: float = 3.0) -> tuple[int, str]:
    try:
        async with make_channel(address, default_timeout_s=timeout_s) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return pb.SERVICE_HEALTH_UNREACHABLE, f"{exc.code().name}: {exc.details()}"
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return pb.SERVICE_HEALTH_SERVING, ""
    return pb.SERVICE_HEALTH_NOT_SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, control: RunControl):
        self.control = control

    @handle_errors
    async def GetStatus(self, request, context):
        c = self.control
        if c.refresh_services is not None:
            c.refresh_services()
        # The list and shape as they are now: the health checks below take time, while restarts change them.
        entries, shape = list(c.services), _shape_message(c.shape)
        checks = await asyncio.gather(*(_health(s.address) for s in entries))
        services = [pb.ServiceStatus(role=s.role, index=s.index, address=s.address, health=health, detail=detail,
                                     weight_version=s.weight_version, state=s.state, restarts=s.restarts)
                    for s, (health, detail) in zip(entries, checks)]
        return pb.GetStatusResponse(global_step=c.global_step, total_steps=c.total_steps, episode=c.episode,
                                    phase=c.phase, state=c.state, services=services, run_dir=c.run_dir,
                                    last_checkpoint_step=c.last_checkpoint_step, weight_version=c.weight_version,
                                    elapsed_s=time.monotonic() - c.started, error=c.error, placement=c.placement,
                                    shape=shape)

    @handle_errors
    async def StreamMetrics(self, request, context):
        c = self.control
        # A client may connect while the services are still starting: wait for the metrics log.
        ready = asyncio.ensure_future(c.metrics_ready.wait())
        ended = asyncio.ensure_future(c.finished.wait())
        await asyncio.wait({ready, ended}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        ended.cancel()
        if c.metrics is None:
            return
        queue = c.metrics.subscribe()
        try:
            if request.since_step >= 0:
                for record in list(c.metrics.history):
                    if record["global_step"] > request.since_step:
                        yield _metrics_message(record)
            while True:
                record = await queue.get()  # None once the run has ended (MetricsLog.close)
                if record is None:
                    break
                if record["global_step"] > request.since_step:
                    yield _metrics_message(record)
        finally:
            c.metrics.unsubscribe(queue)

    @handle_errors
    async def Pause(self, request, context):
        c = self.control
        if c.state in (pb.RUN_STATE_RUNNING, pb.RUN_STATE_STARTING, pb.RUN_STATE_PAUSED):
            c.request_pause()
        return pb.PauseResponse(state=c.state, pause_after_step=c.global_step + (c.state != pb.RUN_STATE_PAUSED))

    @handle_errors
    async def Resume(self, request, context):
        self.control.request_resume()
        return pb.ResumeResponse(state=self.control.state)

    @handle_errors
    async def Stop(self, request, context):
        c = self.control
        if not c.finished.is_set():
            c.request_stop(checkpoint=not request.skip_checkpoint)
        final_step = c.global_step + (c.phase not in (pb.PHASE_IDLE, pb.PHASE_STARTING))
        if request.wait:
            await c.finished.wait()
            final_step = c.global_step
        checkpoint_step = c.last_checkpoint_step if c.finished.is_set() and c.stop_checkpoint else 0
        return pb.StopResponse(state=c.state, final_step=final_step, checkpoint_step=checkpoint_step)


    @handle_errors
    async def Scale(self, request, context):
        from services.coordinator.fleet.scaling import ScaleError

        c = self.control
        if c.scaler is None or c.finished.is_set():
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "Scale: the run is not running yet (or has ended); call again once GetStatus "
                               "reports RUNNING")
        try:
            addresses, added, removed = await c.scaler.scale(request.role, request.replicas,
                                                             list(request.add_addresses), list(request.remove_addresses))
        except ScaleError as exc:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"Scale: {exc}") from None
        return pb.ScaleResponse(addresses=addresses, added=added, removed=removed)


def _shape_message(shape: RunShape) -> pb.RunShape:
    (engines, planned_engines), (ranks, planned_ranks) = shape.rollout_engines, shape.learner_ranks
    (rewards, planned_rewards), (references, planned_references) = shape.reward_instances, shape.reference_instances
    return pb.RunShape(rollout_engines=engines, planned_rollout_engines=planned_engines, learner_ranks=ranks,
                       planned_learner_ranks=planned_ranks, reward_instances=rewards,
                       planned_reward_instances=planned_rewards, reference_instances=references,
                       planned_reference_instances=planned_references, reshapes=shape.reshapes,
                       elastic=shape.elastic, left_out=list(shape.left_out))


def _metrics_message(record: dict) -> pb.StreamMetricsResponse:
    values = {k: float(v) for k, v in record.items() if k not in ("global_step", "unix_time")}
    return pb.StreamMetricsResponse(global_step=int(record["global_step"]), unix_time=float(record["unix_time"]),
                                    metrics=values)


def add_to_runner(runner, control: RunControl) -> CoordinatorServicer:
    servicer = CoordinatorServicer(control)
    runner.add(coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server, servicer, SERVICE_NAME)
    return servicer
