"""One service process with both roles: the tiny reward model (Score) and the tiny causal LM as the
reference model (RefLogProbs), over gRPC."""

import asyncio

import grpc
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlmesh.reward.v1 import reference_pb2, reference_pb2_grpc, reward_pb2, reward_pb2_grpc
from services.common.client import make_sync_channel
from services.common.logprobs import sequence_logprobs
from services.common.tensors import ragged_to_proto, to_proto
from services.reward.client import ReferenceClient, RewardClient
from services.reward.source import ScoreBatch
from tests.reward.conftest import start_reward_service


@pytest.fixture(scope="module")
def service(tiny_reward_model_dir, tiny_model_dir, tmp_path_factory):
    proc = start_reward_service(tmp_path_factory.mktemp("svc_model"), "--reward_pretrain", str(tiny_reward_model_dir),
                                "--ref_pretrain", str(tiny_model_dir), "--device", "cpu",
                                "--reward_micro_batch_size", "3", "--ref_micro_batch_size", "1")
    yield proc
    proc.stop()


def call(coro_fn, *args):
    async def go():
        return await coro_fn(*args)

    return asyncio.run(go())


def test_score_matches_hf_classifier(service, tiny_reward_model_dir):
    prompts = ["3+4=", "10-2=", "Good morning, how are you today?", "1+1="]
    responses = ["The answer is \\boxed{7}", "8", " I am fine, thank you.<|im_end|>", "The answer is \\boxed{3}"]
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    with torch.inference_mode():
        expected = [hf(torch.tensor([tok(p + r, add_special_tokens=False)["input_ids"]])).logits.item()
                    for p, r in zip(prompts, responses)]

    async def score():
        client = RewardClient(service.address)
        try:
            return await client.score(ScoreBatch.from_texts(prompts, responses)), await client.info()
        finally:
            await client.close()

    result, info = asyncio.run(score())
    np.testing.assert_allclose(result.scores, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(result.rewards, np.clip(expected, -10, 10), rtol=0, atol=1e-5)
    assert result.source == "model" and info.source == "model" and str(tiny_reward_model_dir) in info.description


def test_score_rejects_text_longer_than_the_model(service):
    with make_sync_channel(service.address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        request = reward_pb2.ScoreRequest(samples=[reward_pb2.Sample(prompt="1+1=", response="2"),
                                                   reward_pb2.Sample(sample_id="long", prompt="1 " * 2000)])
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert 'sample 1 (id "long")' in err.value.details() and "1024 positions" in err.value.details()
        assert len(stub.Score(reward_pb2.ScoreRequest(samples=request.samples[:1])).sample_ids) == 1


def test_ref_logprobs_bit_identical_to_learner_function(service, tiny_model_dir):
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 600, (n,), generator=g) for n in (12, 5, 30, 2)]
    starts = [4, 1, 20, 2]

    async def ref():
        client = ReferenceClient(service.address)
        try:
            return await client.ref_logprobs(seqs, starts, temperature=0.8)
        finally:
            await client.close()

    got = asyncio.run(ref())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.inference_mode():
        for s, k, lp in zip(seqs, starts, got):
            full = sequence_logprobs(model, s.unsqueeze(0), torch.ones(1, len(s), dtype=torch.long), 0.8)
            assert torch.equal(lp, full[0, k - 1:]), (lp, full[0, k - 1:])
    assert [len(t) for t in got] == [8, 4, 10, 0]


@pytest.mark.parametrize("starts, ids_dtype, temperature, field, words", [
    ([0, 1], torch.int64, 1.0, "response_start of sequence 0", "is 0 for a sequence of 3 tokens"),
    ([1, 5], torch.int64, 1.0, "response_start of sequence 1", "is 5 for a sequence of 4 tokens"),
    ([1, 1], torch.int64, -1.0, "temperature", "is -1.0"),
    ([1], torch.int64, 1.0, "response_start", "shape (2,)"),
])
def test_ref_logprobs_bad_input(service, starts, ids_dtype, temperature, field, words):
    with make_sync_channel(service.address) as channel:
        stub = reference_pb2_grpc.ReferenceServiceStub(channel)
        request = reference_pb2.RefLogProbsRequest(
            input_ids=ragged_to_proto([[1, 2, 3], [4, 5, 6, 7]], ids_dtype),
            response_start=to_proto(torch.tensor(starts)), temperature=temperature)
        with pytest.raises(grpc.RpcError) as err:
            stub.RefLogProbs(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details() and words in err.value.details()


def test_ref_logprobs_token_out_of_vocabulary(service):
    with make_sync_channel(service.address) as channel:
        stub = reference_pb2_grpc.ReferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.RefLogProbs(reference_pb2.RefLogProbsRequest(
                input_ids=ragged_to_proto([[1, 2, 99999]]), response_start=to_proto(torch.tensor([1]))))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token ids must lie in [0, 660)" in err.value.details()
        # Still serving.
        reply = stub.RefLogProbs(reference_pb2.RefLogProbsRequest(
            input_ids=ragged_to_proto([[1, 2, 3]]), response_start=to_proto(torch.tensor([1]))))
        assert list(reply.logprobs.lengths) == [2]
