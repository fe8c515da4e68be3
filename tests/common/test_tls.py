"""TLS and mutual TLS on the shared runner, with certificates made by openssl for the test."""

import asyncio
import shutil
import subprocess

import grpc
import pytest

from services.common.client import make_channel, make_sync_channel, verify_tls_as
from tests.common.test_server import ECHO, start_echo

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")


def make_certs(d, server_san: str = "DNS:localhost,IP:127.0.0.1"):
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=rlmesh-test-ca")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", "/CN=localhost")
        san = server_san if name == "server" else "DNS:localhost,IP:127.0.0.1"
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def test_tls_and_mutual_tls(tmp_path):
    certs = make_certs(tmp_path)
    proc, info = start_echo(tmp_path, "--tls_cert", certs["server.pem"], "--tls_key", certs["server.key"],
                            "--tls_client_ca", certs["ca.pem"])
    try:
        with make_sync_channel(info["address"], tls_ca=certs["ca.pem"], tls_cert=certs["client.pem"],
                               tls_key=certs["client.key"]) as channel:
            assert channel.unary_unary(ECHO)(b"00000000mtls", timeout=10) == b"00000000mtls"
        # Without a client certificate the mutual-TLS server refuses the connection.
        with make_sync_channel(info["address"], tls_ca=certs["ca.pem"]) as channel:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(ECHO)(b"00000000", timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # A plaintext client cannot talk to it either.
        with make_sync_channel(info["address"]) as channel:
            with pytest.raises(grpc.RpcError):
                channel.unary_unary(ECHO)(b"00000000", timeout=5)
    finally:
        proc.kill()


def test_an_instance_found_behind_a_name_is_verified_against_that_name(tmp_path):
    """A scaled service (several DNS records for one name) is dialled by IP address; its
    certificate names the service only. The check uses the name it was found behind."""
    certs = make_certs(tmp_path, server_san="DNS:rollout.internal")
    proc, info = start_echo(tmp_path, "--tls_cert", certs["server.pem"], "--tls_key", certs["server.key"])
    address = info["address"]  # 127.0.0.1:PORT, which the certificate does not name
    try:
        with make_sync_channel(address, tls_ca=certs["ca.pem"]) as channel:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(ECHO)(b"00000000", timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # hostname mismatch
        verify_tls_as(address, "rollout.internal")
        with make_sync_channel(address, tls_ca=certs["ca.pem"]) as channel:
            assert channel.unary_unary(ECHO)(b"00000000named", timeout=10) == b"00000000named"

        async def aio_call():
            async with make_channel(address, tls_ca=certs["ca.pem"]) as channel:
                return await channel.unary_unary(ECHO)(b"00000000aio", timeout=10)

        assert asyncio.run(aio_call()) == b"00000000aio"
    finally:
        proc.kill()
