"""The coordinator on a CUDA GPU (skipped without one): the skill page's hybrid-engine GRPO command
on one GPU, placed locally and on a local Ray instance. Every role shares the GPU; vLLM sleeps
while the learner trains and the learner offloads while vLLM generates; weights travel over CUDA
IPC and are verified on the engine after every step. The runs are pinned to the first visible GPU
(CUDA_VISIBLE_DEVICES), so they test the one-GPU layout on a machine with any number of GPUs
(Ray would otherwise count every GPU of the machine).

    PYTHONPATH=.:protos python -m pytest tests/coordinator/test_gpu.py -x -q
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.chaos.harness import Holds
from tests.coordinator.conftest import finish, pid_alive, read_metrics, service_pids, start_coordinator
from tests.coordinator.test_local import seed_grpo_command

pytestmark = pytest.mark.requires_cuda

HYBRID = ["--vllm_enable_sleep", "--deepspeed_enable_sleep", "--vllm_gpu_memory_utilization", "0.2",
          "--enforce_eager"]


def first_visible_gpu() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return visible.split(",")[0] if visible else "0"


def run_hybrid(tmp_path, monkeypatch, model, reward_model, data, *extra):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu())  # the coordinator, its services and Ray
    argv = seed_grpo_command(model, reward_model, data, tmp_path) + HYBRID + list(extra)
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator.train_ppo_ray", argv, log)
    output = finish(proc, log, timeout_s=540)
    assert proc.returncode == 0, output[-6000:]
    assert "rollout.sleep_unsupported" not in output and "weights.group_ready" not in output  # ipc: no group
    records = read_metrics(tmp_path / "run")
    assert [r["global_step"] for r in records] == [1, 2]
    assert [r["weights/version"] for r in records] == [1, 2]
    assert all(r["samples/trained"] == 16 for r in records)
    pids = service_pids(tmp_path / "run")
    assert not [name for name, pid in pids.items() if pid_alive(pid)], "services outlived the coordinator"
    # The learner ran its forward paths once before step 1 (services/learner/warmup.py).
    learner_logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("learner*.log"))
    warm = [float(s) for s in re.findall(r"rank\.ready .*warm_up_s=([0-9.]+)", learner_logs)]
    assert warm and all(s > 0 for s in warm), learner_logs[-3000:]
    return output, records


def test_hybrid_engine_on_one_gpu_local(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path, monkeypatch):
    run_hybrid(tmp_path, monkeypatch, tiny_model_dir, tiny_reward_model_dir, tiny_data_dir)


def test_hybrid_engine_on_one_gpu_ray(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path, monkeypatch):
    pytest.importorskip("ray")
    output, _ = run_hybrid(tmp_path, monkeypatch, tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, "--placement", "ray")
    assert "ray.connected address=local gpus=1" in output


def test_two_engines_share_the_one_gpu(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path, monkeypatch):
    """--vllm_num_engines 2 colocated on one actor GPU: both engines start on that GPU with their
    share of its memory, sleep while the learner trains, generate and take every IPC push."""
    run_hybrid(tmp_path, monkeypatch, tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, "--vllm_num_engines", "2")
    logs = tmp_path / "run" / "logs"
    for name in ("rollout-0", "rollout-1"):
        text = (logs / f"{name}.log").read_text()
        assert "generate.done" in text and "weights.update.done version=2" in text, text[-3000:]
        assert "engine.sleep" in text, text[-3000:]


def test_hybrid_engine_on_one_gpu_with_lora(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path,
                                            monkeypatch):
    """The same command with LoRA: the engine (CUDA vLLM, sleeping between generations) takes
    adapter-only pushes over CUDA IPC, merged into its weights; each push is the adapter's bytes."""
    from transformers import AutoModelForCausalLM

    from services.learner.lora import LoraOptions, adapter_state, apply_lora

    _, records = run_hybrid(tmp_path, monkeypatch, tiny_model_dir, tiny_reward_model_dir, tiny_data_dir,
                            "--lora_rank", "8", "--lora_alpha", "16")
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraOptions(rank=8, alpha=16))
    adapter_bytes = sum(p.numel() * 2 for _, p in adapter_state(model))  # bf16 on the wire
    full_bytes = sum(p.numel() * 2 for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert [r["weights/bytes"] for r in records] == [adapter_bytes] * 2, (records, adapter_bytes, full_bytes)
    assert adapter_bytes < full_bytes / 4


def test_engine_restarted_while_the_learner_trains_waits_for_it(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir,
                                                                 tmp_path, monkeypatch):
    """The engine shares the learner's GPU (hybrid engine). Killed while step 2 trains (the learner
    held at its TrainActor), it is not started again while the learner works: the supervisor's
    restart waits ("rollout.restart_waits") through the training, the engine starts once the loop
    needs it (step 2's push has no engine left), gets the current weights and the run ends with
    every step. Without the wait the engine would start within the restart back-off, on the GPU the
    learner is training on."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu())
    training = "learner.train.started@learner:step2"
    holds = Holds(tmp_path / "holds", training)
    for key, value in holds.env().items():
        monkeypatch.setenv(key, value)
    argv = seed_grpo_command(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path) + HYBRID + [
        "--max_steps", "3", "--restart_backoff_s", "0.5", "--health_poll_s", "0.5"]
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator.train_ppo_ray", argv, log)
    try:
        holds.wait(training, proc, timeout_s=400)
        run = tmp_path / "run"
        engine_pid = service_pids(run)["rollout-0"]
        os.kill(engine_pid, signal.SIGKILL)
        killed_at = time.time()
        time.sleep(20)  # 40 restart back-offs: the engine would have been started again by now
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        kinds = [(e["event"], e.get("service")) for e in events]
        assert ("service.died", "rollout-0") in kinds, kinds
        assert ("rollout.restart_waits", "rollout-0") in kinds, kinds
        assert ("service.restarted", "rollout-0") not in kinds, kinds
        released_at = time.time()
        holds.release(training)
        output = finish(proc, log, timeout_s=540)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-6000:]
    records = read_metrics(run)
    assert [r["global_step"] for r in records] == [1, 2, 3]
    assert all(r["samples/trained"] == 16 for r in records)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    proceeds = [e for e in events if e["event"] == "rollout.restart_proceeds" and e["service"] == "rollout-0"]
    restarted = [e for e in events if e["event"] == "service.restarted" and e["service"] == "rollout-0"]
    admitted = [e for e in events if e["event"] == "rollout.admitted" and e["service"] == "rollout-0"]
    assert proceeds and restarted and admitted, [e["event"] for e in events]
    # The wait began once the death was seen (a health poll and a back-off after the kill, not 20 s
    # later) and ended only after the learner was let go: it spanned the training.
    began_waiting = proceeds[0]["unix_time"] - proceeds[0]["waited_s"]
    assert began_waiting < killed_at + 5 and proceeds[0]["unix_time"] > released_at, (proceeds, killed_at, released_at)
    assert restarted[0]["unix_time"] > released_at
