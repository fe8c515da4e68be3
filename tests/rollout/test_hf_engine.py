"""The transformers fallback engine (`--engine hf`): its sampling transforms against fixed values,
and the service with it: padded batches, stop conditions, and a gloo weight push."""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.rollout.v1 import rollout_pb2
from services.common import weights
from services.rollout.hf_engine import process_logits
from tests.rollout.helpers import by_key, generate, greedy_ids, hf_greedy, push_checkpoint, rpc_error, token_prompt, tokens


def test_process_logits_follows_vllms_order_and_definitions():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.06, 0.04]]))
    same = process_logits(logits, 1.0, 0, 1.0, 0.0)
    assert torch.allclose(same, logits)
    # temperature 2: log p / 2
    assert torch.allclose(process_logits(logits, 2.0, 0, 1.0, 0.0), logits / 2)
    # top-k 2 keeps the two most likely tokens
    assert torch.isinf(process_logits(logits, 1.0, 2, 1.0, 0.0)).tolist() == [[False, False, True, True, True]]
    # top-p 0.8: 0.5 + 0.25 < 0.8, so 0.15 is still needed; the rest go
    assert torch.isinf(process_logits(logits, 1.0, 0, 0.8, 0.0)).tolist() == [[False, False, False, True, True]]
    # min-p 0.2: drop p < 0.2 * 0.5 = 0.1
    assert torch.isinf(process_logits(logits, 1.0, 0, 1.0, 0.2)).tolist() == [[False, False, False, True, True]]
    # top-p tiny: the most likely token always survives
    assert torch.isinf(process_logits(logits, 1.0, 0, 1e-6, 0.0)).tolist() == [[False, True, True, True, True]]
    # renormalised probabilities after top-k 2: 2/3 and 1/3
    probs = process_logits(logits, 1.0, 2, 1.0, 0.0).softmax(-1)[0]
    assert math.isclose(probs[0].item(), 2 / 3, rel_tol=1e-6) and math.isclose(probs[1].item(), 1 / 3, rel_tol=1e-6)


@pytest.fixture(scope="module")
def hf(hf_rollout):
    with hf_rollout.channel() as channel:
        yield hf_rollout.stub(channel)


def test_padded_batch_equals_one_prompt_at_a_time(hf, tiny_model_dir):
    """Prompts of different lengths in one left-padded batch decode as they would alone."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[5], [20, 21, 14, 26, 32, 40, 41, 42, 43], [100, 7, 9]]
    assert greedy_ids(hf, prompts, max_tokens=10) == [hf_greedy(model, p, 10) for p in prompts]


def test_stop_token_and_stop_string_end_samples(hf):
    prompt = [token_prompt("p", [20, 21, 14, 26, 32])]
    free = tokens(generate(hf, prompt, temperature=0.0, max_tokens=12, ignore_eos=True)[0])
    stop_id = free[3]
    stopped = generate(hf, prompt, temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])[0]
    assert tokens(stopped) == free[:free.index(stop_id) + 1]  # the stop token is included
    assert stopped.finish_reason == rollout_pb2.FINISH_REASON_STOP
    text = generate(hf, prompt, temperature=0.0, max_tokens=12, ignore_eos=True, return_text=True)[0].text
    stop_string = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[:2]
    cut = generate(hf, prompt, temperature=0.0, max_tokens=12, ignore_eos=True, return_text=True, stop=[stop_string])[0]
    assert cut.finish_reason == rollout_pb2.FINISH_REASON_STOP and stop_string not in cut.text
    assert text.startswith(cut.text)


def test_sampled_batch_with_n(hf):
    responses = generate(hf, [token_prompt("a", [5, 6]), token_prompt("b", [7])], n=3, temperature=1.0,
                         max_tokens=8, seed=11, logprobs=True)
    got = by_key(responses)
    assert sorted(got) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    assert len({tuple(tokens(got[("a", i)])) for i in range(3)}) > 1
    again = by_key(generate(hf, [token_prompt("a", [5, 6]), token_prompt("b", [7])], n=3, temperature=1.0,
                            max_tokens=8, seed=11, logprobs=True))
    assert all(tokens(again[k]) == tokens(got[k]) for k in got)


def test_weight_push_into_the_hf_engine(hf, hf_rollout, tiny_model_dir, tiny_model_dir_b):
    model_b = AutoModelForCausalLM.from_pretrained(tiny_model_dir_b, dtype=torch.float32).eval()
    version = hf.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weight_version + 1  # other tests push too
    result = push_checkpoint(hf_rollout.address, tiny_model_dir_b, version=version, bucket_mb=0.25, chunk_buckets=3)
    assert result["consistent"]
    assert result["sent_checksum"] == weights.weights_checksum(model_b.named_parameters(), torch.float32)
    prompts = [[5, 6, 7, 8], [30, 31]]
    assert greedy_ids(hf, prompts, max_tokens=8) == [hf_greedy(model_b, p, 8) for p in prompts]
    # Back to the first model (a later version), so the session's other tests see its weights.
    push_checkpoint(hf_rollout.address, tiny_model_dir, version=version + 1)
    info = hf.GetModelInfo(rollout_pb2.GetModelInfoRequest())
    assert info.weight_version == version + 1
    model_a = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert info.weights_checksum == weights.weights_checksum(model_a.named_parameters(), torch.float32)


def test_generate_is_refused_between_the_chunks_of_a_push(hf, hf_rollout, tiny_model_dir):
    """Half a push never serves: Generate fails with FAILED_PRECONDITION until the final chunk lands."""
    from services.rollout.pusher import free_port, load_checkpoint, split_chunks

    tensors = load_checkpoint(str(tiny_model_dir))
    slots, sizes = weights.plan_buckets([(n, torch.float32, t.shape) for n, t in tensors.items()], 256 * 1024)
    chunks = split_chunks(slots, sizes, len(sizes) // 2)
    assert len(chunks) >= 2
    port = free_port("127.0.0.1")
    joined = hf.InitWeightTransfer.future(rollout_pb2.InitWeightTransferRequest(
        backend=rollout_pb2.WEIGHT_BACKEND_GLOO, master_address="127.0.0.1", master_port=port, world_size=2,
        rank_offset=1, group_name="chunks", timeout_s=30))
    group = weights.open_weight_group("gloo", "127.0.0.1", port, 2, 0, "chunks", 30)
    assert list(joined.result().ranks) == [1]
    version = hf.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weight_version + 1

    for index, (chunk_slots, chunk_sizes) in enumerate(chunks):
        final = index == len(chunks) - 1
        call = hf.UpdateWeights.future(weights.update_weights_request(
            version, chunk_slots, chunk_sizes, chunk_index=index, final=final))
        for bucket, members in enumerate(weights.bucket_members(chunk_slots, len(chunk_sizes))):
            weights.send_bucket(group, tensors, members, chunk_sizes[bucket])
        reply = call.result()
        info = hf.GetModelInfo(rollout_pb2.GetModelInfoRequest())
        if not final:
            assert reply.weights_checksum == "" and reply.weight_version == version - 1
            assert info.weights_state == rollout_pb2.WEIGHTS_STATE_UPDATING
            error = rpc_error(lambda: hf.Generate(rollout_pb2.GenerateRequest(
                prompts=[token_prompt("p", [5])], n=1, sampling=rollout_pb2.SamplingOptions(max_tokens=2))))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "under way" in error.details()
    assert info.weights_state == rollout_pb2.WEIGHTS_STATE_READY and info.weight_version == version
    assert reply.weights_checksum == info.weights_checksum == weights.weights_checksum(tensors.items(), torch.float32)
    assert reply.received_params == len(tensors)
    assert len(generate(hf, [token_prompt("p", [5])], max_tokens=2)) == 1


def test_a_push_waits_for_running_generation(hf, hf_rollout, tiny_model_dir):
    """Every sample is generated by one weight version: a push starts only after running calls end."""
    from services.rollout.pusher import free_port, load_checkpoint

    version = hf.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weight_version
    finished: dict[str, float] = {}

    def long_generation():
        finished["responses"] = generate(hf, [token_prompt(f"g{i}", [5 + i, 6]) for i in range(16)], n=2,
                                         max_tokens=200, ignore_eos=True)
        finished["at"] = time.monotonic()

    thread = threading.Thread(target=long_generation)
    thread.start()
    deadline = time.monotonic() + 30
    while hf_rollout.metrics()["rlmesh_rollout_running_samples"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)

    tensors = load_checkpoint(str(tiny_model_dir))
    port = free_port("127.0.0.1")
    joined = hf.InitWeightTransfer.future(rollout_pb2.InitWeightTransferRequest(
        backend=rollout_pb2.WEIGHT_BACKEND_GLOO, master_address="127.0.0.1", master_port=port, world_size=2,
        rank_offset=1, group_name="wait", timeout_s=60))
    group = weights.open_weight_group("gloo", "127.0.0.1", port, 2, 0, "wait", 60)
    joined.result()
    joined_at = time.monotonic()
    thread.join(60)
    # Without the wait, the join would have returned while the generation had seconds to go.
    assert finished["at"] < joined_at + 0.5, "InitWeightTransfer did not wait for the running generation"
    slots, sizes = weights.plan_buckets([(n, torch.float32, t.shape) for n, t in tensors.items()], 1 << 20)
    call = hf.UpdateWeights.future(weights.update_weights_request(version + 1, slots, sizes))
    weights.broadcast_weights(group, slots, sizes, tensors)
    assert call.result().weight_version == version + 1
    assert len(finished["responses"]) == 32 and {r.weight_version for r in finished["responses"]} == {version}


def test_a_partial_push_is_refused_with_the_fix(hf):
    """The hf engine decodes a batch to its end: pause_generation is refused up front, naming the fix."""
    error = rpc_error(lambda: hf.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=10**6, pause_generation=True),
                                               timeout=10))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--engine vllm" in error.details() and "--partial_rollout" in error.details(), error.details()
