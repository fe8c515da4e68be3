"""A run as an attacker on the same machine finds it: every service started by the coordinator
serves mutual TLS with the run's certificate and requires the run's token, the coordinator's
channels use both, and a GRPO run trains to its end. Meanwhile a loopback client without the token
(even one holding a valid client certificate) cannot pause, stop or scale the run, push weights into or
put to sleep the rollout engine, make the learner save, prune or export; a plaintext client is
refused outright; and with the token the learner still refuses to export into, or save into, a
folder of files it did not write, and its pruning leaves such folders alone. Certificates are made
at test time with `cryptography`."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rlmesh.coordinator.v1 import coordinator_pb2 as cpb
from rlmesh.coordinator.v1 import coordinator_pb2_grpc
from rlmesh.learner.v1 import learner_pb2, learner_pb2_grpc
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.client import make_sync_channel
from services.common.security import ClientCredentials
from tests.coordinator.conftest import (REPO, finish, read_metrics, service_env, service_pids, start_coordinator,
                                        wait_for_file)


def make_certs(folder):
    """A CA and one certificate for 127.0.0.1 / localhost that serves and identifies clients."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlmesh-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlmesh-run")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.pem", "cert": folder / "run.pem", "key": folder / "run.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return {k: str(v) for k, v in paths.items()}


def refused(call, code=grpc.StatusCode.UNAUTHENTICATED) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def wait_state(stub, metadata, state: int, timeout_s: float = 600.0) -> cpb.GetStatusResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        status = stub.GetStatus(cpb.GetStatusRequest(), timeout=10, metadata=metadata)
        if status.state == state or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def rlmesh_control(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "control", *argv], cwd=REPO, env=service_env(),
                          capture_output=True, text=True, timeout=120)


def listening_ips(pid: int) -> set[str]:
    """Addresses the process and its children listen on (gRPC, metrics, rendezvous store, gloo)."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {c.laddr.ip.removeprefix("::ffff:") for p in procs for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def test_attacks_on_a_tls_run_fail_and_the_run_trains(tiny_model_dir, tiny_data_dir, tmp_path):
    certs = make_certs(tmp_path)
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = ["--pretrain", str(tiny_model_dir), "--prompt_data", str(tiny_data_dir / "arith_train.jsonl"),
            "--input_key", "prompt", "--label_key", "label", "--reward_func", "math", "--init_kl_coef", "0",
            "--advantage_estimator", "rloo", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
            "--train_batch_size", "8", "--micro_train_batch_size", "4", "--rollout_engine", "hf",
            "--generate_max_len", "8", "--max_steps", "4", "--save_steps", "1", "--max_ckpt_num", "1",
            "--run_dir", str(run_dir), "--ckpt_path", str(ckpt), "--save_path", str(tmp_path / "model"),
            "--port", "0", "--ready_file", str(tmp_path / "control.json"),
            "--tls_cert", certs["cert"], "--tls_key", certs["key"], "--tls_ca", certs["ca"],
            "--tls_client_ca", certs["ca"], "--no-plots"]
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator", argv, log)
    info = wait_for_file(tmp_path / "control.json", proc, log, timeout_s=300)
    token = (run_dir / "auth_token").read_text().strip()
    assert (run_dir / "auth_token").stat().st_mode & 0o077 == 0  # this user's alone
    assert token not in (run_dir / "config.json").read_text()
    with_cert = ClientCredentials(tls_ca=certs["ca"], tls_cert=certs["cert"], tls_key=certs["key"])
    auth = (("authorization", f"Bearer {token}"),)
    try:
        # Plaintext, and TLS without a client certificate, do not get a connection at all.
        with make_sync_channel(info["address"], credentials=ClientCredentials()) as channel:
            refused(lambda: coordinator_pb2_grpc.CoordinatorServiceStub(channel).GetStatus(
                cpb.GetStatusRequest(), timeout=10), grpc.StatusCode.UNAVAILABLE)
        with make_sync_channel(info["address"], credentials=ClientCredentials(tls_ca=certs["ca"])) as channel:
            refused(lambda: coordinator_pb2_grpc.CoordinatorServiceStub(channel).GetStatus(
                cpb.GetStatusRequest(), timeout=10), grpc.StatusCode.UNAVAILABLE)
        with make_sync_channel(info["address"], credentials=with_cert) as channel:
            control = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            # A certificate is not the token: the run cannot be paused or stopped without it.
            message = refused(lambda: control.Pause(cpb.PauseRequest(), timeout=10))
            assert "CoordinatorService/Pause" in message and "authorization: Bearer" in message
            refused(lambda: control.Stop(cpb.StopRequest(skip_checkpoint=True), timeout=10))
            refused(lambda: control.Scale(cpb.ScaleRequest(role="rollout", replicas=8), timeout=10))
            refused(lambda: control.Pause(cpb.PauseRequest(), timeout=10, metadata=(("authorization", "Bearer x"),)))
            tls_flags = ["--address", info["address"], "--tls_ca", certs["ca"], "--tls_cert", certs["cert"],
                         "--tls_key", certs["key"]]
            denied = rlmesh_control("stop", *tls_flags)
            assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr, denied.stderr
            # The run's owner pauses once the first step is done (and checkpointed), to look around.
            # Generous deadline: services start and step 1 can take minutes on a loaded 2-core machine.
            next(control.StreamMetrics(cpb.StreamMetricsRequest(since_step=0), timeout=900))
            control.Pause(cpb.PauseRequest(), timeout=10, metadata=auth)
            paused = wait_state(control, auth, cpb.RUN_STATE_PAUSED)
            assert paused.state == cpb.RUN_STATE_PAUSED and paused.global_step >= 1, paused
            address = {s.role: s.address for s in paused.services}
            assert {s.health for s in paused.services} == {cpb.SERVICE_HEALTH_SERVING}  # TLS health checks

            pids = service_pids(run_dir)
            for name, pid in pids.items():
                assert listening_ips(pid) == {"127.0.0.1"}, name
                assert token not in " ".join(psutil.Process(pid).cmdline()), name

            with make_sync_channel(address["rollout"], credentials=ClientCredentials()) as plain:
                refused(lambda: rollout_pb2_grpc.RolloutServiceStub(plain).GetModelInfo(
                    rollout_pb2.GetModelInfoRequest(), timeout=10), grpc.StatusCode.UNAVAILABLE)
            with make_sync_channel(address["rollout"], credentials=with_cert) as channel:
                rollout = rollout_pb2_grpc.RolloutServiceStub(channel)
                before = rollout.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=10)  # read-only: open
                refused(lambda: rollout.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(
                    backend=rollout_pb2.WEIGHT_BACKEND_GLOO, master_address="127.0.0.1", master_port=1,
                    world_size=2, rank_offset=1), timeout=10))
                refused(lambda: rollout.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=1000, final=True),
                                                      timeout=10))
                refused(lambda: rollout.Sleep(rollout_pb2.SleepRequest(level=1), timeout=10))
                refused(lambda: rollout.WakeUp(rollout_pb2.WakeUpRequest(), timeout=10))
                after = rollout.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=10)
                assert after.weight_version == before.weight_version == paused.weight_version
                assert after.weights_checksum == before.weights_checksum

            victim = tmp_path / "victim"
            victim.mkdir()
            (victim / "config.json").write_text("{\"mine\": true}")
            (victim / "notes.txt").write_text("keep me")
            foreign = tmp_path / "foreign"
            (foreign / "global_step_1").mkdir(parents=True)
            (foreign / "global_step_1" / "weights.bin").write_text("someone else's")
            saved_steps = sorted(p.name for p in ckpt.iterdir())
            with make_sync_channel(address["learner"], credentials=with_cert) as channel:
                learner = learner_pb2_grpc.LearnerServiceStub(channel)
                learner.GetInfo(learner_pb2.GetInfoRequest(), timeout=10)  # read-only: open
                refused(lambda: learner.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(
                    ckpt_path=str(ckpt), global_step=99, max_ckpt_num=1), timeout=60))
                refused(lambda: learner.ExportHF(learner_pb2.ExportHFRequest(output_dir=str(victim)), timeout=60))
                refused(lambda: learner.Offload(learner_pb2.OffloadRequest(), timeout=10))
                assert sorted(p.name for p in ckpt.iterdir()) == saved_steps
                # With the token: folders of files the learner did not write are still refused.
                message = refused(lambda: learner.ExportHF(learner_pb2.ExportHFRequest(output_dir=str(victim)),
                                                           timeout=60, metadata=auth),
                                  grpc.StatusCode.FAILED_PRECONDITION)
                assert "did not write" in message and "notes.txt" in message
                refused(lambda: learner.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(
                    ckpt_path=str(foreign), global_step=2, max_ckpt_num=1), timeout=60, metadata=auth),
                    grpc.StatusCode.FAILED_PRECONDITION)
            assert sorted(p.name for p in victim.iterdir()) == ["config.json", "notes.txt"]
            assert (victim / "config.json").read_text() == "{\"mine\": true}"
            assert sorted(p.name for p in foreign.rglob("*")) == ["global_step_1", "weights.bin"]
            # A folder named like a checkpoint inside the run's checkpoint root, not written by the
            # learner: --max_ckpt_num 1 pruning over the next steps must leave it.
            (ckpt / "global_step_0").mkdir()
            (ckpt / "global_step_0" / "data.txt").write_text("not a checkpoint")

            # The owner's shell: `rlmesh control` over mutual TLS, the token read from the run folder.
            resumed = rlmesh_control("resume", *tls_flags, "--run_dir", str(run_dir))
            assert resumed.returncode == 0 and "RUN_STATE_RUNNING" in resumed.stdout, resumed.stderr
        output = finish(proc, log, timeout_s=900)
        assert proc.returncode == 0, output[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    records = read_metrics(run_dir)
    assert [r["global_step"] for r in records] == [1, 2, 3, 4]
    assert [r["weights/version"] for r in records] == [1, 2, 3, 4]  # each push verified over TLS
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global_step_")) == \
        ["global_step_0", "global_step_4"]
    assert (ckpt / "global_step_0" / "data.txt").read_text() == "not a checkpoint"
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "model" / "model.safetensors").is_file()
