"""Resilience and scaling in Ray placement: one GRPO run on the tiny model (hf engines, a local Ray
instance of the run's own), real service processes, real `kill -9`, never a mock.

1. rollout-0's service process and its Ray actor are killed while step 1 generates: the step
   finishes on rollout-1; a new actor on rollout-0's bundle starts the service again, and the engine
   is admitted at the next step's start only after the current weights were pushed to it (version
   and checksum verified).
2. `rlmesh scale rollout 3` (paused between steps) adds rollout-2 as an actor on a placement group
   of its own; it gets the current weights before its first prompt. `Scale rollout 2` during the
   next step's generation drains it (its in-flight samples still arrive) and removes it. A second
   reward + reference instance joins with rollout-2 (`Scale reward 2`) and leaves after step 3's
   learner restart (`Scale reward 1`).
3. The learner's service process is killed while step 3 trains: its actor (alive) starts it again,
   it loads the newest checkpoint and the step is done again.
4. Paused there, `Scale rollout 1` removes rollout-1, one of the run's first instances, whose bundle
   stays reserved in the placement group it shares; `Scale rollout 2` starts the new engine on that
   bundle (no new placement group), which is admitted and generates the last step.

The run ends with the steps and per-step sample counts of a run without faults; events.jsonl records
the deaths, restarts, admissions, additions and removals, the Prometheus counters the deaths and
restarts; no service process outlives the run.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

from rlmesh.coordinator.v1 import coordinator_pb2 as pb
from rlmesh.coordinator.v1 import coordinator_pb2_grpc
from services.common.client import make_sync_channel
from services.common.security import ClientCredentials
from services.coordinator.cli.scale_cli import main as scale_main
from tests.chaos.harness import REPO, Holds, grpo_argv, service_env

STEPS = 4


def _wait(stub, predicate, proc, timeout_s: float, what: str) -> pb.GetStatusResponse:
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the coordinator exited while waiting for {what}"
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
        if predicate(status):
            return status
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout_s} s; last status: {status}")


def _engine(status: pb.GetStatusResponse, index: int) -> pb.ServiceStatus | None:
    return next((s for s in status.services if s.role == "rollout" and s.index == index), None)


def _pid(run_dir: pathlib.Path, service: str) -> int:
    return json.loads((run_dir / "logs" / f"{service}.ready.json").read_text())["pid"]


def _parent(pid: int) -> int:
    """The Ray actor that started a service process is its parent."""
    return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def _running(pid: int) -> bool:
    """The process exists and is no zombie."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _since_last_start(log: str) -> str:
    """The part of a service's log written by its latest process (each start appends `$ command`)."""
    return log[log.rfind("\n$ ") + 1:]


def _events_text(run_dir: pathlib.Path, service: str) -> str:
    """The lines of events.jsonl about one service."""
    path = run_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return "\n".join(line for line in lines if f'"service": "{service}"' in line)


def _counter(metrics: str, name: str, **labels: str) -> float:
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in metrics.splitlines():
        if line.startswith(name + want + " "):
            return float(line.split()[-1])
    return 0.0


def test_ray_kills_restarts_and_scaling(tiny_model_dir, tiny_data_dir, tmp_path, capsys):
    argv = grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, 2, STEPS, "hf", "--placement", "ray",
                     "--ray_num_cpus", "2", "--metrics_port", "0", "--metrics_final_scrape_timeout_s", "0")
    log_path = tmp_path / "coordinator.log"
    # The moments of the faults, held until the test has acted (each once: a restarted service goes through).
    first_kill, drain, learner_kill = ("rollout.generate.started@rollout-0:step1",
                                       "rollout.generate.started@rollout-2:step2", "learner.train.started@learner:step3")
    holds = Holds(tmp_path / "holds", first_kill, drain, learner_kill)
    proc = subprocess.Popen([sys.executable, "-m", "services.coordinator", *argv], cwd=REPO,
                            env={**service_env(), **holds.env()},
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    try:
        while not (tmp_path / "control.json").is_file():
            assert proc.poll() is None and time.monotonic() - t0 < 300, log_path.read_text()[-4000:]
            time.sleep(0.2)
        control = json.loads((tmp_path / "control.json").read_text())
        token = (run_dir / "auth_token").read_text().strip()
        with make_sync_channel(control["address"], credentials=ClientCredentials(token=token),
                               default_timeout_s=600) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            # 1. rollout-0 dies while it generates for step 1: its service process and its Ray actor.
            engine_pid = holds.wait(first_kill, proc)
            actor_pid = _parent(engine_pid)
            os.kill(engine_pid, signal.SIGKILL)
            os.kill(actor_pid, signal.SIGKILL)
            stub.Pause(pb.PauseRequest(), timeout=30)
            _wait(stub, lambda s: s.state == pb.RUN_STATE_PAUSED and s.global_step == 1, proc, 300,
                  "the pause after step 1")
            # 2. A third engine, with the command-line client, while rollout-0 restarts.
            assert scale_main(["rollout", "3", "--address", control["address"], "--run_dir", str(run_dir)]) == 0
            added = json.loads(capsys.readouterr().out)
            assert len(added["added"]) == 1 and len(added["addresses"]) == 3
            # And a second reward + reference instance, through the RPC itself.
            reply = stub.Scale(pb.ScaleRequest(role="reward", replicas=2), timeout=300)
            assert len(reply.added) == 1 and len(reply.addresses) == 2
            reward_added = reply.added[0]
            _wait(stub, lambda s: _engine(s, 0).restarts == 1 and _engine(s, 0).state in ("syncing", "serving"),
                  proc, 300, "rollout-0 restarted")
            # A new actor (a new process) started it again.
            assert _parent(_pid(run_dir, "rollout-0")) not in (actor_pid, proc.pid)
            stub.Resume(pb.ResumeRequest(), timeout=30)
            # Both are admitted at step 2's start with version 1; rollout-2 is drained while it generates.
            holds.wait(drain, proc)
            reply = stub.Scale(pb.ScaleRequest(role="rollout", replicas=2), timeout=60)
            assert list(reply.removed) == [added["added"][0]] and len(reply.addresses) == 2
            holds.release(drain)
            # 3. The learner dies while step 3 trains; a pause holds the run after its rewind.
            learner_pid = holds.wait(learner_kill, proc)
            assert learner_pid == _pid(run_dir, "learner")
            learner_actor = _parent(learner_pid)
            os.kill(learner_pid, signal.SIGKILL)
            stub.Pause(pb.PauseRequest(), timeout=30)
            _wait(stub, lambda s: s.state == pb.RUN_STATE_PAUSED, proc, 300, "the pause after the learner's rewind")
            metrics_url = f"http://127.0.0.1:{control['metrics_port']}/metrics"
            metrics = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
            assert _parent(_pid(run_dir, "learner")) == learner_actor  # the same actor started it again
            reply = stub.Scale(pb.ScaleRequest(role="reward", replicas=1), timeout=60)
            assert list(reply.removed) == [reward_added] and len(reply.addresses) == 1
            # Stopped before the run goes on: the step left may be its last.
            _wait(stub, lambda s: "service.removed" in _events_text(run_dir, "reward-ref-1"), proc, 120,
                  "reward-ref-1 removed")
            # 4. Below the first instances and back: rollout-1 leaves its bundle reserved in the run's
            # shared placement group, and the engine added next takes it instead of a new group.
            reply = stub.Scale(pb.ScaleRequest(role="rollout", replicas=1), timeout=60)
            assert len(reply.removed) == 1 and len(reply.addresses) == 1
            _wait(stub, lambda s: "service.removed" in _events_text(run_dir, "rollout-1"), proc, 120,
                  "rollout-1 removed")
            reply = stub.Scale(pb.ScaleRequest(role="rollout", replicas=2), timeout=300)
            assert len(reply.added) == 1 and len(reply.addresses) == 2
            stub.Resume(pb.ResumeRequest(), timeout=30)
        proc.wait(300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    seconds = time.monotonic() - t0
    output = log_path.read_text(errors="replace")
    assert proc.returncode == 0, output[-8000:]
    print(f"Ray chaos run: {seconds:.1f} s")

    # The steps and samples of a run without faults.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["samples/generated"] == 32 and r["samples/trained"] == 32 for r in records)
    assert [r["weights/version"] for r in records][-1] >= STEPS

    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    of = lambda kind: [e for e in events if e["event"] == kind]  # noqa: E731
    assert sorted(e["service"] for e in of("service.died")) == ["learner", "rollout-0"], events
    assert sorted(e["service"] for e in of("service.restarted")) == ["learner", "rollout-0"], events
    how = {e["service"]: e["how"] for e in of("service.died")}
    assert how["learner"] == "learner exit code -9", how
    assert "rollout-0 exit code -9" in how["rollout-0"] or "Ray actor died" in how["rollout-0"], how
    assert "ray.actor_replaced service=rollout-0" in output
    admitted = [(e["service"], e["version"]) for e in of("rollout.admitted")]
    assert sorted(admitted[:2]) == [("rollout-0", 1), ("rollout-2", 1)], events
    assert [name for name, _ in admitted[2:]] == ["rollout-1"] and admitted[2][1] > 1, events
    assert [e["service"] for e in of("service.added")] == ["rollout-2", "reward-ref-1", "rollout-1"]
    assert sorted(e["service"] for e in of("service.draining")) == ["reward-ref-1", "rollout-1", "rollout-2"]
    # Added instances' groups went with them; the first instances' group was kept and reused.
    assert "ray.bundle_vacated service=rollout-1 " in output and "ray.bundle_vacated service=rollout-2" not in output
    assert "ray.bundle_reused service=rollout-1 bundle_of=rollout-1 " in output
    drained_with = next(e["in_flight"] for e in of("service.draining") if e["service"] == "rollout-2")
    print(f"rollout-2 drained with {drained_with} samples in flight; the learner was "
          f"killed during step 3; reward-ref-1 scored "
          f"{(run_dir / 'logs' / 'reward-ref-1.log').read_text().count('score.done')} batches")
    assert drained_with > 0  # held in its Generate call when the Scale came
    assert sorted(e["service"] for e in of("service.removed")) == ["reward-ref-1", "rollout-1", "rollout-2"]
    # With a checkpoint every step, back to the last completed step: only the step under way is redone.
    rewound = [(e["from_step"], e["to_step"]) for e in of("learner.rewound")]
    assert rewound == [(2, 2)], events

    # Step 1's prompts on the killed engine were generated on the other one.
    moved = of("rollout.prompts_moved")
    assert moved and all(e["service"] == "rollout-0" and e["request_id"].startswith("step1-") for e in moved), events
    # Restarted and added engines took version 1 (the checksum rollout-1 verified) before any prompt.
    logs = run_dir / "logs"
    reference = next(line for line in (logs / "rollout-1.log").read_text().splitlines()
                     if "weights.update.done" in line and "version=1 " in line)
    checksum = reference.split("checksum=")[1].split()[0]
    for name in ("rollout-0", "rollout-2"):
        log = _since_last_start((logs / f"{name}.log").read_text())
        first_update, first_generate = log.find("weights.update.done"), log.find("generate.start")
        assert 0 <= first_update < first_generate, log[-3000:]
        assert f"version=1 checksum={checksum}" in log[first_update:first_generate]
    # The engine on the reused bundle took the weights of its admission, then generated the last step.
    readded = _since_last_start((logs / "rollout-1.log").read_text())
    first_update, first_generate = readded.find("weights.update.done"), readded.find("generate.start")
    assert 0 <= first_update < first_generate and f"version={admitted[2][1]} " in readded[first_update:first_generate]
    # The drained engine answered every Generate it had started, then its actor stopped it.
    assert not re.search(r"rollout.engine_failed request_id=\S+ engine=2 ", output)
    drained = (logs / "rollout-2.log").read_text()
    assert drained.count("generate.start") == drained.count("generate.done") >= 1, drained[-3000:]
    assert drained.rfind("generate.done") < drained.find("server.stopping"), drained[-3000:]
    for name in ("rollout-2", "reward-ref-1"):
        assert "server.stopped" in (logs / f"{name}.log").read_text() and f"service.stopped service={name}" in output
    # The added reward + reference instance was in both scoring pools until it was drained.
    pools = [(e["event"], e["service"]) for e in events if e["event"].startswith("scoring.instance_")
             and e["address"] == reward_added]
    assert sorted(pools) == sorted((f"scoring.instance_{what}", role) for what in ("added", "removed")
                                   for role in ("reward", "reference")), events

    # The Prometheus counters, scraped while the run was paused after the learner's restart.
    assert _counter(metrics, "rlmesh_coordinator_service_restarts_total", service="rollout-0") == 1
    assert _counter(metrics, "rlmesh_coordinator_service_restarts_total", service="learner") == 1
    assert _counter(metrics, "rlmesh_coordinator_service_deaths_total", service="learner") == 1
    assert _counter(metrics, "rlmesh_coordinator_service_restart_duration_seconds_count", service="rollout-0") == 1
    assert _counter(metrics, "rlmesh_coordinator_recovered_samples_total") >= sum(e["lost_samples"] for e in moved)
    assert "ray.connected address=local" in output and "ray.stopped" in output  # a Ray instance of its own
    outlived = [ready.name for ready in logs.glob("*.ready.json") if _running(json.loads(ready.read_text())["pid"])]
    assert not outlived, f"service processes outlived the run: {outlived}"
