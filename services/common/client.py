"""Client channels: every call gets a deadline; idempotent methods retry on UNAVAILABLE.

The retry policy is gRPC's own (service config), limited to the methods the caller lists as
idempotent, so a non-idempotent call (e.g. a training step) is never sent twice. It retries only
failures that did not come from a service's own code: every status a service returns carries the
retry pushback trailer (services.common.errors.FINAL_TRAILER), which stops the policy, so an
UNAVAILABLE that a service sends after its own retries reaches the caller at once. What is left
for the channel is connection refused or reset: at most 5 attempts, back-off 0.2 s doubling to
5 s (jittered), so about 3 s in all before the error reaches the caller.
"""

import asyncio
import dataclasses
import json
import pathlib
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.security import ClientCredentials, client_credentials
from services.common.server import channel_options
from services.common.user_errors import ServiceUnreachable


def service_config(service_full_name: str, idempotent_methods, max_attempts: int = 5,
                   initial_backoff_s: float = 0.2, max_backoff_s: float = 5.0) -> str:
    if not idempotent_methods:
        return json.dumps({"methodConfig": []})
    return json.dumps({"methodConfig": [{
        "name": [{"service": service_full_name, "method": m} for m in idempotent_methods],
        "retryPolicy": {
            "maxAttempts": max_attempts,
            "initialBackoff": f"{initial_backoff_s}s",
            "maxBackoff": f"{max_backoff_s}s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]})


def returned_by_service(exc: grpc.RpcError) -> bool:
    """True when the status came from a service's own code (final, see services.common.errors);
    False when gRPC made it up on the client side: connection refused or reset, deadline, cancel."""
    trailers = exc.trailing_metadata() or ()
    return any(key == "grpc-retry-pushback-ms" for key, _ in trailers)


def _with_deadline(details, default_timeout_s: float):
    if details.timeout is not None:
        return details
    return details._replace(timeout=default_timeout_s)


def _with_metadata(details, metadata):
    return details._replace(metadata=(*(details.metadata or ()), *metadata))


def _aio_rewriting(rewrite) -> list:
    """Interceptors that pass every call's details through `rewrite` (a default deadline, the shared
    token). grpc.aio files an interceptor under the first call kind it implements only (an if/elif
    chain in grpc.aio.Channel), so there is one per kind, or streamed calls would go without."""

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(rewrite(details), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(rewrite(details), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, details, request_iterator):
            return await continuation(rewrite(details), request_iterator)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, request_iterator):
            return await continuation(rewrite(details), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


class _SyncRewriting(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The blocking channel's counterpart of _aio_rewriting (grpc.intercept_channel takes every kind
    a class implements)."""

    def __init__(self, rewrite):
        self.rewrite = rewrite

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self.rewrite(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self.rewrite(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self.rewrite(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self.rewrite(details), request_iterator)


def service_label(service_full_name: str, address: str) -> str:
    """'rlmesh.learner.v1.LearnerService', '127.0.0.1:5' -> 'learner service at 127.0.0.1:5'."""
    name = service_full_name.rsplit(".", 1)[-1].removesuffix("Service").lower()
    return f"{name} service at {address}" if name else address


class _AioNamedErrors(grpc.aio.UnaryUnaryClientInterceptor):
    """Names the service and address in errors gRPC made up on the client side (connection refused
    or reset, deadline passed), which otherwise read e.g. "failed to connect to all addresses". A
    status the service returned itself (services.common.errors) already says what went wrong."""

    def __init__(self, label: str):
        self.label = label

    async def intercept_unary_unary(self, continuation, details, request):
        call = await continuation(details, request)
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            if returned_by_service(exc):
                raise
            code = exc.code()
            what = {grpc.StatusCode.UNAVAILABLE: "is unavailable",
                    grpc.StatusCode.DEADLINE_EXCEEDED: "did not answer within the call's deadline"}.get(
                        code, f"failed ({code.name})")
            raise grpc.aio.AioRpcError(code, exc.initial_metadata(), exc.trailing_metadata(),
                                       f"{self.label} {what}: {exc.details()}", exc.debug_error_string()) from None


def _resolve(credentials: ClientCredentials | None, tls_ca: str, tls_cert: str, tls_key: str) -> ClientCredentials:
    """The caller's credentials, else this process's (services.common.security); explicit TLS files win."""
    creds = credentials if credentials is not None else client_credentials()
    if tls_ca or tls_cert or tls_key:
        creds = dataclasses.replace(creds, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
    return creds


def _options(service_full_name, idempotent_methods, max_message_mb, keepalive_time_s, keepalive_timeout_s):
    return [*channel_options(max_message_mb, keepalive_time_s, keepalive_timeout_s),
            # A service that restarts at the same address (static placement, a restarted container)
            # is reconnected within a second of serving again; gRPC's default back-off grows to two
            # minutes while it is down, and calls in between fail at once with UNAVAILABLE.
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", service_config(service_full_name, idempotent_methods))]


# Instances found behind one name (several DNS records: `docker compose up --scale`, a Kubernetes
# headless Service) are dialled by IP address, but their certificates name the service.
_TLS_NAMES: dict[str, str] = {}


def verify_tls_as(address: str, server_name: str) -> None:
    """TLS channels made to `address` (IP:port) from now on check the server's certificate against
    `server_name` (the name the address was found behind) instead of the IP address."""
    _TLS_NAMES[address] = server_name


def _tls_options(address: str) -> list:
    name = _TLS_NAMES.get(address)
    return [("grpc.ssl_target_name_override", name)] if name else []


def _credentials(tls_ca: str, tls_cert: str, tls_key: str):
    read = lambda p: pathlib.Path(p).read_bytes() if p else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


def make_channel(address: str, service_full_name: str = "", idempotent_methods=(),
                 default_timeout_s: float = 60.0, max_message_mb: int = 256,
                 keepalive_time_s: float = 30.0, keepalive_timeout_s: float = 10.0,
                 tls_ca: str = "", tls_cert: str = "", tls_key: str = "",
                 credentials: ClientCredentials | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `address`. tls_ca enables TLS; tls_cert/tls_key add a client certificate (mTLS).
    credentials: TLS files and shared token; None = this process's (services.common.security.client_credentials),
    ClientCredentials() = plaintext and no token (for servers outside the run)."""
    creds = _resolve(credentials, tls_ca, tls_cert, tls_key)
    options = _options(service_full_name, idempotent_methods, max_message_mb, keepalive_time_s, keepalive_timeout_s)
    interceptors = [_AioNamedErrors(service_label(service_full_name, address)),
                    *_aio_rewriting(lambda details: _with_deadline(details, default_timeout_s))]
    if creds.token:
        metadata = creds.metadata()
        interceptors += _aio_rewriting(lambda details: _with_metadata(details, metadata))
    if creds.tls_ca:
        return grpc.aio.secure_channel(address, _credentials(creds.tls_ca, creds.tls_cert, creds.tls_key),
                                       options + _tls_options(address), interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options, interceptors=interceptors)


def make_sync_channel(address: str, service_full_name: str = "", idempotent_methods=(),
                      default_timeout_s: float = 60.0, max_message_mb: int = 256,
                      keepalive_time_s: float = 30.0, keepalive_timeout_s: float = 10.0,
                      tls_ca: str = "", tls_cert: str = "", tls_key: str = "",
                      credentials: ClientCredentials | None = None) -> grpc.Channel:
    """A blocking channel to `address`, with the same deadline, retry and credential rules as make_channel."""
    creds = _resolve(credentials, tls_ca, tls_cert, tls_key)
    options = _options(service_full_name, idempotent_methods, max_message_mb, keepalive_time_s, keepalive_timeout_s)
    if creds.tls_ca:
        channel = grpc.secure_channel(address, _credentials(creds.tls_ca, creds.tls_cert, creds.tls_key),
                                      options + _tls_options(address))
    else:
        channel = grpc.insecure_channel(address, options)
    interceptors = [_SyncRewriting(lambda details: _with_deadline(details, default_timeout_s))]
    if creds.token:
        metadata = creds.metadata()
        interceptors.append(_SyncRewriting(lambda details: _with_metadata(details, metadata)))
    return grpc.intercept_channel(channel, *interceptors)


async def wait_for_serving(address: str, timeout_s: float, service: str = "", **channel_kwargs) -> None:
    """Polls grpc.health.v1 until `service` ("" = the whole server) is SERVING; ServiceUnreachable (a
    TimeoutError) otherwise."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with make_channel(address, default_timeout_s=5.0, **channel_kwargs) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            await asyncio.sleep(0.2)
    raise ServiceUnreachable(f"{address} did not report SERVING within {timeout_s:.0f} s (last: {last}); "
                             "check that the service runs there and that the address is right")


def wait_for_serving_sync(address: str, timeout_s: float, service: str = "", **channel_kwargs) -> None:
    """Blocking form of wait_for_serving."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with make_sync_channel(address, default_timeout_s=5.0, **channel_kwargs) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(0.2)
    raise ServiceUnreachable(f"{address} did not report SERVING within {timeout_s:.0f} s (last: {last}); "
                             "check that the service runs there and that the address is right")
