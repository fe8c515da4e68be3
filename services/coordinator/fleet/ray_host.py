"""The Ray actor that runs one service process on its node (ray_placement.py places it).

Ray imports this module in every actor's worker process, so it imports no more than the actor
uses (Ray, the launcher, the run's security settings): not the coordinator's config, torch or
transformers, about 2 s of CPU in each of a run's actors and in each one replaced after a death.
"""

from __future__ import annotations

import asyncio
import hashlib
import pathlib
import socket

import ray

from services.common.rendezvous import NODE_ADDRESS_ENV
from services.common.security import credentials_from_env, set_client_credentials
from services.coordinator.fleet.launcher import log_tail, spawn_service, wait_until_ready

# Set on the driver, they reach every service on every node (the guide sets them before `ray start`;
# a job's driver may also carry them): interfaces and InfiniBand devices of NCCL and gloo.
FORWARDED_ENV = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG")


class ServiceHost:
    """Ray actor: runs one service process on its node and reports where it listens."""

    def __init__(self, name: str, log_dir: str, driver_ip: str):
        self.name = name
        self.service = None
        # Logs go to the run folder when this actor shares the driver's node, else to /tmp there, in a
        # folder of this run's own (keyed by the run folder's path: another run's logs never mix in);
        # the coordinator copies those into the run folder as they grow (RayPlacement._mirror_logs).
        here = ray.util.get_node_ip_address()
        run_key = hashlib.sha1(log_dir.encode()).hexdigest()[:10]
        self.log_dir = pathlib.Path(log_dir if here == driver_ip else
                                    f"/tmp/rlmesh-logs/{pathlib.Path(log_dir).parent.name}-{run_key}-{here}")

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, module: str, argv: list[str], env: dict[str, str], wait: bool, timeout_s: float) -> dict:
        host = ray.util.get_node_ip_address()
        # Health checks from here present what the coordinator's channels do (TLS CA, client certificate).
        set_client_credentials(credentials_from_env(env))
        # What reached this node: the service's log says it first (the run folder gets a copy).
        self.log_dir.mkdir(parents=True, exist_ok=True)
        shown = ("MASTER_ADDR", "MASTER_PORT", "RANK", *FORWARDED_ENV)
        with open(self.log_dir / f"{self.name}.log", "a") as log:
            log.write(f"# node {host} network_env " + " ".join(f"{k}={env[k]}" for k in shown if k in env) + "\n")
        # The service binds this node's address and gives it to others (weight-sync group, rendezvous).
        self.service = spawn_service(self.name, module, argv, self.log_dir, host=host,
                                     env={**env, NODE_ADDRESS_ENV: host})
        if wait:
            asyncio.run(wait_until_ready(self.service, timeout_s))
        return {"address": self.service.address, "pid": self.service.pid, "log": str(self.service.log_path),
                "node_ip": host, "metrics_port": self.service.metrics_port}

    def alive(self) -> bool:
        return self.service is not None and self.service.alive()

    def exit_code(self) -> int | None:
        """None while the child runs; its exit code once it ended."""
        return None if self.service is None else self.service.process.poll()

    def tail(self) -> str:
        return log_tail(self.service.log_path) if self.service is not None else ""

    def log_chunk(self, offset: int, limit: int = 4 << 20) -> bytes:
        """Up to `limit` bytes of the service's log from `offset` (b"" when nothing new)."""
        path = self.log_dir / f"{self.name}.log"
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(limit)
        except OSError:
            return b""

    def stop(self, grace_s: float = 30.0) -> int | None:
        return self.service.stop(grace_s) if self.service is not None else None
