"""Elastic runs (--elastic) on a Ray cluster of loopback nodes with no spare: a head (127.0.0.2, no
GPUs, the driver's node) and three worker nodes of one logical GPU each, every one of them used by
the job (`rlmesh cluster`, services/coordinator/fleet/local_cluster.py). Jobs go in the guide's way
(`ray job submit`), the services on the CPU where the plan put their GPUs.

    engines     the node of one of two rollout engines is lost while it generates step 2: its prompts
                go to the other engine, it is left out after --elastic_wait_s, the run goes on with
                every step once and the samples of each step unchanged; a node joins, the engine
                starts there and is admitted with the current weights at the next step start
    learner     the node of learner rank 1 of 2 is lost while step 3 trains: the learner
                re-forms on rank 0 alone from step 2's checkpoint (universal checkpoint, twice the
                gradient accumulation), step 3 is done again and the run goes on; a node joins and
                the learner grows back to two ranks at a step start; every step after the loss has
                the metrics of a run started on one rank from the same checkpoint

The time from the kill to the next finished step is printed (docs/guides/resilience.md keeps the
measured values).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from rlmesh.coordinator.v1 import coordinator_pb2 as pb
from rlmesh.coordinator.v1 import coordinator_pb2_grpc
from services.common.client import make_sync_channel
from services.common.security import ClientCredentials
from services.coordinator.cli.control_cli import main as control_main
from services.coordinator.fleet.local_cluster import LocalCluster, free_port
from tests.chaos.harness import Holds
from tests.coordinator.conftest import REPO, read_metrics, service_env
from tests.coordinator.test_ray_multinode import common_argv, start_submit

WORKERS = 3
# What a step after the learner's loss is compared on with the run started on one rank.
COMPARED = ("reward/mean", "response_length/mean", "actor/policy_loss", "actor/grad_norm")


@pytest.fixture(scope="module")
def cluster():
    env = {k: v for k, v in service_env().items() if k in ("VLLM_CPU_KVCACHE_SPACE", "TOKENIZERS_PARALLELISM",
                                                          "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DS_ACCELERATOR",
                                                          "WANDB_MODE")}
    # A killed node is declared dead after 3 failed health checks 1 s apart (Ray's default: 5 x 3 s),
    # and Ray's own metrics are off (the head's agent would spend most of a core on them).
    env.update(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3",
               RAY_enable_metrics_collection="0")
    local = LocalCluster(pathlib.Path(tempfile.mkdtemp(prefix="rle-", dir="/tmp")), env=env)
    t0 = time.monotonic()
    local.up(workers=WORKERS, gpus_per_node=1, port=free_port(), dashboard_port=free_port(),
             head_env={"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "GLOO_SOCKET_IFNAME": "lo"})
    print(f"cluster of {WORKERS + 1} nodes up in {time.monotonic() - t0:.1f} s")
    try:
        yield local
    finally:
        local.down()
        shutil.rmtree(local.folder, ignore_errors=True)


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def training_argv(model: pathlib.Path, data: pathlib.Path, out: pathlib.Path, steps: int) -> list[str]:
    """GRPO on rule rewards (a format rule that random text meets at times: the rewards vary, the model
    learns), the reward instance on the actor's first GPU, no reference, a checkpoint every step."""
    argv = with_flag(common_argv(model, data, out), "--max_steps", str(steps))
    return [*argv, "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--train_batch_size", "16",
            "--micro_train_batch_size", "8", "--reward_func", "math,format",
            "--reward_extra_args", "--format_pattern .*th.*",
            "--label_key", "label", "--init_kl_coef", "0",
            "--actor_learning_rate", "1e-3", "--colocate_critic_reward", "--save_steps", "1", "--max_ckpt_num", "10",
            "--critic_num_nodes", "0", "--critic_num_gpus_per_node", "0", "--reward_num_nodes", "0",
            "--reward_num_gpus_per_node", "0", "--ref_num_nodes", "0", "--ref_num_gpus_per_node", "0"]


def elastic_argv(model: pathlib.Path, data: pathlib.Path, out: pathlib.Path, steps: int, *shape: str) -> list[str]:
    argv = with_flag(training_argv(model, data, out, steps), "--metrics_port", "0")
    return [*argv, *shape, "--elastic", "--elastic_wait_s", "10", "--port", "0",
            "--ready_file", str(out / "run" / "control.json"), "--metrics_final_scrape_timeout_s", "0"]


class Control:
    """The job's control API, polled (the job's log, relayed by `ray job submit`, lags)."""

    def __init__(self, proc: subprocess.Popen, log: pathlib.Path, run: pathlib.Path):
        self.proc, self.log, self.run = proc, log, run
        ready = run / "control.json"
        deadline = time.monotonic() + 600
        while not ready.is_file():
            self.check_alive(deadline)
            time.sleep(0.2)
        self.info = json.loads(ready.read_text())
        token = (run / "auth_token").read_text().strip()
        self.channel = make_sync_channel(self.info["address"], credentials=ClientCredentials(token=token),
                                         default_timeout_s=30)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    def check_alive(self, deadline: float) -> None:
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-8000:]
        assert time.monotonic() < deadline, self.log.read_text(errors="replace")[-8000:]

    def until(self, predicate, what: str, timeout_s: float = 600) -> pb.GetStatusResponse:
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive(deadline)
            status = self.stub.GetStatus(pb.GetStatusRequest(), timeout=30)
            if predicate(status):
                return status
            time.sleep(0.05)

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.info['metrics_port']}/metrics"
        return urllib.request.urlopen(url, timeout=30).read().decode()


def events(run: pathlib.Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def of(run: pathlib.Path, kind: str) -> list[dict]:
    return [e for e in events(run) if e["event"] == kind]


def sample(metrics: str, name: str, **labels: str) -> float:
    want = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + want + " "))


def host(address: str) -> str:
    return address.rpartition(":")[0]


def since_last_start(log: str) -> str:
    """The part of a service's log written by its latest process (each start appends `$ command`)."""
    return log[log.rfind("\n$ ") + 1:]


def test_engines_node_lost_without_a_spare_then_a_node_joins(cluster, tiny_model_dir, tiny_data_dir, tmp_path,
                                                             capsys):
    run, log = tmp_path / "run", tmp_path / "submit.log"
    argv = elastic_argv(tiny_model_dir, tiny_data_dir, tmp_path, 4, "--actor_num_nodes", "1",
                        "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "2")
    generating = "rollout.generate.started@rollout-1:step2"
    holds = Holds(tmp_path / "holds", generating)
    t0 = time.monotonic()
    proc = start_submit(cluster, argv, log, holds.env())
    lost = joined = None
    try:
        holds.wait(generating, proc, timeout_s=600)
        control = Control(proc, log, run)
        status = control.until(lambda s: True, "status")
        engines = {s.index: host(s.address) for s in status.services if s.role == "rollout"}
        learner = next(host(s.address) for s in status.services if s.role == "learner")
        assert len({engines[0], engines[1], learner}) == 3, (engines, learner)  # one GPU per node: no spare
        lost = engines[1]
        cluster.kill(lost)
        killed_at = time.time()
        control.stub.Pause(pb.PauseRequest(), timeout=30)
        # Step 2 ends on rollout-0; rollout-1 is left out once no node took its bundle.
        status = control.until(lambda s: s.state == pb.RUN_STATE_PAUSED and list(s.shape.left_out) == ["rollout-1"],
                               "the pause after step 2, rollout-1 left out")
        step2_s = read_metrics(run)[1]["unix_time"] - killed_at
        left_out_s = of(run, "service.left_out")[0]["unix_time"] - killed_at
        assert status.global_step == 2 and status.shape.elastic
        assert (status.shape.rollout_engines, status.shape.planned_rollout_engines) == (1, 2), status.shape
        assert next(s.state for s in status.services if s.role == "rollout" and s.index == 1) == "lost"
        assert control_main(["status", "--run_dir", str(run)]) == 0  # rlmesh control status shows the shape
        shown = json.loads(capsys.readouterr().out)["shape"]
        assert shown["rollout_engines"] == 1 and shown["planned_rollout_engines"] == 2, shown
        assert shown["left_out"] == ["rollout-1"] and shown["learner_ranks"] == 1, shown
        shrunk = control.metrics()
        t_join = time.monotonic()
        joined = cluster.join(gpus=1)
        # Ray moves the lost bundle to the new node; the engine starts there and waits for the weights.
        status = control.until(lambda s: not s.shape.left_out, "rollout-1 started again on the new node")
        back_s = time.monotonic() - t_join
        assert next(s.state for s in status.services if s.role == "rollout" and s.index == 1) == "syncing"
        grown = control.metrics()
        control.stub.Resume(pb.ResumeRequest(), timeout=30)
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        if lost is not None and joined is None:
            cluster.join(gpus=1)  # the other test plans on three worker nodes
    output = log.read_text(errors="replace")
    print(f"engines' node {lost} lost during step 2: step 2 done {step2_s:.1f} s after the kill, rollout-1 left out "
          f"after {left_out_s:.1f} s; {joined} joined, rollout-1 serving there {back_s:.1f} s later; job "
          f"{time.monotonic() - t0:.1f} s")
    assert code == 0 and "succeeded" in output, output[-8000:]

    records = read_metrics(run)
    assert [r["global_step"] for r in records] == [1, 2, 3, 4]  # every step once
    assert all(r["samples/generated"] == 16 and r["samples/trained"] == 16 for r in records), records
    assert not of(run, "learner.rewound") and not of(run, "step.failed")
    moved = of(run, "rollout.prompts_moved")
    assert moved and all(e["service"] == "rollout-1" and e["request_id"].startswith("step2-") for e in moved)
    assert [e["service"] for e in of(run, "service.left_out")] == ["rollout-1"]
    changes = [(e["event"], e["role"], e["was"], e["now"]) for e in events(run) if e["event"].startswith("elastic.")
               and "was" in e]
    assert changes == [("elastic.shrink", "rollout", 2, 1), ("elastic.grow", "rollout", 1, 2)], changes
    # Admitted with the current weights at step 3's start, then it generated there, on the new node.
    admitted = [e for e in of(run, "rollout.admitted") if e["service"] == "rollout-1"]
    assert len(admitted) == 1 and admitted[0]["version"] == 2, admitted
    assert f"ray.service_ready service=rollout-1 address={joined}:" in output
    restarted = since_last_start((run / "logs" / "rollout-1.log").read_text(errors="replace"))
    assert 0 <= restarted.find("weights.update.done") < restarted.find("generate.start"), restarted[-3000:]
    # The gauges and counters, scraped while paused: after the loss, then with the engine back.
    assert sample(shrunk, "rlmesh_coordinator_rollout_engines") == 1
    assert sample(shrunk, "rlmesh_coordinator_reshapes_total", role="rollout", change="shrink") == 1
    assert sample(shrunk, "rlmesh_coordinator_left_out_instances", role="rollout") == 1
    assert sample(grown, "rlmesh_coordinator_rollout_engines") == 2
    assert sample(grown, "rlmesh_coordinator_reshapes_total", role="rollout", change="grow") == 1
    assert sample(grown, "rlmesh_coordinator_learner_ranks") == 1


def test_learner_rank_node_lost_then_a_node_joins(cluster, tiny_model_dir, tiny_data_dir, tmp_path):
    run, log = tmp_path / "run", tmp_path / "submit.log"
    steps = 6
    argv = elastic_argv(tiny_model_dir, tiny_data_dir, tmp_path, steps, "--actor_num_nodes", "2",
                        "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1")
    training = "learner.train.started@learner:step3"
    holds = Holds(tmp_path / "holds", training)
    t0 = time.monotonic()
    proc = start_submit(cluster, argv, log, holds.env())
    lost = joined = None
    try:
        holds.wait(training, proc, timeout_s=600)
        control = Control(proc, log, run)
        status = control.until(lambda s: True, "status")
        rank0 = next(host(s.address) for s in status.services if s.role == "learner")
        engine = next(host(s.address) for s in status.services if s.role == "rollout")
        workers = [n.ip for n in cluster.state().nodes if not n.head]
        lost = next(ip for ip in workers if ip not in (rank0, engine))  # rank 1's node: one GPU per node
        cluster.kill(lost)
        killed_at = time.time()
        holds.release(training)
        status = control.until(lambda s: s.global_step >= 3, "step 3 done again on the rank left")
        step3_s = read_metrics(run)[2]["unix_time"] - killed_at
        assert (status.shape.learner_ranks, status.shape.planned_learner_ranks) == (1, 2), status.shape
        control.stub.Pause(pb.PauseRequest(), timeout=30)
        paused = control.until(lambda s: s.state == pb.RUN_STATE_PAUSED, "the pause").global_step
        t_join = time.monotonic()
        joined = cluster.join(gpus=1)
        deadline = time.monotonic() + 300
        while not [e for e in of(run, "elastic.node_back") if e.get("role") == "learner"]:
            control.check_alive(deadline)
            time.sleep(0.2)
        placed_s = time.monotonic() - t_join
        control.stub.Resume(pb.ResumeRequest(), timeout=30)
        status = control.until(lambda s: s.shape.learner_ranks == 2, "the learner back on two ranks")
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        if lost is not None and joined is None:
            cluster.join(gpus=1)
    output = log.read_text(errors="replace")
    print(f"learner rank 1's node {lost} lost during step 3's training: step 3 done again {step3_s:.1f} s after "
          f"the kill; paused after step {paused}, {joined} joined and took the lost bundle {placed_s:.1f} s later; "
          f"job {time.monotonic() - t0:.1f} s")
    assert code == 0 and "succeeded" in output, output[-8000:]

    records = read_metrics(run)
    assert [r["global_step"] for r in records] == list(range(1, steps + 1))
    assert all(r["samples/trained"] == 16 for r in records), records
    changes = [(e["event"], e["role"], e["was"], e["now"], e["step"]) for e in events(run)
               if e["event"].startswith("elastic.") and "was" in e]
    assert [c[:4] for c in changes] == [("elastic.shrink", "learner", 2, 1), ("elastic.grow", "learner", 1, 2)], changes
    grew_after = changes[1][4]
    assert grew_after == paused, (changes, paused)  # at the step start after the pause
    # Back to step 2's checkpoint after the loss (step 3 done again), to the grown learner's own
    # checkpoint at the step it grew (nothing done again).
    rewinds = [(e["from_step"], e["to_step"]) for e in of(run, "learner.rewound")]
    assert rewinds == [(2, 2), (grew_after, grew_after)], rewinds
    # Each re-formed learner converted the checkpoint it loaded (2 ranks -> 1, then 1 -> 2).
    for step in (2, grew_after):
        assert (tmp_path / "ckpt" / f"global_step_{step}" / "universal" / "universal.json").is_file(), step

    # The run started on one rank from step 2's checkpoint (converted anew) has the same metrics.
    base = tmp_path / "one-rank"
    (base / "ckpt").mkdir(parents=True)
    shutil.copytree(tmp_path / "ckpt" / "global_step_2", base / "ckpt" / "global_step_2",
                    ignore=shutil.ignore_patterns("universal"))
    (base / "ckpt" / "latest").write_text("global_step_2\n")
    base_argv = [*training_argv(tiny_model_dir, tiny_data_dir, base, steps), "--placement", "local",
                 "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1",
                 "--load_checkpoint", "--use_ds_universal_ckpt"]
    t1 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "services.coordinator", *base_argv], cwd=REPO, env=service_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-8000:]
    print(f"the one-rank run from step 2's checkpoint took {time.monotonic() - t1:.1f} s")
    baseline = {r["global_step"]: r for r in read_metrics(base / "run")}
    assert any(r["actor/grad_norm"] > 0 for r in records[2:]), records  # the model learned: the check can fail
    for record in records[2:]:
        other = baseline[record["global_step"]]
        for key in COMPARED:
            assert record[key] == pytest.approx(other[key], rel=1e-4, abs=1e-6), (record["global_step"], key)
