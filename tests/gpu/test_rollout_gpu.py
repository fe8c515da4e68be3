"""The rollout service with vLLM on a CUDA GPU: a random Qwen2 with Qwen2.5-0.5B shapes in bf16
generates, sleeps and wakes (memory freed, outputs unchanged), and receives weights over CUDA IPC
from a separate process on the same GPU (checksums equal; outputs switch and switch back).
Skipped without CUDA (tests/conftest.py); with two GPUs an nccl push runs too.

    PYTHONPATH=.:protos:$PYTHONPATH python3 -m pytest tests/gpu/test_rollout_gpu.py -x -q -rA

(keep what PYTHONPATH already holds: on the GPU machine that is where vLLM and grpcio >= 1.85 are
installed). The service, its vLLM workers and the pushers are child processes; they get this
process's PYTHONPATH with the repository and protos/ in front (`child_pythonpath`).

Greedy outputs are compared before and after sleep and pushes, so every greedy run must take the
same kernel path: prefix caching is off (a cache hit computes a prompt in a different split) and
each prompt runs alone (the batch shape changes the GEMM kernels). In bf16 either difference can
flip a near-tied argmax of a random model, which would fail the test without any bug.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
import torch

from bench.rollout_overhead import build_model
from rlmesh.rollout.v1 import rollout_pb2
from services.common import weights
from tests.rollout.helpers import (
    ROOT,
    by_key,
    generate,
    greedy_ids,
    rpc_error,
    start_rollout,
    stop_rollout,
    token_prompt,
    tokens,
)

PROMPTS = [[5, 6, 7, 8] * 8, [20, 21, 14, 26, 32] * 6, list(range(100, 164))]
GiB = 1024 ** 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_models")
    return build_model("qwen2.5-0.5b", root / "a", seed=0), build_model("qwen2.5-0.5b", root / "b", seed=1)


@pytest.fixture(scope="module")
def child_pythonpath():
    """Child processes (service, vLLM workers, pushers) import rlmesh and services from this checkout
    and the same grpcio/protobuf as this process: absolute repository paths go in front of PYTHONPATH."""
    old = os.environ.get("PYTHONPATH")
    paths = [str(ROOT), str(ROOT / "protos")] + [p for p in (old or "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    yield
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def free_before_service() -> int:
    """Free GPU memory before the service starts (this process's own CUDA context already taken)."""
    torch.cuda.init()
    return torch.cuda.mem_get_info()[0]


@pytest.fixture(scope="module")
def service(request, models, tmp_path_factory, child_pythonpath, free_before_service):
    proc = start_rollout(models[0], tmp_path_factory.mktemp("rollout_gpu"), "--engine", "vllm", "--dtype", "bfloat16",
                         "--gpu_memory_utilization", "0.5", "--max_model_len", "2048", "--enable_sleep_mode",
                         "--enforce_eager", "--no-enable_prefix_caching", timeout_s=900)
    yield proc
    stop_rollout(proc.proc)
    if request.session.testsfailed:
        # The GPU machine's /tmp goes with it: show vLLM's side of a failure here.
        print(f"--- {proc.log_path} (tail) ---\n{proc.log_tail(30000)}")


@pytest.fixture(scope="module")
def stub(service):
    with service.channel(timeout_s=600) as channel:
        yield service.stub(channel)


def greedy(stub, max_tokens: int = 32) -> list[list[int]]:
    """Greedy continuations of PROMPTS, one prompt at a time (see the module docstring)."""
    return [greedy_ids(stub, [prompt], max_tokens=max_tokens)[0] for prompt in PROMPTS]


def push(address: str, checkpoint, version: int, backend: str, env=None) -> dict:
    proc = subprocess.run([sys.executable, "-m", "services.rollout.pusher", "--rollout_addresses", address,
                           "--checkpoint", str(checkpoint), "--version", str(version), "--backend", backend,
                           "--bucket_mb", "64", "--timeout_s", "120"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"{backend} push failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checkpoint_checksum(model_dir) -> str:
    from services.rollout.pusher import load_checkpoint

    return weights.weights_checksum(load_checkpoint(str(model_dir)).items(), torch.bfloat16)


def test_generates_a_streamed_batch_on_the_gpu(stub, models):
    info = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())
    assert info.engine_kind == rollout_pb2.ENGINE_KIND_VLLM and info.max_model_len == 2048
    assert info.weights_checksum == checkpoint_checksum(models[0])
    responses = generate(stub, [token_prompt(str(i), p) for i, p in enumerate(PROMPTS)], n=4, temperature=1.0,
                         max_tokens=64, ignore_eos=True, logprobs=True, seed=1)
    assert sorted(by_key(responses)) == [(str(i), s) for i in range(3) for s in range(4)]
    assert all(len(tokens(r)) == 64 and r.logprobs.shape[0] == 64 for r in responses)


def test_sleep_frees_memory_and_wake_up_keeps_outputs(stub, free_before_service):
    before = greedy(stub)
    free_awake, total = torch.cuda.mem_get_info()
    taken = free_before_service - free_awake  # what the service holds: ~gpu_memory_utilization x total
    reply = stub.Sleep(rollout_pb2.SleepRequest(level=1))
    free_asleep, _ = torch.cuda.mem_get_info()
    freed = free_asleep - free_awake
    numbers = (f"service took {taken / GiB:.1f} GiB of {total / GiB:.1f}; sleep(level=1) freed {freed / GiB:.1f} GiB "
               f"(measured here), {reply.freed_bytes / GiB:.1f} GiB (reported), in {reply.duration_s:.2f} s")
    print(numbers)
    # Level 1 drops the KV cache (most of what the service took) and moves the weights to host
    # memory; the CUDA contexts and the allocator's activation cache stay.
    assert taken > 0.3 * total, numbers
    assert freed > 0.5 * taken, numbers
    assert reply.freed_bytes > 0.5 * taken, numbers
    error = rpc_error(lambda: stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[token_prompt("p", [5])], n=1, sampling=rollout_pb2.SamplingOptions(max_tokens=2))))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "WakeUp" in error.details()
    assert stub.WakeUp(rollout_pb2.WakeUpRequest()).fully_awake
    assert greedy(stub) == before


def test_ipc_push_from_another_process_on_the_same_gpu(stub, service, models):
    original = greedy(stub)
    version = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weight_version
    result = push(service.address, models[1], version + 1, "ipc")
    assert result["consistent"] and result["sent_checksum"] == checkpoint_checksum(models[1])
    info = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())
    assert (info.weight_version, info.weights_checksum) == (version + 1, result["sent_checksum"])
    switched = greedy(stub)
    assert switched != original
    # Pushing the first model back restores its outputs exactly: every byte went where it belongs.
    result = push(service.address, models[0], version + 2, "ipc")
    assert result["consistent"] and result["sent_checksum"] == checkpoint_checksum(models[0])
    assert greedy(stub) == original


def test_sleep_level_2_needs_a_full_push(stub, service, models):
    original = greedy(stub)
    stub.Sleep(rollout_pb2.SleepRequest(level=2))
    stub.WakeUp(rollout_pb2.WakeUpRequest(tags=["weights"]))
    info = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())
    assert info.weights_state == rollout_pb2.WEIGHTS_STATE_INCOMPLETE
    push(service.address, models[0], info.weight_version + 1, "ipc")
    assert stub.WakeUp(rollout_pb2.WakeUpRequest(tags=["kv_cache"])).fully_awake
    assert greedy(stub) == original


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an nccl push needs a second GPU for the sender")
def test_nccl_push_from_another_gpu(stub, service, models):
    # The service runs on the first visible GPU; the pusher takes the second one.
    original = greedy(stub)
    version = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weight_version
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(torch.cuda.device_count())))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible.split(",")[1])
    result = push(service.address, models[1], version + 1, "nccl", env=env)
    assert result["consistent"] and result["sent_checksum"] == checkpoint_checksum(models[1])
    assert greedy(stub) != original
    push(service.address, models[0], version + 2, "nccl", env=env)
    assert greedy(stub) == original
