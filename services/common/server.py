"""The gRPC server runner every service uses.

It binds host:port (loopback unless told otherwise; 0 picks a free port and the real one is
reported), sets explicit message size limits and keepalive, serves grpc.health.v1 and server
reflection, optional TLS / mutual TLS, a shared token on every mutating RPC (services.common.security;
without one a service refuses a non-loopback --host unless --allow_unauthenticated, and warns on loopback),
Prometheus metrics on their own port, and shuts down gracefully on SIGTERM: health goes
NOT_SERVING, in-flight calls get `grace_period_s` to finish, then the server stops.
"""

import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import signal
import sys
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.config import ConfigError, opt
from services.common.log import get_logger, log_event
from services.common.metrics import start_metrics_server
from services.common.ready_file import write_ready_file
from services.common.security import TokenAuthInterceptor, check_exposure, read_token_file, resolve_token
from services.common.user_errors import USER_ERROR_EXIT_CODE, USER_ERRORS, report

MiB = 1024 * 1024


@dataclasses.dataclass
class ServerConfig:
    """Network settings shared by every service."""

    host: str = opt("127.0.0.1", "address to bind the gRPC and metrics servers to; 0.0.0.0 = every interface "
                    "(containers, other machines: then also set --auth_token_file and TLS)")
    port: int = opt(0, "gRPC port; 0 picks a free port (reported on stdout and in --ready_file)")
    metrics_port: int = opt(-1, "Prometheus metrics HTTP port; 0 picks a free port, -1 disables")
    max_message_mb: int = opt(256, "largest gRPC message sent or received, in MiB")
    keepalive_time_s: float = opt(30.0, "interval of keepalive pings on idle connections, seconds")
    keepalive_timeout_s: float = opt(10.0, "time to wait for a keepalive ack before closing, seconds")
    grace_period_s: float = opt(30.0, "on SIGTERM, how long in-flight calls may run before the server stops")
    tls_cert: str = opt("", "PEM server certificate chain; with --tls_key enables TLS")
    tls_key: str = opt("", "PEM private key of --tls_cert")
    tls_client_ca: str = opt("", "PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)")
    ready_file: str = opt("", "when set, a JSON file with the bound address and ports is written here once serving")
    tls_ca: str = opt("", "PEM CA bundle that signed the certificates of the services this process calls; enables "
                      "TLS on its client channels (with --tls_cert/--tls_key also sent as client certificate)")
    auth_token_file: str = opt("", "file holding the shared token every mutating RPC must carry (and this process "
                               "sends); default: env RLMESH_AUTH_TOKEN, or the file env RLMESH_AUTH_TOKEN_FILE "
                               "names; none = no check")
    auth_token: str = opt("", "the shared token itself; visible in `ps`, so prefer --auth_token_file or env "
                          "RLMESH_AUTH_TOKEN")
    allow_unauthenticated: bool = opt(False, "serve a non-loopback --host without a token or mutual TLS (anyone "
                                      "who reaches the port may call every RPC); without it such a service refuses "
                                      "to start")

    def validate_server(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port {self.port} is out of range; use 0..65535")
        if self.max_message_mb < 1:
            raise ConfigError(f"--max_message_mb {self.max_message_mb} must be >= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls_cert and --tls_key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls_client_ca (mutual TLS) needs --tls_cert and --tls_key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "tls_ca", "auth_token_file"):
            path = getattr(self, name)
            if path and not pathlib.Path(path).is_file():
                raise ConfigError(f"--{name} {path}: no such file")
        if self.auth_token_file:
            read_token_file(self.auth_token_file, "--auth_token_file")  # an empty file fails here, not later

    def validate(self) -> None:
        self.validate_server()


def channel_options(max_message_mb: int, keepalive_time_s: float, keepalive_timeout_s: float) -> list[tuple]:
    return [
        ("grpc.max_send_message_length", max_message_mb * MiB),
        ("grpc.max_receive_message_length", max_message_mb * MiB),
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Allow the clients' keepalive pings (the default policy would answer them with GOAWAY).
        ("grpc.http2.min_ping_interval_without_data_ms", int(min(keepalive_time_s, 10) * 1000)),
    ]


class ServiceRunner:
    """Owns one grpc.aio server with health, reflection, metrics and graceful shutdown."""

    def __init__(self, name: str, config: ServerConfig, auth_token: str | None = None):
        """auth_token: the shared token mutating RPCs must carry; None = from the config / environment."""
        self.name = name
        self.config = config
        self.log = get_logger(name)
        self.auth_token = resolve_token(config.auth_token, config.auth_token_file) if auth_token is None else auth_token
        # Before anything starts: raises ConfigError when the address is open to others without a check.
        self.exposure_warning = check_exposure(name, config.host, self.auth_token, bool(config.tls_client_ca),
                                               bool(config.allow_unauthenticated))
        interceptors = [TokenAuthInterceptor(self.auth_token, name)] if self.auth_token else []
        # No SO_REUSEPORT (gRPC's default on Linux): a second service started on a port in use would
        # bind it too and take a share of its connections; here it fails to start instead.
        self.server = grpc.aio.server(options=[*channel_options(
            config.max_message_mb, config.keepalive_time_s, config.keepalive_timeout_s), ("grpc.so_reuseport", 0)],
            interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = []
        self.on_shutdown: list[Callable[[], Awaitable[None] | None]] = []
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._stop = asyncio.Event()
        self._grace_s = config.grace_period_s
        self.exit_code = 0  # what run_service exits with once the server stopped

    def add(self, add_fn, servicer, full_service_name: str) -> None:
        """Registers a servicer, e.g. add(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, s, "rlmesh.rollout.v1.RolloutService")."""
        add_fn(servicer, self.server)
        self.service_names.append(full_service_name)

    def _credentials(self):
        cfg = self.config
        key = pathlib.Path(cfg.tls_key).read_bytes()
        cert = pathlib.Path(cfg.tls_cert).read_bytes()
        ca = pathlib.Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)

    async def _set_status(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    def set_serving(self, serving: bool) -> None:
        """Marks the server (and each of its services) SERVING or NOT_SERVING in grpc.health.v1."""
        asyncio.get_running_loop().create_task(self._set_status(serving))

    async def start(self) -> int:
        cfg = self.config
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert:
                self.port = self.server.add_secure_port(address, self._credentials())
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            raise ConfigError(f"could not bind {address} ({exc}); is the port in use? Choose another --port") from None
        if self.port == 0:
            raise ConfigError(f"could not bind {address}; is the port in use? Choose another --port")
        await self.server.start()
        if cfg.metrics_port >= 0:
            self.metrics_port = start_metrics_server(self.name, cfg.metrics_port, cfg.host)
        await self._set_status(True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        ready = {"service": self.name, "address": f"{host}:{self.port}", "port": self.port,
                 "metrics_port": self.metrics_port, "pid": os.getpid()}
        if cfg.ready_file:
            write_ready_file(cfg.ready_file, ready)
        print("RLMESH_READY " + json.dumps(ready), flush=True)
        log_event(self.log, "server.started", address=ready["address"], metrics_port=self.metrics_port,
                  tls=bool(cfg.tls_cert), mtls=bool(cfg.tls_client_ca), auth_token=bool(self.auth_token))
        if self.exposure_warning:
            log_event(self.log, "server.unauthenticated", level=logging.WARNING, note=self.exposure_warning)
        return self.port

    def request_stop(self, exit_code: int = 0, grace_s: float | None = None) -> None:
        """Starts the graceful shutdown. exit_code: non-zero when the service can no longer serve
        (e.g. its engine died), so that whatever supervises the process restarts it; grace_s: how long
        in-flight calls may still run (default --grace_period_s)."""
        self.exit_code = exit_code
        if grace_s is not None:
            self._grace_s = grace_s
        self._stop.set()

    async def wait_for_termination(self) -> None:
        """Runs until SIGTERM/SIGINT (or request_stop), then shuts down gracefully."""
        await self._stop.wait()
        log_event(self.log, "server.stopping", grace_s=self._grace_s, exit_code=self.exit_code)
        await self._set_status(False)
        await self.server.stop(self._grace_s)
        await self.release()
        log_event(self.log, "server.stopped")

    async def release(self) -> None:
        """Runs the on_shutdown callbacks once (engines, worker pools), also when the server never started."""
        callbacks, self.on_shutdown = self.on_shutdown, []
        for callback in callbacks:
            result = callback()
            if asyncio.iscoroutine(result):
                await result


def run_service(name: str, config: ServerConfig, build: Callable[[ServiceRunner], Awaitable[None]]) -> None:
    """Runs a service: build(runner) creates its engines and registers servicers; then serve until
    SIGTERM (exit code 0) or until the service asks to stop (runner.request_stop's exit code)."""

    async def main() -> int:
        runner = ServiceRunner(name, config)
        await build(runner)
        try:
            await runner.start()
        except BaseException:
            # e.g. the port is taken: what build() started (a worker pool, an engine) stops here, not
            # in the interpreter's teardown, where a pool's finaliser writes to closed pipes.
            await runner.release()
            raise
        await runner.wait_for_termination()
        return runner.exit_code

    try:
        exit_code = asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except tuple(USER_ERRORS) as exc:  # a port in use, an unauthenticated non-loopback address, ...
        report(exc)  # the message, without a traceback unless RLMESH_DEBUG=1
        sys.exit(USER_ERROR_EXIT_CODE)
    if exit_code:
        # A service that gives up (e.g. its engine died) leaves at once, so that its supervisor can
        # restart it: its server and engine are stopped already.
        exit_now(exit_code)


def exit_now(code: int) -> None:
    """Ends a service's process once its server and engines have stopped: the logs are flushed and
    the interpreter's teardown is skipped (a full garbage collection of torch's and the engines'
    objects, then libtorch's static destructors: seconds, tens of seconds on a busy machine), so a
    supervisor restarting the service, or a coordinator stopping it, does not wait for it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
