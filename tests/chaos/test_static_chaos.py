"""Static placement under `kill -9` (real processes): the test plays the deployment, starting every
service as its own process on a fixed address and starting a killed one again on the same address
(as compose or Kubernetes restarts a container). One run of five GRPO steps on two engines:

  step 1  rollout-0 is killed while it generates: the step finishes on rollout-1; the test starts
          rollout-0 again; the coordinator waits for the address to answer health checks and pushes
          the current weights to it (version and checksum verified) before it gets prompts.
          A third engine, started by the deployment, is added by address (`rlmesh scale rollout
          --add`) while the run is paused; it too gets the current weights before its first prompt.
  step 3  the added engine is drained by address (`--remove`) while it generates: its in-flight
          samples finish (the step loses none) and it leaves the run.
  step 4  the learner is killed while it trains and started again by the test: the coordinator has
          it load the step-3 checkpoint, rewinds, redoes step 4.
  step 5  the coordinator is killed while the engines generate; the same command with
          --load_checkpoint reuses the running services (the same processes) and brings the engines
          to the step-4 checkpoint's weights before the run goes on. The weight group keeps its fixed
          --weight_sync_master port throughout: every new group replaces the last one on it.

Every step is there once, each generated and trained on all its samples.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import pathlib
import re
import signal
import time

import grpc

from rlmesh.coordinator.v1 import coordinator_pb2 as pb
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.coordinator.fleet.launcher import spawn_service, stop_all, wait_until_ready
from services.coordinator.cli.scale_cli import main as scale_main
from tests.chaos.harness import Holds, service_env
from tests.conftest import get_free_port
from tests.coordinator.conftest import control_stub, finish, read_metrics, start_coordinator, wait_for_file

STEPS = 5


class Deployment:
    """Services on fixed loopback ports, started (and started again) as a container runtime would."""

    def __init__(self, logs: pathlib.Path, model: pathlib.Path):
        self.logs, self.model = logs, model
        keep = ("DS_ACCELERATOR", "VLLM_CPU_KVCACHE_SPACE", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE",
                "TRANSFORMERS_OFFLINE")
        self.env = {k: v for k, v in service_env().items() if k in keep}
        self.env["LOCAL_RANK"] = "0"
        self.argv: dict[str, tuple[str, list[str]]] = {}
        self.procs: dict = {}

    def define(self, name: str, module: str, argv: list[str]) -> str:
        port = get_free_port()
        self.argv[name] = (module, [*argv, "--port", str(port)])
        return f"127.0.0.1:{port}"

    def start(self, *names: str) -> None:
        for name in names:
            module, argv = self.argv[name]
            self.procs[name] = spawn_service(name, module, argv, self.logs, env=self.env)

    def ready(self, *names: str, timeout_s: float = 300.0) -> None:
        async def wait():
            await asyncio.gather(*(wait_until_ready(self.procs[n], timeout_s) for n in names))
        asyncio.run(wait())

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)  # the container's processes, all at once
        self.procs[name].process.wait(30)

    def log_since_last_start(self, name: str) -> str:
        text = self.procs[name].log_path.read_text(errors="replace")
        return text[text.rfind("\n$ ") + 1:]

    def stop(self) -> None:
        stop_all(list(self.procs.values()), 20.0)

    def run_coordinator(self, argv: list[str], log: pathlib.Path, ready_file: pathlib.Path, run_dir: pathlib.Path):
        """Starts every defined service, waits for them, then starts the coordinator on them.
        Returns (process, control address, channel, control stub)."""
        self.start(*self.argv)
        self.ready(*self.argv)
        coordinator = start_coordinator("services.coordinator", argv, log)
        try:
            address = wait_for_file(ready_file, coordinator, log, timeout_s=120)["address"]
        except BaseException:
            coordinator.kill()
            raise
        return (coordinator, address, *control_stub(address, run_dir))


def wait_status(stub, predicate, proc, what: str, timeout_s: float = 300.0) -> pb.GetStatusResponse:
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the coordinator exited while waiting for {what}"
        try:
            status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        except grpc.RpcError:
            status = None
        if status is not None and predicate(status):
            return status
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s} s; last status: {status}")


def rollout_entry(status, index: int):
    return next((x for x in status.services if x.role == "rollout" and x.index == index), None)


def events(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def updated_before_generating(log: str) -> bool:
    update, generate = log.find("weights.update.done"), log.find("generate.start")
    return 0 <= update < generate


def test_static_services_die_restart_scale_and_the_coordinator_resumes(tiny_model_dir, tiny_data_dir, tmp_path):
    t0 = time.monotonic()
    model = str(tiny_model_dir)
    deploy = Deployment(tmp_path / "services", tiny_model_dir)
    rollout_args = ["--pretrain", model, "--engine", "hf", "--hf_device", "cpu", "--max_model_len", "128", "--seed", "0"]
    engines = [deploy.define(f"rollout-{i}", "services.rollout", rollout_args) for i in range(3)]
    reward = deploy.define("reward", "services.reward", ["--reward_func", "math,format", "--format_pattern", ".*th.*",
                                                         "--ref_pretrain", model, "--device", "cpu"])
    learner = deploy.define("learner", "services.learner", [
        "--pretrain", model, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--actor_learning_rate",
        "1e-3", "--lr_scheduler", "constant_with_warmup", "--lr_warmup_ratio", "0", "--seed", "0"])
    run_dir, ready_file = tmp_path / "run", tmp_path / "control.json"
    argv = ["--placement", "static", "--rollout_addresses", *engines[:2], "--reward_addresses", reward,
            "--learner_address", learner, "--weight_sync_master", f"127.0.0.1:{get_free_port()}",
            "--pretrain", model, "--prompt_data", str(tiny_data_dir / "arith_train.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--apply_chat_template", "--advantage_estimator", "group_norm",
            "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--micro_rollout_batch_size", "8",
            "--train_batch_size", "16", "--micro_train_batch_size", "8", "--generate_max_len", "32",
            "--prompt_max_len", "64", "--init_kl_coef", "0.01", "--use_kl_loss", "--kl_estimator", "k3",
            "--max_steps", str(STEPS), "--seed", "0", "--save_steps", "1", "--ckpt_path", str(tmp_path / "ckpt"),
            "--run_dir", str(run_dir), "--save_path", "", "--port", "0", "--ready_file", str(ready_file),
            "--restart_backoff_s", "0.5", "--rpc_timeout_s", "600", "--no-plots"]
    # The moments of the faults, held until the test has acted (each holds once: a restarted
    # service goes through).
    holds = Holds(tmp_path / "holds", "rollout.generate.started@rollout-0:step1",
                  "rollout.generate.started@rollout-2:step3", "learner.train.started@learner:step4",
                  "rollout.generate.started@rollout-1:step5")
    deploy.env.update(holds.env())
    coordinator = None
    try:
        log_a = tmp_path / "coordinator-a.log"
        coordinator, address, channel, stub = deploy.run_coordinator(argv, log_a, ready_file, run_dir)
        started_s = time.monotonic() - t0
        with channel:
            # Step 1: rollout-0 dies while generating; the deployment starts it again at once.
            holds.wait("rollout.generate.started@rollout-0:step1", coordinator)
            deploy.kill("rollout-0")
            deploy.start("rollout-0")
            stub.Pause(pb.PauseRequest(), timeout=10)
            paused = wait_status(stub, lambda s: s.state == pb.RUN_STATE_PAUSED, coordinator, "the pause")
            assert paused.global_step == 1, "step 1 did not finish on the other engine before the pause"
            # Serving again at its address: the supervisor saw it (it is admitted at the next push
            # or step start, or already was when it came back before step 1's push).
            wait_status(stub, lambda s: rollout_entry(s, 0).restarts == 1 and rollout_entry(s, 0).state in (
                "syncing", "serving"), coordinator, "rollout-0 back")
            # A third engine that the deployment started joins by address.
            assert scale_main(["rollout", "--add", engines[2], "--address", address, "--run_dir", str(run_dir)]) == 0
            stub.Resume(pb.ResumeRequest(), timeout=10)

            # Step 3: the added engine is drained by address while it generates.
            holds.wait("rollout.generate.started@rollout-2:step3", coordinator)
            assert scale_main(["rollout", "--remove", engines[2], "--address", address, "--run_dir", str(run_dir)]) == 0
            holds.release("rollout.generate.started@rollout-2:step3")

            # Step 4: the learner dies while training; the deployment starts it again at once.
            holds.wait("learner.train.started@learner:step4", coordinator)
            deploy.kill("learner")
            deploy.start("learner")

            # Step 5 (after the rewind and the redone step 4): the coordinator dies while the engines
            # generate; rollout-1 then finishes the call it was making for it.
            holds.wait("rollout.generate.started@rollout-1:step5", coordinator, timeout_s=400)
        os.kill(coordinator.pid, signal.SIGKILL)
        coordinator.wait(30)
        holds.release("rollout.generate.started@rollout-1:step5")
        first_run_s = time.monotonic() - t0
        pids = {name: p.pid for name, p in deploy.procs.items()}

        ready_file.unlink()
        log_b = tmp_path / "coordinator-b.log"
        coordinator = start_coordinator("services.coordinator", [*argv, "--load_checkpoint"], log_b)
        output = finish(coordinator, log_b, timeout_s=300)
        assert coordinator.returncode == 0, output[-6000:]
    finally:
        if coordinator is not None and coordinator.poll() is None:
            coordinator.kill()
        survivors = {name: p.alive() for name, p in deploy.procs.items()}
        engine_infos = []
        if all(survivors[f"rollout-{i}"] for i in range(2)):
            engine_infos = asyncio.run(_model_infos(engines[:2]))
        deploy.stop()
    print(f"services and coordinator started in {started_s:.1f} s; first coordinator killed at {first_run_s:.1f} s; "
          f"total {time.monotonic() - t0:.1f} s")

    # The resumed coordinator used the running services: the same processes, none of them restarted.
    assert survivors == {name: True for name in pids}, survivors
    assert {name: p.pid for name, p in deploy.procs.items()} == pids
    assert "resume.loaded step=4" in output
    assert "service.restarted" not in output and "service.died" not in output
    records = read_metrics(run_dir)
    assert [r["global_step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["samples/generated"] == 32 and r["samples/trained"] == 32 for r in records), records
    # Both engines hold the final weights (version and checksum), pushed by the resumed run.
    assert [i.weight_version for i in engine_infos] == [records[-1]["weights/version"]] * 2
    assert engine_infos[0].weights_checksum == engine_infos[1].weights_checksum

    log = events(run_dir)
    kinds = [(e["event"], e.get("service")) for e in log]
    for expected in (("service.died", "rollout-0"), ("service.restarted", "rollout-0"), ("rollout.admitted", "rollout-0"),
                     ("service.added", "rollout-2"), ("rollout.admitted", "rollout-2"),
                     ("service.draining", "rollout-2"), ("service.removed", "rollout-2"),
                     ("service.died", "learner"), ("service.restarted", "learner")):
        assert expected in kinds, (expected, kinds)
    rewinds = [(e["from_step"], e["to_step"]) for e in log if e["event"] == "learner.rewound"]
    assert rewinds == [(3, 3)], rewinds
    # The engine was drained while it generated (samples in flight); it finished them (no step but
    # the one the learner died in failed, no prompt moved to another engine) and then left.
    draining = next(e for e in log if e["event"] == "service.draining")
    removed = next(e for e in log if e["event"] == "service.removed")
    drained_log = deploy.procs["rollout-2"].log_path.read_text(errors="replace")
    finished = re.search(r"^(\S+) INFO rollout generate\.done request_id=step3-", drained_log, re.M)
    assert finished, drained_log[-3000:]
    finished_at = datetime.datetime.fromisoformat(finished.group(1).replace("Z", "+00:00")).timestamp()
    assert draining["unix_time"] < finished_at <= removed["unix_time"] + 0.01, (draining, finished.group(0), removed)
    assert "rollout.engine_failed request_id=step3" not in log_a.read_text()
    failed = [e["step"] for e in log if e["event"] == "step.failed"]
    assert failed == [4], log
    # Restarted and added engines got the current weights before their first prompt.
    assert updated_before_generating(deploy.log_since_last_start("rollout-0"))
    assert updated_before_generating(deploy.log_since_last_start("rollout-2"))
    # The resumed run pushed the step-4 checkpoint's weights (a new version, the checksum of the
    # weights the first run pushed after step 4) before the engines generated step 5.
    resumed_version = records[-1]["weights/version"] - 1  # then step 5's push
    for name in ("rollout-0", "rollout-1"):
        updates = dict(re.findall(r"weights\.update\.done version=(\d+) checksum=(\S+)",
                                  deploy.procs[name].log_path.read_text(errors="replace")))
        assert updates[str(resumed_version)] == updates[str(records[3]["weights/version"])], updates
    assert "weights.group_ready" in output[output.index("resume.loaded"):output.index("step.done")]

async def _model_infos(addresses: list[str]) -> list:
    from services.common.client import make_channel

    infos = []
    for address in addresses:
        async with make_channel(address, default_timeout_s=30) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            infos.append(await stub.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=30))
    return infos


def test_engine_restarted_between_health_checks_is_brought_back(tiny_model_dir, tiny_data_dir, tmp_path):
    """A rollout engine that the deployment restarts before the supervisor looks (here the poll is an
    hour apart: no death is ever seen) answers at its address with the initial weights. The next step
    finds it holding an old version, treats it as restarted (event rollout.lost_state) and pushes it
    the current weights before it gets prompts, instead of failing the run on its first Generate."""
    model = str(tiny_model_dir)
    deploy = Deployment(tmp_path / "services", tiny_model_dir)
    rollout_args = ["--pretrain", model, "--engine", "hf", "--hf_device", "cpu", "--max_model_len", "128", "--seed", "0"]
    engines = [deploy.define(f"rollout-{i}", "services.rollout", rollout_args) for i in range(2)]
    reward = deploy.define("reward", "services.reward", ["--reward_func", "math", "--device", "cpu"])
    learner = deploy.define("learner", "services.learner", [
        "--pretrain", model, "--train_batch_size", "16", "--micro_train_batch_size", "16", "--actor_learning_rate",
        "1e-3", "--seed", "0"])
    run_dir, ready_file = tmp_path / "run", tmp_path / "control.json"
    # A new rendezvous port per weight group (the default with a local learner); the fixed-port case
    # is the test above.
    argv = ["--placement", "static", "--rollout_addresses", *engines, "--reward_addresses", reward,
            "--learner_address", learner,
            "--pretrain", model, "--prompt_data", str(tiny_data_dir / "arith_train.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
            "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--micro_rollout_batch_size", "8",
            "--train_batch_size", "16", "--micro_train_batch_size", "16", "--generate_max_len", "16",
            "--prompt_max_len", "64", "--max_steps", "3", "--seed", "0", "--run_dir", str(run_dir),
            "--save_path", "", "--disable_ds_ckpt", "--port", "0", "--ready_file", str(ready_file),
            "--health_poll_s", "3600", "--no-plots"]
    holds = Holds(tmp_path / "holds", "rollout.generate.started@rollout-0:step1")
    deploy.env.update(holds.env())
    coordinator = None
    try:
        log = tmp_path / "coordinator.log"
        coordinator, address, channel, stub = deploy.run_coordinator(argv, log, ready_file, run_dir)
        with channel:
            holds.wait("rollout.generate.started@rollout-0:step1", coordinator)
            stub.Pause(pb.PauseRequest(), timeout=10)  # after step 1
            holds.release("rollout.generate.started@rollout-0:step1")
            paused = wait_status(stub, lambda s: s.state == pb.RUN_STATE_PAUSED, coordinator, "the pause")
            assert paused.global_step == 1
            deploy.kill("rollout-1")  # and back on its address before the supervisor's next look
            deploy.start("rollout-1")
            deploy.ready("rollout-1")
            stub.Resume(pb.ResumeRequest(), timeout=10)
        output = finish(coordinator, log, timeout_s=300)
        assert coordinator.returncode == 0, output[-6000:]
        infos = asyncio.run(_model_infos(engines))
    finally:
        if coordinator is not None and coordinator.poll() is None:
            coordinator.kill()
        deploy.stop()
    records = read_metrics(run_dir)
    assert [r["global_step"] for r in records] == [1, 2, 3]
    assert all(r["samples/generated"] == 16 and r["samples/trained"] == 16 for r in records), records
    log_events = events(run_dir)
    kinds = [(e["event"], e.get("service")) for e in log_events]
    assert ("service.died", "rollout-1") not in kinds  # unseen by the supervisor
    lost = kinds.index(("rollout.lost_state", "rollout-1"))
    admitted = [e for e in log_events[lost:] if e["event"] == "rollout.admitted" and e["service"] == "rollout-1"]
    assert admitted and admitted[0]["version"] == records[0]["weights/version"], log_events
    assert "step.failed" not in [k for k, _ in kinds]
    # It got step 1's weights before its first prompt, and both engines end on the last push.
    assert updated_before_generating(deploy.log_since_last_start("rollout-1"))
    assert [i.weight_version for i in infos] == [records[-1]["weights/version"]] * 2
    assert infos[0].weights_checksum == infos[1].weights_checksum
