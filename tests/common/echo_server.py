"""A server built with the shared runner for its own tests: `Echo` returns the request bytes after
an optional delay (the first 8 bytes, ASCII, are the delay in milliseconds); `Drip` streams the
request back ten times with that delay before each; `Flaky` fails twice per key with UNAVAILABLE
before it answers."""

import asyncio
import sys

import grpc
import prometheus_client

from services.common.config import parse_config
from services.common.server import ServerConfig, run_service

ECHO_CALLS = prometheus_client.Counter("rlmesh_echo_calls_total", "Echo calls served")


async def echo(request: bytes, context) -> bytes:
    delay_ms = int(request[:8] or b"0")
    await asyncio.sleep(delay_ms / 1000)
    ECHO_CALLS.inc()
    return request


async def drip(request: bytes, context):
    delay_ms = int(request[:8] or b"0")
    for _ in range(10):
        await asyncio.sleep(delay_ms / 1000)
        yield request


_flaky_attempts: dict[bytes, int] = {}


async def flaky(request: bytes, context) -> bytes:
    """Fails with UNAVAILABLE the first two times a key is seen, then answers the attempt count."""
    _flaky_attempts[request] = _flaky_attempts.get(request, 0) + 1
    if _flaky_attempts[request] <= 2:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "flaky: try again")
    return str(_flaky_attempts[request]).encode()


async def build(runner) -> None:
    handler = grpc.method_handlers_generic_handler(
        "rlmesh.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo),
                             "Drip": grpc.unary_stream_rpc_method_handler(drip),
                             "Flaky": grpc.unary_unary_rpc_method_handler(flaky)})
    runner.server.add_generic_rpc_handlers((handler,))
    runner.service_names.append("rlmesh.test.Echo")


if __name__ == "__main__":
    run_service("echo", parse_config(ServerConfig, sys.argv[1:]), build)
