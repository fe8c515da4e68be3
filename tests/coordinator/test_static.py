"""Static placement against services this test starts (as a deployment would), sharing them across
runs: GRPO (with DAPO dynamic filtering and the overlong penalty) with checkpoints, the control API
(GetStatus, StreamMetrics, Pause, Resume) and the Prometheus endpoint, then a resume from an
earlier checkpoint that reproduces the uninterrupted run's next step, ended by Stop.

Rewards: the math rule plus the format rule with a pattern that about half of the random tiny
model's responses match, so the policy has something to learn and the weights change every step.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import urllib.request

import pytest

from rlmesh.coordinator.v1 import coordinator_pb2 as pb
from services.coordinator.loop import checkpoint
from services.coordinator.fleet.launcher import spawn_service, stop_all, wait_until_ready
from tests.coordinator.conftest import (control_stub, finish, read_metrics, service_env, start_coordinator,
                                        wait_for_file)

# What the resumed step must reproduce, and how closely: exactly (relative tolerance 1e-9, i.e. the
# same float64 values). The same prompts and generation seeds on the same weights give the same
# samples; micro-batches are fixed by prompt order, so rewards and log-probs are bit-identical; the
# learner restores its state exactly and shuffles with the step's seed, so training is too.
COMPARED = ("reward/mean", "reward/std", "response_length/mean", "kl/mean", "advantages/abs_mean",
            "advantages/mean", "actor/policy_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl",
            "actor/clip_ratio", "filter/kept_groups")
RTOL = 1e-9


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("static-services")
    env = {k: v for k, v in service_env().items() if k in ("DS_ACCELERATOR", "VLLM_CPU_KVCACHE_SPACE",
                                                          "TOKENIZERS_PARALLELISM", "LOCAL_RANK")}
    env["LOCAL_RANK"] = "0"
    model = str(tiny_model_dir)
    procs = [
        spawn_service("rollout", "services.rollout", ["--pretrain", model, "--gpu_memory_utilization", "0.1",
                                                      "--max_model_len", "128", "--seed", "0", "--enforce_eager"], logs, env=env),
        spawn_service("reward", "services.reward", ["--reward_func", "math,format", "--format_pattern", ".*th.*",
                                                    "--ref_pretrain", model, "--device", "cpu"], logs, env=env),
        spawn_service("learner", "services.learner", ["--pretrain", model, "--train_batch_size", "16",
                                                      "--micro_train_batch_size", "8", "--actor_learning_rate", "1e-3",
                                                      "--lr_scheduler", "constant_with_warmup", "--lr_warmup_ratio",
                                                      "0", "--seed", "0"], logs, env=env),
    ]

    async def ready():
        await asyncio.gather(*(wait_until_ready(p, 600) for p in procs))

    try:
        asyncio.run(ready())
        yield {p.name: p.address for p in procs}
    finally:
        stop_all(procs, 30.0)


def coordinator_argv(services, model, data, tmp_path, *extra) -> list[str]:
    # --pretrain: the coordinator tokenizes the prompts with the policy's tokenizer.
    return ["--placement", "static", "--rollout_addresses", services["rollout"],
            "--reward_addresses", services["reward"], "--learner_address", services["learner"],
            "--pretrain", str(model), "--prompt_data", str(data / "arith_train.jsonl"),
            "--input_key", "prompt", "--label_key", "label", "--apply_chat_template",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8",
            "--micro_rollout_batch_size", "8", "--train_batch_size", "16", "--micro_train_batch_size", "8",
            "--generate_max_len", "16", "--prompt_max_len", "64", "--init_kl_coef", "0.01", "--use_kl_loss",
            "--kl_estimator", "k3", "--ckpt_path", str(tmp_path / "ckpt"), "--run_dir", str(tmp_path / "run"),
            "--save_path", "", "--save_steps", "1", "--port", "0", "--ready_file", str(tmp_path / "control.json"),
            "--no-plots",
            # DAPO: groups whose samples all score the same are dropped and refilled; long answers pay.
            "--dynamic_filtering", "--dynamic_filtering_reward_range", "0", "1",
            "--overlong_buffer_len", "4", "--overlong_penalty_factor", "0.5", *extra]


def wait_state(stub, state: int, timeout_s: float = 120.0) -> pb.GetStatusResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        if status.state == state or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def test_static_grpo_control_api_and_resume(services, tiny_model_dir, tiny_data_dir, tmp_path):
    argv = coordinator_argv(services, tiny_model_dir, tiny_data_dir, tmp_path, "--max_steps", "3")
    log = tmp_path / "run-a.log"
    proc = start_coordinator("services.coordinator", argv, log)
    info = wait_for_file(tmp_path / "control.json", proc, log, timeout_s=120)
    channel, stub = control_stub(info["address"], tmp_path / "run")
    with channel:
        stream = stub.StreamMetrics(pb.StreamMetricsRequest(since_step=0), timeout=300)
        first = next(stream)
        assert first.global_step == 1 and "reward/mean" in first.metrics
        prometheus = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=10).read()
        assert b"rlmesh_coordinator_reward_mean" in prometheus
        assert b'rlmesh_coordinator_phase_duration_seconds_count{phase="generate"}' in prometheus
        # Pause takes effect between steps; Resume continues.
        stub.Pause(pb.PauseRequest(), timeout=10)
        paused = wait_state(stub, pb.RUN_STATE_PAUSED)
        assert paused.state == pb.RUN_STATE_PAUSED and paused.phase == pb.PHASE_IDLE
        roles = {(s.role, s.health) for s in paused.services}
        assert roles == {("rollout", pb.SERVICE_HEALTH_SERVING), ("reward", pb.SERVICE_HEALTH_SERVING),
                         ("reference", pb.SERVICE_HEALTH_SERVING), ("learner", pb.SERVICE_HEALTH_SERVING)}
        step_when_paused = paused.global_step
        time.sleep(1.0)
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).global_step == step_when_paused
        stub.Resume(pb.ResumeRequest(), timeout=10)
        streamed = [first.global_step] + [m.global_step for m in stream]
        assert streamed == [1, 2, 3]
    output = finish(proc, log, timeout_s=300)
    assert proc.returncode == 0, output[-6000:]
    run_a = read_metrics(tmp_path / "run")
    assert [r["global_step"] for r in run_a] == [1, 2, 3]
    assert [r["weights/version"] for r in run_a] == sorted({r["weights/version"] for r in run_a})
    assert any(r["actor/grad_norm"] > 0 for r in run_a), "the policy never got a gradient"
    for r in run_a:
        # Filtering kept exactly rollout_batch_size mixed groups (refilling when needed).
        assert r["filter/kept_groups"] >= 8 and r["samples/trained"] == 32
        assert r["reward/overlong_penalty"] < 0
    assert checkpoint.latest_step(tmp_path / "ckpt") == 3

    # As if the run had died right after step 2's checkpoint: `latest` names step 2.
    checkpoint.write_atomic(tmp_path / "ckpt" / "latest", "global_step_2\n")
    shutil.copy(tmp_path / "run" / "metrics.jsonl", tmp_path / "metrics-a.jsonl")
    (tmp_path / "control.json").unlink()
    argv_b = coordinator_argv(services, tiny_model_dir, tiny_data_dir, tmp_path, "--max_steps", "6",
                              "--load_checkpoint")
    log_b = tmp_path / "run-b.log"
    proc = start_coordinator("services.coordinator", argv_b, log_b)
    info = wait_for_file(tmp_path / "control.json", proc, log_b, timeout_s=120)
    channel, stub = control_stub(info["address"], tmp_path / "run")
    with channel:
        stream = stub.StreamMetrics(pb.StreamMetricsRequest(since_step=-1), timeout=300)
        resumed = next(stream)
        assert resumed.global_step == 3
        # Graceful stop: the step in progress finishes, a checkpoint is written, the run ends.
        reply = stub.Stop(pb.StopRequest(wait=True), timeout=300)
        assert reply.state == pb.RUN_STATE_FINISHED and reply.checkpoint_step == reply.final_step >= 3
    output = finish(proc, log_b, timeout_s=120)
    assert proc.returncode == 0, output[-6000:]
    assert "resume.loaded step=2" in output
    assert checkpoint.latest_step(tmp_path / "ckpt") == reply.final_step
    expected = run_a[2]
    for key in COMPARED:
        assert resumed.metrics[key] == pytest.approx(expected[key], rel=RTOL, abs=1e-12), key
