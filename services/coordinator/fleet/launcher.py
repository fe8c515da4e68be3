"""Starting a service as a child process and stopping it again, whatever happens.

The local placement and the Ray actors both use this: `python -m services.<name> --host H --port 0
--ready_file F ...` is started in its own process group with its output in a log file; it is ready
once it has written the ready file (with the port it bound) and reports SERVING over
grpc.health.v1. Stopping sends SIGTERM (the service drains in-flight calls), then SIGKILL to the
whole process group after a grace period, so engine subprocesses (vLLM's engine core, learner
ranks) never outlive the run. On Linux each child also gets SIGTERM if this process dies first
(PR_SET_PDEATHSIG, set by a two-line prelude in the child before it becomes the service).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time

from services.common.client import wait_for_serving
from services.common.log import get_logger, log_event
from services.common.ready_file import ServiceStartError, log_tail, wait_for_ready_file_async

_log = get_logger("coordinator")
REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]  # services/coordinator/fleet/launcher.py


# Run as `python -c _DIE_WITH_PARENT <parent pid> -m services.x ...`: asks the kernel for SIGTERM
# when the parent dies, then becomes the service. Doing this in the child's own interpreter (not in
# a preexec_fn) keeps Popen on vfork: a forked child of a process with live gRPC channels can crash
# before exec (grpc/grpc#43055).
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except OSError:
    pass  # not Linux: the coordinator's own shutdown path still stops the child
if os.getppid() != int(sys.argv[1]):
    sys.exit("the coordinator exited before this service started")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


@dataclasses.dataclass
class ServiceProcess:
    """One running service: its process, address and log."""

    name: str  # e.g. "rollout-0"
    module: str  # e.g. "services.rollout"
    process: subprocess.Popen
    log_path: pathlib.Path
    ready_file: pathlib.Path
    address: str = ""
    metrics_port: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 30.0, terminated: bool = False) -> int | None:
        """SIGTERM (unless `terminated`: the caller sent it), wait up to grace_s, then SIGKILL the
        process group; returns the exit code."""
        if self.alive():
            try:
                if not terminated:
                    # Once only: a second SIGTERM can land after the service has put back the default
                    # handler on its way out, and kill it (exit code -15) instead of letting it finish.
                    self.process.send_signal(signal.SIGTERM)
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                log_event(_log, "service.kill", service=self.name, pid=self.pid, after_s=grace_s)
        # The group outlives a well-behaved parent only when something leaked; kill whatever is left.
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return self.process.returncode


def spawn_service(name: str, module: str, argv: list[str], log_dir: pathlib.Path, host: str = "127.0.0.1",
                  env: dict[str, str] | None = None) -> ServiceProcess:
    """Starts `python -m module --host host --port 0 --ready_file F argv...` without waiting."""
    log_dir.mkdir(parents=True, exist_ok=True)
    ready_file = log_dir / f"{name}.ready.json"
    ready_file.unlink(missing_ok=True)
    log_path = log_dir / f"{name}.log"
    command = [sys.executable, "-m", module, "--host", host, "--port", "0", "--ready_file", str(ready_file), *argv]
    launch = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command[1:]]
    child_env = {**os.environ, **(env or {})}
    child_env["RLMESH_SERVICE"] = name  # the process's name for services/common/crash_points.py's filter
    # The service imports `services` and the generated `rlmesh` package from the repository.
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), str(REPO_ROOT / "protos"), child_env.get("PYTHONPATH", "")) if p)
    with open(log_path, "ab") as log_file:
        log_file.write(f"$ {' '.join(command)}\n".encode())
        log_file.flush()
        # Its own session: a Ctrl-C on the terminal reaches the coordinator, which stops the services.
        process = subprocess.Popen(launch, cwd=str(REPO_ROOT), env=child_env, stdin=subprocess.DEVNULL,
                                   stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    log_event(_log, "service.spawned", service=name, pid=process.pid, log=str(log_path))
    return ServiceProcess(name, module, process, log_path, ready_file)


async def wait_until_ready(service: ServiceProcess, timeout_s: float) -> ServiceProcess:
    """Waits for the ready file, then for health SERVING; raises ServiceStartError with the log tail."""
    deadline = time.monotonic() + timeout_s
    info = await wait_for_ready_file_async(service.ready_file, service.process, timeout_s, name=service.name,
                                           log_path=service.log_path)
    service.address, service.metrics_port = info["address"], info.get("metrics_port")
    try:
        await wait_for_serving(service.address, max(deadline - time.monotonic(), 5.0))
    except TimeoutError as exc:
        raise ServiceStartError(f"{service.name}: {exc}; last lines of {service.log_path}:\n"
                                f"{log_tail(service.log_path)}") from exc
    log_event(_log, "service.ready", service=service.name, address=service.address, pid=service.pid)
    return service


def stop_all(services: list[ServiceProcess], grace_s: float = 30.0) -> None:
    """SIGTERM every service at once (they drain in parallel), then collect them one by one."""
    for service in services:
        if service.alive():
            try:
                service.process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for service in services:
        code = service.stop(max(deadline - time.monotonic(), 0.1), terminated=True)
        log_event(_log, "service.stopped", service=service.name, pid=service.pid, code=code)
