"""The shared token on the shared runner, and loopback by default, against a real server process."""

import ipaddress
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.client import make_sync_channel
from services.common.config import ConfigError
from services.common.security import ClientCredentials, check_exposure, is_loopback, write_token_file
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


# ------------------------------------------------------------------------------------------------
# Secure by default: no token on an address others can reach is refused; on loopback, a warning.

NO_TOKEN_ENV = {"RLMESH_AUTH_TOKEN": "", "RLMESH_AUTH_TOKEN_FILE": ""}


def own_address() -> str:
    """An address of this machine other than loopback (its network interface), else every interface."""
    for addresses in psutil.net_if_addrs().values():
        for addr in addresses:
            if addr.family == socket.AF_INET and not ipaddress.ip_address(addr.address).is_loopback:
                return addr.address
    return "0.0.0.0"


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False),
    ("no-such-host.invalid", False)])
def test_which_addresses_are_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_the_exposure_check_names_the_fix():
    with pytest.raises(ConfigError) as err:
        check_exposure("rollout", "0.0.0.0", "", mutual_tls=False, allow_unauthenticated=False)
    assert all(s in str(err.value) for s in ("rollout", "--host 0.0.0.0", "--allow_unauthenticated",
                                             "--auth_token_file", "RLMESH_AUTH_TOKEN"))
    # A token or client certificates authenticate callers: nothing to refuse or warn about.
    assert check_exposure("rollout", "0.0.0.0", "t", mutual_tls=False, allow_unauthenticated=False) == ""
    assert check_exposure("rollout", "0.0.0.0", "", mutual_tls=True, allow_unauthenticated=False) == ""
    assert "--allow_unauthenticated" in check_exposure("rollout", "0.0.0.0", "", False, allow_unauthenticated=True)
    assert "without a token" in check_exposure("rollout", "127.0.0.1", "", False, allow_unauthenticated=False)


def test_a_real_service_refuses_a_non_loopback_address_without_a_token(tmp_path):
    """The reward service (rule reward: no model to load) on this machine's own address."""
    host = own_address()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "reward", "--reward_func", "math",
                           "--host", host, "--port", "0", "--ready_file", str(tmp_path / "ready.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **NO_TOKEN_ENV})
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "--allow_unauthenticated" in proc.stderr and "--auth_token_file" in proc.stderr, proc.stderr
    assert f"--host {host}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "ready.json").exists(), "it served before refusing"
    assert time.monotonic() - started < 60


def test_allow_unauthenticated_serves_every_interface_with_a_warning(tmp_path):
    proc, info = start_echo_server(tmp_path, "--host", "0.0.0.0", "--allow_unauthenticated", env=NO_TOKEN_ENV)
    try:
        listening = {c.laddr.ip for c in psutil.Process(proc.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == info["port"]}
        assert listening & {"0.0.0.0", "::"}, listening
        assert call(info["address"], "") == b"00000000hello"  # no check: anyone may call
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "server.unauthenticated" in out and "--allow_unauthenticated" in out, out


def test_loopback_without_a_token_serves_with_a_warning(tmp_path):
    proc, info = start_echo_server(tmp_path, "--host", "127.0.0.1", env=NO_TOKEN_ENV)
    try:
        assert call(info["address"], "") == b"00000000hello"
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "server.unauthenticated" in out and "without a token" in out and "RLMESH_AUTH_TOKEN" in out, out
