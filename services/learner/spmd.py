"""One learner = N torch.distributed ranks; rank 0 serves gRPC and drives the others.

Every call is a command that runs on all ranks (each with its own share of the data), so the
ranks meet in the same collectives in the same order. Rank 0 hosts the rendezvous TCPStore at
master_addr:master_port; the process group rendezvouses on it, and so does the control plane:

    rank 0 (driver)                                  rank k > 0 (serve_worker)
    ---------------                                  -------------------------
    send (name, payload_k) over the control group -> blocks in recv while idle
    run its own share in the compute thread          run its share
    poll the store for every rank's status      <-   store: status/{seq}/{k} = ok | error
    on "ok": recv rank k's result               <-   send result over the control group

The control group is a gloo group of its own (also on GPU), separate from the group DeepSpeed
uses. Statuses go through the store so that rank 0 sees a failure on any rank as soon as it
happens, even while other ranks sit in a collective waiting for the failed one: the call fails
at once with that rank's error instead of waiting for a timeout. Such a failure can leave the
ranks out of step (some inside a collective, some not), so the group is declared broken: the
learner stops serving and exits (code 3), and the coordinator restarts it and loads the last
checkpoint. The exception is a deliberate ServiceError (bad input found on a rank, a weight push
to a vanished engine): those are raised where no other rank waits, so once every rank has
finished the call fails with that status and the learner serves on. Every rank also bumps a heartbeat counter
in the store; a rank whose counter stops moving is declared dead, and a worker whose store
connection breaks (rank 0 gone) exits, so no rank outlives the service or hangs it.

Work nobody waits for stops. When the caller of a command goes away (its deadline passed, it
cancelled), rank 0 asks the ranks to stop at a unit boundary (an optimizer step of TrainActor /
TrainCritic, a forward pass of LogProbs / Values; see CancelPoint): every rank stops before the
same unit, so they stay in step and the learner serves the next call at once. The driver holds
the command lock until the ranks have stopped; if they do not within cancel_grace_s (one unit
running longer than that), the learner reports NOT_SERVING in health until they do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import datetime
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

import grpc
import torch
import torch.distributed as dist

from services.common import rendezvous
from services.common.crash_points import crash_point
from services.common.errors import ServiceError
from services.common.log import get_logger, log_event

log = get_logger("learner")

HEARTBEAT_INTERVAL_S = 1.0
SHUTDOWN = "shutdown"


class CommandCancelled(ServiceError):
    """Raised on every rank at the same unit when the caller of the command has gone."""

    def __init__(self, unit: int, total: int, what: str):
        super().__init__(grpc.StatusCode.CANCELLED, f"stopped before {what} {unit + 1} of {total}: the caller "
                         "cancelled or its deadline passed")


class CancelPoint:
    """Where a running command may stop: the same unit on every rank.

    Rank 0, once asked (`requested`, set from its event loop), picks stop_at = its current unit + 1
    and writes it to the store. Units are separated by collectives (gradient reduction, ZeRO-3's
    parameter gathers), so no other rank can have started unit stop_at before rank 0 wrote it, and
    every rank reads it before starting that unit. (Without collectives, as in ZeRO-1/2 forward
    passes, the ranks need not agree and each just stops where it sees it.)
    """

    def __init__(self):
        self.store: dist.TCPStore | None = None
        self.seq = 0
        self.rank = 0
        self.requested = threading.Event()
        self.stop_at: int | None = None

    def begin(self, store: dist.TCPStore | None, seq: int, rank: int) -> None:
        self.store, self.seq, self.rank, self.stop_at = store, seq, rank, None
        self.requested.clear()

    def check(self, unit: int, total: int, what: str) -> None:
        """Call before starting unit `unit` (0-based) of `total`; raises CommandCancelled to stop."""
        key = f"stop/{self.seq}"
        if self.stop_at is None:
            if self.rank == 0 and self.requested.is_set():
                self.stop_at = unit + 1 if self.store is not None else unit
                if self.store is not None:
                    self.store.set(key, str(self.stop_at))
            elif self.rank != 0 and self.store is not None and self.store.check([key]):
                self.stop_at = int(self.store.get(key))
        if self.stop_at is not None and unit >= self.stop_at:
            raise CommandCancelled(unit, total, what)


# One per process: each rank runs one command at a time.
CANCEL = CancelPoint()


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """Where this process sits in the learner's rank group."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    backend: str  # "nccl" or "gloo"
    spawn_local: bool  # rank 0 starts ranks 1..world_size-1 itself, on this machine


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_rank_spec(rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int,
                      num_gpus: int) -> RankSpec:
    """Flags win over the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT, as torchrun, the deepspeed launcher or a Ray actor set them). With neither, this
    process is rank 0 of num_gpus ranks and starts the others on this machine."""
    env = os.environ
    external = world_size > 0 or "WORLD_SIZE" in env
    if world_size <= 0:
        world_size = int(env.get("WORLD_SIZE", num_gpus))
    if rank < 0:
        rank = int(env.get("RANK", 0))
    if local_rank < 0:
        local_rank = int(env.get("LOCAL_RANK", rank))
    master_addr = master_addr or env.get("MASTER_ADDR", "127.0.0.1")
    if master_port <= 0:
        master_port = int(env.get("MASTER_PORT", 0)) or (free_port(master_addr) if rank == 0 else 0)
    if master_port <= 0:
        raise ValueError(f"rank {rank}: no --master_port and no MASTER_PORT in the environment; "
                         "give every rank the port rank 0 listens on")
    if not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank} is outside --world_size {world_size}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return RankSpec(rank, world_size, local_rank, master_addr, master_port, backend,
                    spawn_local=(not external and world_size > 1))


def spawn_local_ranks(spec: RankSpec, argv: list[str]) -> list[subprocess.Popen]:
    """Starts ranks 1..world_size-1 as `python -m services.learner <argv>` with the rank in env."""
    procs = []
    for rank in range(1, spec.world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR=spec.master_addr, MASTER_PORT=str(spec.master_port))
        procs.append(subprocess.Popen([sys.executable, "-m", "services.learner", *argv], env=env))
    return procs


# ----------------------------------------------------------------------------------------------
# Errors crossing ranks


@dataclasses.dataclass
class RankFailure:
    """An exception raised on one rank, in a form that pickles."""

    rank: int
    type_name: str
    message: str
    traceback: str
    code: str = ""  # grpc.StatusCode name for a ServiceError, else ""

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> "RankFailure":
        code = exc.code.name if isinstance(exc, ServiceError) else ""
        message = exc.message if isinstance(exc, ServiceError) else str(exc)
        return cls(rank, type(exc).__name__, message, traceback.format_exc(), code)


def store_message(kind: str, value) -> bytes:
    """A status or setup message for the rendezvous store, as JSON: the store has no authentication
    (anyone who reaches its port can write keys; on one machine it listens on loopback only), so
    nothing read from it is unpickled, which would run whatever code a forged key carried."""
    return json.dumps([kind, dataclasses.asdict(value) if isinstance(value, RankFailure) else value]).encode()


def read_store_message(data: bytes) -> tuple[str, object]:
    kind, value = json.loads(data)
    return kind, RankFailure(**value) if kind == "error" else value


class GroupError(Exception):
    """A command failed on some rank. `fatal`: the ranks may be out of step; the learner must stop."""

    def __init__(self, failure: RankFailure, fatal: bool):
        self.failure = failure
        self.fatal = fatal
        where = f"rank {failure.rank}" if failure.rank >= 0 else "learner ranks"
        super().__init__(f"{where}: {failure.type_name}: {failure.message}")

    def to_service_error(self) -> ServiceError:
        if not self.fatal and self.failure.code:
            return ServiceError(grpc.StatusCode[self.failure.code], self.failure.message)
        suffix = ("; the learner's ranks may be out of step, so the learner is shutting down: restart it "
                  "and LoadCheckpoint" if self.fatal else "")
        return ServiceError(grpc.StatusCode.INTERNAL, f"{self}{suffix}")


# ----------------------------------------------------------------------------------------------
# Wire helpers (control group)


def _send_bytes(data: bytes, dst: int, group, tag: int) -> None:
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.send(size, dst, group=group, tag=tag)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group, tag=tag)


def _recv_bytes(src: int, group, tag: int) -> bytes:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group, tag=tag)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src, group=group, tag=tag)
    return buf.numpy().tobytes()


def connect_store(spec: RankSpec, timeout_s: float) -> dist.TCPStore:
    """Rank 0 starts the store server; the others connect (retrying until timeout_s)."""
    return rendezvous.store(spec.master_addr, spec.master_port, spec.world_size, is_master=(spec.rank == 0),
                            timeout=datetime.timedelta(seconds=timeout_s))


def join_process_group(spec: RankSpec, store: dist.TCPStore, timeout_s: float):
    """init_process_group on the shared store (collectives time out after timeout_s), DeepSpeed's comm
    layer on top, and the gloo control group. Returns the control group. Collective: all ranks."""
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.local_rank)
    # DeepSpeed reads the launcher's variables; set them whichever way the ranks were started.
    os.environ.update(RANK=str(spec.rank), LOCAL_RANK=str(spec.local_rank), WORLD_SIZE=str(spec.world_size),
                      MASTER_ADDR=spec.master_addr, MASTER_PORT=str(spec.master_port))
    timeout = datetime.timedelta(seconds=timeout_s)
    with rendezvous.gloo_on_loopback(spec.master_addr):  # ranks on one machine: nothing listens outside it
        dist.init_process_group(spec.backend, store=dist.PrefixStore("pg", store), rank=spec.rank,
                                world_size=spec.world_size, timeout=timeout)
        import deepspeed

        deepspeed.init_distributed(dist_backend=spec.backend, timeout=timeout)
        # Long timeout: a worker waits in recv on this group between calls, for as long as the
        # service is idle. A dead peer still surfaces at once (the connection closes).
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))


def _heartbeat(spec: RankSpec, stop: threading.Event, exit_on_loss: bool) -> None:
    """Bumps hb/{rank} every second on a connection of its own; exits the process when the store
    (rank 0) is gone, even while the main thread is stuck in a collective."""
    try:
        store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=30))
        while not stop.is_set():
            store.add(f"hb/{spec.rank}", 1)
            stop.wait(HEARTBEAT_INTERVAL_S)
    except Exception as exc:  # noqa: BLE001 - any store failure means rank 0 is gone
        if exit_on_loss and not stop.is_set():
            log_event(log, "rank.orphaned", rank=spec.rank, error=str(exc)[:200], level=40)
            os._exit(3)


def start_heartbeat(spec: RankSpec) -> threading.Event:
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(spec, stop, spec.rank != 0), daemon=True,
                     name=f"heartbeat-{spec.rank}").start()
    return stop


# ----------------------------------------------------------------------------------------------
# Worker ranks


def serve_worker(spec: RankSpec, store: dist.TCPStore, setup: Callable[[], tuple[object, Callable]]) -> None:
    """The loop of ranks 1..N-1: receive a command, run it, report; until "shutdown".

    setup() runs on the first command ("setup"): it joins the process group and builds the
    models, and returns (control group, execute(name, payload) -> result).
    """
    start_heartbeat(spec)
    group = None
    execute: Callable | None = None
    seq = 0
    while True:
        seq += 1
        if seq == 1:
            name, payload = _wait_setup(store, spec)
        else:
            name, payload = pickle.loads(_recv_bytes(0, group, tag=seq))
        if name == SHUTDOWN:
            store.set(f"status/{seq}/{spec.rank}", store_message("ok", 0))
            return
        try:
            if seq == 1:
                group, execute = setup()
                result = None
            else:
                CANCEL.begin(store, seq, spec.rank)
                result = execute(name, payload)
            data = pickle.dumps(result)
            if seq > 1:
                crash_point("learner.rank.result_ready")
            store.set(f"status/{seq}/{spec.rank}", store_message("ok", len(data)))
            if seq > 1:  # rank 0 collects setup's statuses only
                _send_bytes(data, 0, group, tag=seq)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the call
            failure = RankFailure.from_exception(spec.rank, exc)
            log_event(log, "rank.command_failed", rank=spec.rank, command=name, error=failure.message[:300],
                      level=40)
            store.set(f"status/{seq}/{spec.rank}", store_message("error", failure))
            if group is None:  # setup failed: there is no process group to continue with
                return


def _wait_setup(store: dist.TCPStore, spec: RankSpec) -> tuple[str, object]:
    """The setup command comes through the store (the control group does not exist yet)."""
    key = f"setup/{spec.rank}"
    while not store.check([key]):
        time.sleep(0.05)
    return read_store_message(store.get(key))


# ----------------------------------------------------------------------------------------------
# Rank 0


class RankGroupDriver:
    """Runs commands on every rank from rank 0 (see the module docstring)."""

    def __init__(self, spec: RankSpec, store: dist.TCPStore, procs: list[subprocess.Popen],
                 startup_timeout_s: float, heartbeat_timeout_s: float, cancel_grace_s: float = 30.0):
        self.spec = spec
        self.store = store
        self.procs = procs
        self.startup_timeout_s = startup_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.cancel_grace_s = cancel_grace_s
        # Called with True when a cancelled command's ranks have not stopped within cancel_grace_s,
        # and with False once they have (the servicer sets health NOT_SERVING / SERVING).
        self.on_wedged: Callable[[bool], None] = lambda wedged: None
        # Rank 0's compute thread writes the stop unit on a connection of its own.
        self._cancel_store = None
        # One persistent thread runs rank 0's share of every command (CUDA's current device is per
        # thread); another moves control-plane bytes so the event loop never blocks.
        self.compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rank0-compute")
        self.io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rank0-control")
        self.group = None
        self.execute: Callable | None = None
        self.seq = 0
        self.broken: GroupError | None = None
        self._lock = asyncio.Lock()
        self._heartbeats: dict[int, tuple[int, float]] = {}
        self._last_heartbeat_check = 0.0

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    async def setup(self, setup: Callable[[], tuple[object, Callable]]) -> None:
        """Runs setup() on every rank (joins the process group, builds the models)."""

        def run_own():
            self.group, self.execute = setup()

        async with self._lock:
            self.seq = 1
            for rank in range(1, self.world_size):
                self.store.set(f"setup/{rank}", store_message("setup", None))
            loop = asyncio.get_running_loop()
            own = loop.run_in_executor(self.compute, _capture(run_own, 0))
            await self._collect(1, own, "setup", startup=True)

    async def run(self, name: str, payloads: list, timeout_s: float | None = None) -> list:
        """Runs command `name` on every rank, rank r with payloads[r]; returns every rank's result.

        Raises GroupError (fatal or not) when a rank fails; commands run one at a time.
        """
        if len(payloads) != self.world_size:
            raise ValueError(f"{name}: {len(payloads)} payloads for {self.world_size} ranks")
        async with self._lock:
            if self.broken is not None:
                raise self.broken
            self.seq += 1
            seq = self.seq
            if self.world_size > 1 and self._cancel_store is None:
                self._cancel_store = dist.TCPStore(self.spec.master_addr, self.spec.master_port, self.world_size,
                                                   is_master=False, timeout=datetime.timedelta(seconds=30))
            CANCEL.begin(self._cancel_store, seq, 0)
            # shield: when the caller goes, the ranks are told to stop and awaited (still holding the
            # lock), so the next command never starts while they run this one.
            command = asyncio.ensure_future(self._run_command(seq, name, payloads, timeout_s))
            try:
                return await asyncio.shield(command)
            except asyncio.CancelledError:
                if command.done():
                    raise
                await self._stop_command(command, name, seq)
                raise

    async def _run_command(self, seq: int, name: str, payloads: list, timeout_s: float | None) -> list:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.io, self._send_commands, seq, name, payloads)
        except Exception as exc:  # noqa: BLE001 - a rank that cannot be reached is lost
            raise self._fail(RankFailure(-1, type(exc).__name__, f"sending {name} to the ranks failed: {exc}",
                                         ""), fatal=True) from exc
        own = loop.run_in_executor(self.compute, _capture(lambda: self.execute(name, payloads[0]), 0))
        return await self._collect(seq, own, name, timeout_s=timeout_s)

    async def _stop_command(self, command: asyncio.Future, name: str, seq: int) -> None:
        """Asks the ranks to stop `command` (its caller has gone) and waits until they have."""
        started = time.monotonic()
        CANCEL.requested.set()
        log_event(log, "command.cancel_requested", command=name, seq=seq)
        done, _ = await asyncio.wait({command}, timeout=self.cancel_grace_s)
        if not done:
            log_event(log, "command.wedged", command=name, seq=seq, grace_s=self.cancel_grace_s, level=40,
                      action="health NOT_SERVING until the ranks stop")
            self.on_wedged(True)
            await asyncio.wait({command})
            self.on_wedged(False)
        error = command.exception()
        stopped = isinstance(error, GroupError) and error.failure.code == "CANCELLED"
        log_event(log, "command.cancelled", command=name, seq=seq, seconds=f"{time.monotonic() - started:.2f}",
                  outcome="stopped" if stopped else (f"failed: {error}" if error else "finished"))
        if self._cancel_store is not None:
            self._cancel_store.delete_key(f"stop/{seq}")

    def _send_commands(self, seq: int, name: str, payloads: list) -> None:
        for rank in range(1, self.world_size):
            _send_bytes(pickle.dumps((name, payloads[rank])), rank, self.group, tag=seq)

    async def _collect(self, seq: int, own: asyncio.Future, name: str, startup: bool = False,
                       timeout_s: float | None = None) -> list:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        statuses: dict[int, tuple] = {}  # rank -> ("ok", result bytes) | ("error", RankFailure)
        pending = set(range(1, self.world_size))
        delay = 0.001
        while True:
            for rank in sorted(pending):
                key = f"status/{seq}/{rank}"
                if self.store.check([key]):
                    statuses[rank] = read_store_message(self.store.get(key))
                    self.store.delete_key(key)
                    pending.discard(rank)
            finished = own.done() and not pending
            failures = [s[1] for s in statuses.values() if s[0] == "error"]
            if own.done() and own.result()[0] == "error":
                failures.append(own.result()[1])
            unexpected = [f for f in failures if not f.code]
            if unexpected and not finished:
                # A rank failed while others are still running (maybe waiting for it in a
                # collective): answer now; the group cannot be trusted any more. A deliberate
                # ServiceError is raised before a command's first collective, so for those the
                # other ranks are awaited: they finish, or hit the same check.
                raise self._fail(min(unexpected, key=lambda f: f.rank), fatal=True)
            if finished:
                break
            dead = self._dead_rank(pending, startup, started)
            if dead is not None:
                raise self._fail(dead, fatal=True)
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise self._fail(RankFailure(-1, "TimeoutError", f"{name} did not finish on every rank within "
                                             f"{timeout_s:.0f} s", ""), fatal=True)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)
        # Ranks that succeeded are sending their results; take them even when another rank failed,
        # or those ranks would still be sending when the next command comes.
        sizes = {rank: s[1] for rank, s in statuses.items() if s[0] == "ok"}
        received = {}
        if sizes and not startup:
            try:
                received = await loop.run_in_executor(self.io, self._recv_results, seq, sizes)
            except Exception as exc:  # noqa: BLE001 - a rank died between reporting "ok" and sending its result
                raise self._fail(RankFailure(-1, type(exc).__name__, f"receiving {name}'s results from the ranks "
                                             f"failed: {exc}", ""), fatal=True) from exc
        if failures:
            # Every rank finished. Deliberate ServiceErrors are raised where no rank of the group is
            # left waiting (before a command's collectives, or about another group), so the ranks
            # are still in step; after anything else they may not be.
            deliberate = all(f.code for f in failures)
            raise self._fail(min(failures, key=lambda f: f.rank), fatal=not deliberate or startup)
        return [own.result()[1], *(received.get(rank) for rank in range(1, self.world_size))]

    def _recv_results(self, seq: int, sizes: dict[int, int]) -> dict:
        return {rank: pickle.loads(_recv_bytes(rank, self.group, tag=seq)) for rank in sorted(sizes)}

    def _dead_rank(self, pending: set[int], startup: bool, started: float) -> RankFailure | None:
        """A pending rank whose process exited or whose heartbeat stopped, if any."""
        for index, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                return RankFailure(index + 1, "RankExited", f"the rank's process exited with code {code}", "")
        now = time.monotonic()
        if now - self._last_heartbeat_check < HEARTBEAT_INTERVAL_S / 2:
            return None
        self._last_heartbeat_check = now
        for rank in pending:
            count = self.store.add(f"hb/{rank}", 0)
            last_count, last_change = self._heartbeats.get(rank, (0, started))
            if count != last_count:
                self._heartbeats[rank] = (count, now)
                continue
            limit = self.startup_timeout_s if (startup and count == 0) else self.heartbeat_timeout_s
            if now - last_change > limit:
                what = "did not start" if count == 0 else "stopped sending heartbeats"
                return RankFailure(rank, "RankLost", f"the rank {what} within {limit:.0f} s", "")
        return None

    def _fail(self, failure: RankFailure, fatal: bool) -> GroupError:
        error = GroupError(failure, fatal)
        if failure.code == "CANCELLED" and not fatal:
            # Stopped on purpose (CancelPoint): no error, no traceback.
            log_event(log, "ranks.command_stopped", detail=failure.message)
            return error
        log_event(log, "ranks.command_failed", rank=failure.rank, fatal=fatal, error=failure.message[:300],
                  level=40)
        if failure.traceback:
            log.error("rank %d traceback:\n%s", failure.rank, failure.traceback)
        if fatal:
            self.broken = error
        return error

    async def shutdown(self, timeout_s: float = 20.0) -> None:
        """Stops the worker ranks (a shutdown command; then terminate / kill local ones)."""
        if self.broken is None and self.group is not None and self.world_size > 1:
            try:
                # Bounded: a command still running (e.g. cut short by the grace period) holds the lock.
                await asyncio.wait_for(self._send_shutdown(), timeout_s)
            except Exception as exc:  # noqa: BLE001 - fall through to terminating the processes
                log_event(log, "ranks.shutdown_failed", error=str(exc)[:200] or type(exc).__name__, level=30)
        stop_processes(self.procs, timeout_s)

    async def _send_shutdown(self) -> None:
        async with self._lock:
            self.seq += 1
            await asyncio.get_running_loop().run_in_executor(
                self.io, self._send_commands, self.seq, SHUTDOWN, [None] * self.world_size)


def stop_processes(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _capture(fn: Callable, rank: int) -> Callable[[], tuple]:
    """fn -> a callable returning ("ok", result) or ("error", RankFailure): never raises."""

    def run():
        try:
            return ("ok", fn())
        except Exception as exc:  # noqa: BLE001
            return ("error", RankFailure.from_exception(rank, exc))

    return run
