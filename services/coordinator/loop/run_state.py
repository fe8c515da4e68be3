"""The state of one run that the loop and the fleet share.

`RunControl` is the one object the training loop and the control API share: the loop writes the
step, phase and state into it and checks it between steps (pause, stop); the control servicer
(services/coordinator/fleet/control.py) reads it and sets the requests. Everything runs on the
coordinator's event loop, so no locks are needed. `Endpoints` is what the placement hands the loop;
`WeightSyncError` is a failed push as the fleet's recovery sees it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from rlmesh.coordinator.v1 import coordinator_pb2 as pb
from services.coordinator.loop.metrics import MetricsLog


class WeightSyncError(RuntimeError):
    """An engine does not hold the weights the learner pushed (the fleet's recovery tells it apart)."""


@dataclasses.dataclass
class Endpoints:
    """host:port of every service the loop talks to."""

    rollout: list[str]
    reward: list[str]  # RewardService (Score)
    reference: list[str]  # ReferenceService (RefLogProbs); may be the same processes as reward
    learner: str  # the learner's rank 0


@dataclasses.dataclass
class ServiceEntry:
    role: str
    index: int
    address: str
    weight_version: int = 0
    state: str = "serving"  # the supervisor's view (services/coordinator/fleet/supervisor.py)
    restarts: int = 0


@dataclasses.dataclass
class RunShape:
    """Instances in use against planned, per role (the fleet's elastic.py keeps it current)."""

    rollout_engines: tuple[int, int] = (0, 0)  # (now, planned)
    learner_ranks: tuple[int, int] = (0, 0)
    reward_instances: tuple[int, int] = (0, 0)
    reference_instances: tuple[int, int] = (0, 0)
    reshapes: int = 0
    elastic: bool = False
    left_out: tuple[str, ...] = ()


class RunControl:
    """Shared state of one run: what the loop is doing and what the API asked for."""

    def __init__(self, placement: str):
        self.placement = placement
        self.state = pb.RUN_STATE_STARTING
        self.phase = pb.PHASE_STARTING
        self.global_step = 0
        self.total_steps = 0
        self.episode = 1
        self.last_checkpoint_step = 0
        self.weight_version = 0
        self.error = ""
        self.run_dir = ""
        self.started = time.monotonic()
        self.services: list[ServiceEntry] = []
        self.shape = RunShape()
        self.refresh_services = None  # rebuilds `services` from the supervisor (set once it runs)
        self.scaler = None  # services/coordinator/fleet/scaling.py Scaler, once the run is supervised
        self.metrics: MetricsLog | None = None
        self.metrics_ready = asyncio.Event()  # set once `metrics` exists (after a resume is loaded)
        self.stop_requested = False
        self.stop_checkpoint = True
        self._resume = asyncio.Event()
        self._resume.set()
        self.finished = asyncio.Event()

    # ---- requests from the API ----
    def request_pause(self) -> None:
        self._resume.clear()

    def request_resume(self) -> None:
        self._resume.set()
        if self.state == pb.RUN_STATE_PAUSED:
            self.state = pb.RUN_STATE_RUNNING

    def request_stop(self, checkpoint: bool = True) -> None:
        self.stop_requested = True
        self.stop_checkpoint = self.stop_checkpoint and checkpoint
        self._resume.set()  # a paused run must wake up to stop
        if self.state in (pb.RUN_STATE_RUNNING, pb.RUN_STATE_PAUSED, pb.RUN_STATE_STARTING):
            self.state = pb.RUN_STATE_STOPPING

    @property
    def pause_requested(self) -> bool:
        return not self._resume.is_set()

    # ---- used by the loop ----
    def set_phase(self, phase: int) -> None:
        self.phase = phase

    async def wait_while_paused(self) -> None:
        """Between steps: blocks while a pause is requested (the state reads PAUSED meanwhile)."""
        if self._resume.is_set():
            return
        self.state, self.phase = pb.RUN_STATE_PAUSED, pb.PHASE_IDLE
        await self._resume.wait()
        if not self.stop_requested:
            self.state = pb.RUN_STATE_RUNNING

    def attach_metrics(self, metrics: MetricsLog) -> None:
        self.metrics = metrics
        self.metrics_ready.set()

    def finish(self, error: str = "") -> None:
        self.error = error
        self.state = pb.RUN_STATE_FAILED if error else pb.RUN_STATE_FINISHED
        self.phase = pb.PHASE_IDLE
        self.finished.set()
