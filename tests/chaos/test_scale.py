"""Scaling a running run through the control API (local placement, real processes): a second rollout
engine and a second reward + reference instance join after step 1; the new engine receives the
current weights (version and checksum verified) before its first prompt; then the engine is
drained and removed while the run goes on, and every step still generates and trains its samples."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import grpc

from rlmesh.coordinator.v1 import coordinator_pb2 as pb
from rlmesh.coordinator.v1 import coordinator_pb2_grpc
from services.common.client import make_sync_channel
from services.common.security import ClientCredentials
from services.coordinator.cli.scale_cli import main as scale_main
from tests.chaos.harness import REPO, grpo_argv, service_env

STEPS = 5


def _status(stub) -> pb.GetStatusResponse:
    return stub.GetStatus(pb.GetStatusRequest(), timeout=30)


def _wait(stub, predicate, proc, timeout_s: float, what: str) -> pb.GetStatusResponse:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the coordinator exited while waiting for {what}"
        status = _status(stub)
        if predicate(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout_s} s; last status: {status}")


def test_scale_rollout_and_reward_while_running(tiny_model_dir, tiny_data_dir, tmp_path, capsys):
    # Step time: a few seconds; --max_steps leaves room for the scaling between steps.
    argv = grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, 1, STEPS)
    log = open(tmp_path / "coordinator.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.coordinator", *argv], cwd=REPO, env=service_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    run_dir = tmp_path / "run"
    try:
        deadline = time.monotonic() + 600
        while not (tmp_path / "control.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()[-4000:]
            time.sleep(0.2)
        address = json.loads((tmp_path / "control.json").read_text())["address"]
        token = (run_dir / "auth_token").read_text().strip()
        with make_sync_channel(address, credentials=ClientCredentials(token=token), default_timeout_s=600) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            # After a push (the new engine must receive trained weights), paused between steps so the
            # run cannot end before the new instances are up.
            _wait(stub, lambda s: s.global_step >= 1, proc, 600, "step 1")
            stub.Pause(pb.PauseRequest(), timeout=30)
            _wait(stub, lambda s: s.state == pb.RUN_STATE_PAUSED, proc, 600, "the pause after a step")
            # The command-line client, as a user types it.
            assert scale_main(["rollout", "2", "--address", address, "--run_dir", str(run_dir)]) == 0
            added = json.loads(capsys.readouterr().out)
            assert len(added["added"]) == 1 and len(added["addresses"]) == 2
            reply = stub.Scale(pb.ScaleRequest(role="reward", replicas=2), timeout=600)
            assert len(reply.addresses) == 2 and len(reply.added) == 1
            # Asking for a count again is a no-op; a bad request names the fix.
            assert not stub.Scale(pb.ScaleRequest(role="rollout", replicas=2), timeout=60).added
            try:
                stub.Scale(pb.ScaleRequest(role="learner", replicas=2), timeout=60)
                raise AssertionError("scaling the learner was accepted")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "rollout or reward" in exc.details()
            stub.Resume(pb.ResumeRequest(), timeout=30)
            # Admitted at the next step's start; after that step's push it holds the new version too.
            status = _wait(stub, lambda s: s.weight_version >= 1 and any(
                x.role == "rollout" and x.index == 1 and x.state == "serving" and x.weight_version == s.weight_version
                for x in s.services), proc, 600, "the new engine admitted")
            step_admitted = status.global_step
            stub.Pause(pb.PauseRequest(), timeout=30)
            _wait(stub, lambda s: s.state == pb.RUN_STATE_PAUSED and s.global_step > step_admitted, proc, 600,
                  "a step with two engines")
            reply = stub.Scale(pb.ScaleRequest(role="rollout", replicas=1), timeout=60)
            assert list(reply.removed) == [added["added"][0]] and len(reply.addresses) == 1
            stub.Resume(pb.ResumeRequest(), timeout=30)
        proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = (tmp_path / "coordinator.log").read_text()
    assert proc.returncode == 0, output[-6000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["samples/generated"] == 32 and r["samples/trained"] == 32 for r in records)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    for kind in ("service.added", "rollout.admitted", "service.draining", "service.removed"):
        assert kind in kinds, kinds
    assert sorted(e["service"] for e in events if e["event"] == "service.added") == ["reward-ref-1", "rollout-1"]
    # The new engine took the current weights before its first prompt.
    engine_log = (run_dir / "logs" / "rollout-1.log").read_text()
    first_update = engine_log.find("weights.update.done")
    first_generate = engine_log.find("generate.start")
    assert 0 <= first_update < first_generate, engine_log[-3000:]
    assert re.search(r"service.stopped service=rollout-1", output)
