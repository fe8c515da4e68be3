"""After a push of a large change, vLLM on a GPU samples from exactly the learner's model: the GPU
counterpart of tests/rollout/test_push_logprobs.py (read that first), for vLLM 0.26 on CUDA.

Tiny random models in float32 (Llama and Qwen3 with tied heads, Qwen2 and Mistral untied), one engine
at a time. The learner's own sender (WeightSender) pushes from this process over CUDA IPC (this
process and the engine on the same GPU) and, with a second GPU, over NCCL (this process on the
second one); an adapter push (LoRA) goes over IPC. After each push the log-probs vLLM reports for
the tokens it samples must equal transformers' (float32, on the CPU) on the learner's model within
LOGPROB_ATOL, the model before the push must be far from them, and the checksum the engine reads
back from its model must equal the learner's.

    PYTHONPATH=.:protos:$PYTHONPATH python3 -m pytest tests/gpu/test_push_logprobs_gpu.py -x -q -rA -s

(-s prints the measured differences.) Skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.rollout.v1 import rollout_pb2
from services.common import weights
from services.common.tiny import make_tiny_model
from services.learner.lora import LoraOptions, adapter_state, apply_lora
from services.learner.weight_push import WeightSender, plan_chunks, push_checksum, update_request
from services.rollout.pusher import free_port
from tests.rollout.helpers import ROOT, start_rollout, stop_rollout
from tests.rollout.test_push_logprobs import PROMPTS, change_a_lot, max_logprob_diff, sample

CASES = [("llama", True), ("qwen2", False), ("qwen3", True), ("mistral", False)]
# float32 on both sides; the CPU engine measures ~1.6e-6 against transformers. On the GPU, vLLM's
# kernels differ from transformers' on the CPU by more than that with no push at all (H100, vLLM 0.26:
# 3.1e-4 to 4.3e-4 on the tiny models as built, 0.9e-3 to 1.8e-3 after the large change, whose weights
# and logits are larger). So the pushed engine is held to what an engine started from the same weights
# on disk samples (same prompts, same seed: the same tokens, and log-probs within LOGPROB_ATOL), and
# both to transformers within FRESH_FACTOR x the fresh engine's own difference. A stale or wrong tensor
# is orders of magnitude further (the stale tied head: up to 12 in log-prob).
LOGPROB_ATOL = 2e-4
FRESH_FACTOR = 1.5
ENGINE_ARGS = ("--engine", "vllm", "--dtype", "float32", "--max_model_len", "256", "--seed", "0",
               "--gpu_memory_utilization", "0.2", "--enforce_eager", "--enable_lora")
TWO_GPUS = torch.cuda.device_count() >= 2


def case_id(case) -> str:
    return f"{case[0]}-{'tied' if case[1] else 'untied'}"


@dataclasses.dataclass
class Engine:
    case: tuple[str, bool]
    model_dir: pathlib.Path
    stub: object


@pytest.fixture(scope="module")
def child_pythonpath():
    """The service and its vLLM workers import this checkout (see tests/gpu/test_rollout_gpu.py)."""
    old = os.environ.get("PYTHONPATH")
    paths = [str(ROOT), str(ROOT / "protos")] + [p for p in (old or "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    yield
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def engine(request, tmp_path_factory, child_pythonpath):
    arch, tied = request.param
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models") / case_id(request.param), arch=arch, seed=0,
                                tied=tied)
    # The engine on the first visible GPU (a second one, if any, is this process's for the nccl push).
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(torch.cuda.device_count())))
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[0]
    try:
        service = start_rollout(model_dir, tmp_path_factory.mktemp(f"rollout_{case_id(request.param)}"),
                                *ENGINE_ARGS, timeout_s=900)
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    channel = service.channel(timeout_s=600)
    yield Engine(request.param, model_dir, service.stub(channel))
    channel.close()
    stop_rollout(service.proc)
    if request.session.testsfailed:
        print(f"--- {service.log_path} (tail) ---\n{service.log_tail(20000)}")


def hf_model(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def push(stub, module: torch.nn.Module, version: int, backend: str) -> tuple[str, str]:
    """The learner's push of module (on this process's GPU) with its own WeightSender; returns
    (the engine's checksum, the one sent)."""
    device = next(module.parameters()).device
    torch.cuda.set_device(device)
    sender = WeightSender(0, device)
    if backend == "ipc":
        stub.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(backend=rollout_pb2.WEIGHT_BACKEND_IPC))
        sender.init("ipc", "", 0, 0, "", 60)
    else:
        port = free_port("127.0.0.1")
        joined = stub.InitWeightTransfer.future(rollout_pb2.InitWeightTransferRequest(
            backend=rollout_pb2.WEIGHT_BACKEND_NCCL, master_address="127.0.0.1", master_port=port, world_size=2,
            rank_offset=1, group_name=f"gpu-logprobs-{port}", timeout_s=120))
        sender.init("nccl", "127.0.0.1", port, 2, f"gpu-logprobs-{port}", 120)
        joined.result()
    chunks = plan_chunks(module, torch.float32, 256 * 1024, 2)
    entries, reply = {}, None
    for index, chunk in enumerate(chunks):
        final = index == len(chunks) - 1
        if backend == "ipc":  # the handles exist once the chunk is packed
            sent, handles = sender.send_chunk(module, False, chunk)
            reply = stub.UpdateWeights(update_request(version, chunk, index, final, handles), timeout=300)
        else:
            call = stub.UpdateWeights.future(update_request(version, chunk, index, final, []), timeout=300)
            sent = sender.send_chunk(module, False, chunk)[0]
            reply = call.result()
        sender.release()
        entries.update(sent)
    assert reply.weight_version == version
    return reply.weights_checksum, push_checksum(entries, chunks)


def fresh_engine_samples(engine: Engine, model: torch.nn.Module, folder: pathlib.Path) -> list:
    """What an engine started from `model` saved to disk (no push) samples, with the pushed engine's
    settings, on this GPU."""
    model.save_pretrained(folder)
    for f in engine.model_dir.iterdir():  # the tokenizer and generation settings
        if f.is_file() and not (folder / f.name).exists():
            shutil.copy(f, folder / f.name)
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = (old or "0").split(",")[0]
    try:
        service = start_rollout(folder, folder.parent / f"{folder.name}_service", *ENGINE_ARGS, timeout_s=900)
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    try:
        channel = service.channel(timeout_s=600)
        try:
            return sample(service.stub(channel))
        finally:
            channel.close()
    finally:
        stop_rollout(service.proc)


def same_sampling(pushed: list, fresh: list) -> float:
    """Max log-prob difference of two engines' samples of the same requests, which must be the same tokens."""
    assert [ids for _, ids, _ in pushed] == [ids for _, ids, _ in fresh], "the pushed engine sampled other tokens"
    return max(abs(a - b) for (_, _, lp_a), (_, _, lp_b) in zip(pushed, fresh) for a, b in zip(lp_a, lp_b))


def version_of(stub) -> int:
    return stub.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weight_version


@pytest.mark.parametrize("backend", ["ipc", pytest.param("nccl", marks=pytest.mark.skipif(
    not TWO_GPUS, reason="an nccl push needs a second GPU for the sender"))])
def test_a_large_push_samples_from_the_learners_model(engine, backend, tmp_path):
    learner_model = hf_model(engine.model_dir)
    before = copy.deepcopy(learner_model)
    change_a_lot(learner_model, seed=1)
    device = torch.device("cuda", 0 if backend == "ipc" else 1)
    version = version_of(engine.stub) + 1
    try:
        held, sent = push(engine.stub, copy.deepcopy(learner_model).to(device), version, backend)
        assert held == sent == weights.weights_checksum(learner_model.named_parameters())
        samples = sample(engine.stub)
    finally:
        # The checkpoint's weights back (the adapter test applies its adapter to them).
        push(engine.stub, hf_model(engine.model_dir).to(device), version + 1, backend)
    fresh = fresh_engine_samples(engine, learner_model, tmp_path / "changed")
    between = same_sampling(samples, fresh)
    diff, fresh_diff = max_logprob_diff(learner_model, samples), max_logprob_diff(learner_model, fresh)
    print(f"{case_id(engine.case)} {backend}: pushed vs fresh engine {between:.3g}; max |vLLM - transformers| "
          f"log-prob {diff:.3g} (fresh engine {fresh_diff:.3g}), to the model before the push "
          f"{max_logprob_diff(before, samples):.3g}")
    assert between < LOGPROB_ATOL
    assert diff < max(LOGPROB_ATOL, FRESH_FACTOR * fresh_diff)
    assert max_logprob_diff(before, samples) > 1.0


def test_an_adapter_push_samples_from_the_merged_model(engine, tmp_path):
    base = hf_model(engine.model_dir)
    module = apply_lora(copy.deepcopy(base), LoraOptions(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj",
                                                                                            "up_proj")))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, p in adapter_state(module):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    version = version_of(engine.stub) + 1
    try:
        held, sent = push(engine.stub, copy.deepcopy(module).to("cuda:0"), version, "ipc")
        assert held == sent
        samples = sample(engine.stub)
    finally:
        push(engine.stub, copy.deepcopy(base).to("cuda:0"), version + 1, "ipc")
    merged = copy.deepcopy(module).merge_and_unload().eval()
    diff = max_logprob_diff(merged, samples)
    fresh = fresh_engine_samples(engine, merged, tmp_path / "merged")
    between, fresh_diff = same_sampling(samples, fresh), max_logprob_diff(merged, fresh)
    print(f"{case_id(engine.case)} adapter: pushed vs fresh engine {between:.3g}; max |vLLM - transformers| "
          f"log-prob {diff:.3g} (fresh engine {fresh_diff:.3g})")
    assert between < LOGPROB_ATOL
    assert diff < max(LOGPROB_ATOL, FRESH_FACTOR * fresh_diff)
    assert max_logprob_diff(base, samples) > 0.1
