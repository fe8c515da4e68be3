"""The shared token on the shared runner, and loopback by default, against a real server process."""

import json
import os
import pathlib
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.client import make_sync_channel
from services.common.security import ClientCredentials, write_token_file
from tests.common.test_server import ECHO

REPO = pathlib.Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token-for-the-test"


def start_echo_server(tmp_path, *argv, env=None):
    """The echo server exactly as given (no --host: the default is under test)."""
    ready = tmp_path / f"ready-{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.Popen([sys.executable, "-m", "tests.common.echo_server", "--port", "0", "--metrics_port", "0",
                             "--ready_file", str(ready), *argv], cwd=REPO, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"echo server did not start: {proc.stdout.read()}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """An echo server holding a token from --auth_token_file, started without --host."""
    tmp = tmp_path_factory.mktemp("guarded")
    write_token_file(tmp / "token", TOKEN)
    proc, info = start_echo_server(tmp, "--auth_token_file", str(tmp / "token"))
    yield proc, info
    proc.terminate()
    proc.wait(30)


def call(address: str, token: str):
    with make_sync_channel(address, credentials=ClientCredentials(token=token)) as channel:
        return channel.unary_unary(ECHO)(b"00000000hello", timeout=10)


def test_calls_without_the_token_are_refused_and_health_stays_open(guarded):
    _, info = guarded
    with pytest.raises(grpc.RpcError) as err:
        call(info["address"], "")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "/rlmesh.test.Echo/Echo" in err.value.details() and "authorization: Bearer" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        call(info["address"], "a-guess")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "not this service's" in err.value.details()
    assert call(info["address"], TOKEN) == b"00000000hello"
    # Read-only probes need no token (health checks of orchestrators, the coordinator's waits).
    with make_sync_channel(info["address"], credentials=ClientCredentials()) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_process_token_comes_from_the_environment(guarded, tmp_path):
    _, info = guarded
    # A client process with RLMESH_AUTH_TOKEN set sends it without being told (e.g. rlmesh eval).
    code = ("import sys; from services.common.client import make_sync_channel\n"
            "with make_sync_channel(sys.argv[1]) as c: print(c.unary_unary('/rlmesh.test.Echo/Echo')"
            "(b'00000000env', timeout=10))")
    out = subprocess.run([sys.executable, "-c", code, info["address"]], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "RLMESH_AUTH_TOKEN": TOKEN}, timeout=60)
    assert out.returncode == 0 and "00000000env" in out.stdout, out.stderr


def test_services_bind_loopback_by_default_and_the_token_stays_out_of_argv(guarded):
    proc, info = guarded
    assert info["address"].startswith("127.0.0.1:")
    listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert {addr.port for addr in listening} >= {info["port"], info["metrics_port"]}
    # gRPC listens on a dual-stack socket: 127.0.0.1 shows as ::ffff:127.0.0.1.
    assert {addr.ip.removeprefix("::ffff:") for addr in listening} == {"127.0.0.1"}, listening
    assert TOKEN not in " ".join(psutil.Process(proc.pid).cmdline())


def test_a_missing_token_file_fails_at_start_up(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tests.common.echo_server", "--auth_token_file",
                           str(tmp_path / "absent")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--auth_token_file" in proc.stderr and "no such file" in proc.stderr
