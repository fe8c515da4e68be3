"""The coordinator on a CUDA GPU (skipped without one): the skill page's hybrid-engine GRPO command
on one GPU, placed locally and on a local Ray instance. Every role shares the GPU; vLLM sleeps
while the learner trains and the learner offloads while vLLM generates; weights travel over CUDA
IPC and are verified on the engine after every step. The runs are pinned to the first visible GPU
(CUDA_VISIBLE_DEVICES), so they test the one-GPU layout on a machine with any number of GPUs
(Ray would otherwise count every GPU of the machine).

    PYTHONPATH=.:protos python -m pytest tests/coordinator/test_gpu.py -x -q
"""

from __future__ import annotations

import os

import pytest

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
    return output, records


def test_hybrid_engine_on_one_gpu_local(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path, monkeypatch):
    run_hybrid(tmp_path, monkeypatch, tiny_model_dir, tiny_reward_model_dir, tiny_data_dir)


def test_hybrid_engine_on_one_gpu_ray(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path, monkeypatch):
    pytest.importorskip("ray")
    output, _ = run_hybrid(tmp_path, monkeypatch, tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, "--placement", "ray")
    assert "ray.connected address=local gpus=1" in output
