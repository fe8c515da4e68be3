"""TLS and mutual TLS on the shared runner, with certificates made by openssl for the test."""

import shutil
import subprocess

import grpc
import pytest

from services.common.client import make_sync_channel
from tests.common.test_server import ECHO, start_echo

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")


def make_certs(d):
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=rlmesh-test-ca")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", "/CN=localhost")
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
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
