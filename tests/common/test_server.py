"""The shared server runner and client factory, against a real server process on loopback."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.client import make_channel, make_sync_channel, wait_for_serving_sync

ECHO = "/rlmesh.test.Echo/Echo"
DRIP = "/rlmesh.test.Echo/Drip"


def start_echo(tmp_path, *extra):
    ready = tmp_path / f"ready-{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.Popen([sys.executable, "-m", "tests.common.echo_server", "--host", "127.0.0.1",
                             "--port", "0", "--metrics_port", "0", "--ready_file", str(ready), *extra],
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"echo server did not start: {proc.stderr.read()}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    proc, info = start_echo(tmp_path_factory.mktemp("echo"), "--max_message_mb", "1")
    yield info
    proc.terminate()
    proc.wait(30)


def echo_call(channel, payload: bytes, timeout=None):
    return channel.unary_unary(ECHO)(payload, timeout=timeout)


def test_health_reports_serving(echo_server):
    with make_sync_channel(echo_server["address"]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        reply = stub.Check(health_pb2.HealthCheckRequest(service="rlmesh.test.Echo"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services(echo_server):
    with make_sync_channel(echo_server["address"]) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"rlmesh.test.Echo", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_call_past_deadline_gets_deadline_exceeded(echo_server):
    with make_sync_channel(echo_server["address"]) as channel:
        with pytest.raises(grpc.RpcError) as err:
            echo_call(channel, b"00002000", timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The server keeps serving afterwards.
        assert echo_call(channel, b"00000000ok", timeout=5) == b"00000000ok"


def test_default_deadline_applies_when_caller_sets_none(echo_server):
    with make_sync_channel(echo_server["address"], default_timeout_s=0.3) as channel:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            echo_call(channel, b"00003000")
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 2.5


def test_default_deadline_applies_to_streamed_calls_on_both_channel_kinds(echo_server):
    """A stream the caller gives no deadline gets the channel's default on blocking and asyncio
    channels alike (asyncio channels take one interceptor per call kind)."""
    with make_sync_channel(echo_server["address"], default_timeout_s=0.3) as channel:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(channel.unary_stream(DRIP)(b"00000200"))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 1.5

    async def aio_stream():
        async with make_channel(echo_server["address"], default_timeout_s=0.3) as channel:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                async for _ in channel.unary_stream(DRIP)(b"00000200"):
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 1.5
            # An explicit deadline is kept: the whole stream arrives.
            replies = [r async for r in channel.unary_stream(DRIP)(b"00000010", timeout=10)]
            assert replies == [b"00000010"] * 10

    asyncio.run(aio_stream())


def test_message_over_limit_is_resource_exhausted(echo_server):
    # The server's limit is 1 MiB; the client's is the default 256 MiB, so the server rejects.
    with make_sync_channel(echo_server["address"]) as channel:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            echo_call(channel, b"00000000" + b"x" * (2 * 1024 * 1024), timeout=20)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in err.value.details() or "exceeds" in err.value.details().lower()
        assert time.monotonic() - t0 < 10


def test_metrics_endpoint_is_scraped(echo_server):
    with make_sync_channel(echo_server["address"]) as channel:
        echo_call(channel, b"00000000", timeout=5)
    body = urllib.request.urlopen(f"http://127.0.0.1:{echo_server['metrics_port']}/metrics", timeout=10).read().decode()
    assert "rlmesh_echo_build_info{" in body
    calls = [line for line in body.splitlines() if line.startswith("rlmesh_echo_calls_total ")]
    assert calls and float(calls[0].split()[1]) >= 1


def test_retry_on_unavailable_for_idempotent_method_only(echo_server):
    flaky = "/rlmesh.test.Echo/Flaky"
    with make_sync_channel(echo_server["address"], "rlmesh.test.Echo", idempotent_methods=["Flaky"]) as channel:
        assert channel.unary_unary(flaky)(b"idempotent-key", timeout=20) == b"3"
    with make_sync_channel(echo_server["address"], "rlmesh.test.Echo", idempotent_methods=["Echo"]) as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(flaky)(b"other-key", timeout=20)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_lets_in_flight_call_finish(tmp_path):
    proc, info = start_echo(tmp_path, "--grace_period_s", "20")
    try:
        with make_sync_channel(info["address"]) as channel:
            future = channel.unary_unary(ECHO).future(b"00001500inflight", timeout=30)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            assert future.result() == b"00001500inflight"
        assert proc.wait(30) == 0
        stderr = proc.stderr.read()
        assert "server.stopping" in stderr and "server.stopped" in stderr
    finally:
        proc.kill()


def test_health_goes_not_serving_during_grace(tmp_path):
    proc, info = start_echo(tmp_path, "--grace_period_s", "20")
    try:
        with make_sync_channel(info["address"]) as channel:
            wait_for_serving_sync(info["address"], 10)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            slow = channel.unary_unary(ECHO).future(b"00002500", timeout=30)
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            # A watcher sees NOT_SERVING while the in-flight call is still being served.
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not slow.done()
            assert slow.result() == b"00002500"
    finally:
        proc.kill()


def test_a_second_service_on_a_port_in_use_fails_to_start(echo_server):
    # gRPC binds with SO_REUSEPORT by default: a second server on the same port would start and take
    # a share of the first one's connections. Ours refuse the port instead.
    proc = subprocess.run([sys.executable, "-m", "tests.common.echo_server", "--host", "127.0.0.1",
                           "--port", str(echo_server["port"]), "--metrics_port", "-1"],
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"could not bind 127.0.0.1:{echo_server['port']}" in proc.stderr and "port in use" in proc.stderr, proc.stderr
    for _ in range(5):  # new connections still reach the first server
        with make_sync_channel(echo_server["address"], default_timeout_s=10) as channel:
            assert echo_call(channel, b"00000000ping") == b"00000000ping"
