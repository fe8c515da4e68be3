"""Rule rewards and remote gRPC reward servers over gRPC: the math rule service, the example
function server, and reward services that call either of them as their remote."""

import asyncio
import time

import grpc
import numpy as np
import torch
import pytest

from rlmesh.reward.v1 import reward_pb2, reward_pb2_grpc
from services.common.client import make_sync_channel
from services.common.errors import ServiceError
from services.reward.client import RewardClient
from services.reward.grpc_source import GrpcRewardSource
from services.reward.remote import RemotePolicy
from services.reward.source import ScoreBatch
from tests.conftest import get_free_port
from tests.reward.conftest import start_process, start_reward_service

RESPONSES = ["The answer is \\boxed{7}", "I think it is 8", "no idea", "\\boxed{\\frac{14}{2}}"]
LABELS = ["7", "7", "7", "7"]


@pytest.fixture(scope="module")
def math_service(tmp_path_factory):
    proc = start_reward_service(tmp_path_factory.mktemp("svc_math"), "--reward_func", "math",
                                "--math_wrong_reward", "-0.5", "--math_no_answer_reward", "-1",
                                "--math_verify_workers", "1", "--math_verify_timeout_s", "1")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def example_server(tmp_path_factory):
    """examples/grpc_reward_server.py, as a user would run it."""
    tmp = tmp_path_factory.mktemp("example")
    ready = tmp / "ready.json"
    proc = start_process(["examples.grpc_reward_server", "--host", "127.0.0.1", "--port", "0",
                          "--ready_file", str(ready)], ready)
    yield proc
    proc.stop()


def score(address: str, batch: ScoreBatch):
    async def go():
        client = RewardClient(address, timeout_s=60)
        try:
            return await client.score(batch)
        finally:
            await client.close()

    return asyncio.run(go())


def test_math_rule_over_grpc(math_service):
    out = score(math_service.address, ScoreBatch.from_texts(["3+4="] * 4, RESPONSES, LABELS))
    np.testing.assert_array_equal(out.rewards, [1.0, -0.5, -1.0, 1.0])
    np.testing.assert_array_equal(out.extra["accuracy"], [1, 0, 0, 1])
    assert out.source == "rule"


def test_math_without_labels_is_invalid_argument_and_service_keeps_serving(math_service):
    with make_sync_channel(math_service.address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        request = reward_pb2.ScoreRequest(samples=[reward_pb2.Sample(sample_id="a", response="\\boxed{1}", label="1"),
                                                   reward_pb2.Sample(sample_id="b", response="\\boxed{2}")])
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert 'samples[1].label of sample 1 (id "b")' in err.value.details() and "Sample.label" in err.value.details()
        assert stub.GetRewardInfo(reward_pb2.GetRewardInfoRequest()).requires_labels
        reply = stub.Score(reward_pb2.ScoreRequest(samples=request.samples[:1]))
        assert list(reply.sample_ids) == ["a"]


def test_math_time_limit_keeps_other_callers_served(math_service):
    """A sample that makes math-verify run for ever costs its caller ~1 s, not the service."""
    slow = ScoreBatch.from_texts([""], ["\\boxed{9^{9^{9^{9}}}}"], ["1"])

    async def both():
        client = RewardClient(math_service.address, timeout_s=60)
        try:
            slow_task = asyncio.create_task(client.score(slow))
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            fast = await client.score(ScoreBatch.from_texts([""], ["\\boxed{3}"], ["3"]))
            return fast, time.monotonic() - t0, await slow_task
        finally:
            await client.close()

    fast, fast_s, slow_out = asyncio.run(both())
    assert fast.rewards.tolist() == [1.0] and fast_s < 0.5
    assert slow_out.rewards.tolist() == [-0.5] and slow_out.extra["verify_timeout"].tolist() == [1.0]


def test_example_function_server_speaks_score(example_server):
    out = score(example_server.address, ScoreBatch.from_texts(["q"] * 3, ["x\n7", "7\nx", ""], ["7", "7", "7"]))
    np.testing.assert_array_equal(out.rewards, [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(out.extra["length"], [3, 3, 0])


def test_reward_service_calls_grpc_servers_with_failover(example_server, tmp_path):
    down = f"grpc://127.0.0.1:{get_free_port()}"
    proc = start_reward_service(tmp_path, "--remote_rm_url", f"{down},grpc://{example_server.address}",
                                "--remote_rm_batch_size", "2", "--remote_rm_backoff_s", "0.05")
    try:
        batch = ScoreBatch.from_texts(["q"] * 7, [f"a\n{i % 3}" for i in range(7)], ["1"] * 7)
        out = score(proc.address, batch)
        np.testing.assert_array_equal(out.rewards, [1.0 if i % 3 == 1 else 0.0 for i in range(7)])
        assert out.source == "grpc"
    finally:
        proc.stop()


def test_remote_grpc_status_passes_through(math_service):
    """A remote rlmesh reward service is a gRPC reward server too: its INVALID_ARGUMENT is not retried."""

    async def go():
        source = GrpcRewardSource([f"grpc://{math_service.address}"], RemotePolicy(max_retries=3))
        await source.start()
        try:
            good = await source.score(ScoreBatch.from_texts(["q"], ["\\boxed{2}"], ["2"]))
            with pytest.raises(ServiceError) as err:
                await source.score(ScoreBatch.from_texts(["q"], ["\\boxed{2}"], [""]))
            return good, err.value
        finally:
            await source.close()

    good, err = asyncio.run(go())
    assert good.rewards.tolist() == [1.0]
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "not retried" in err.message and "samples[0].label" in err.message


def test_grpc_server_down_gives_unavailable():
    down = f"grpc://127.0.0.1:{get_free_port()}"

    async def go():
        source = GrpcRewardSource([down], RemotePolicy(max_retries=2, backoff_s=0.05, timeout_s=2))
        await source.start()
        try:
            with pytest.raises(ServiceError) as err:
                await source.score(ScoreBatch.from_texts(["q"], ["a"], ["b"]))
            return err.value
        finally:
            await source.close()

    err = asyncio.run(go())
    assert err.code == grpc.StatusCode.UNAVAILABLE and "3 attempts" in err.message and down in err.message


def test_rollout_sized_batch_through_the_service(math_service):
    """8,192 samples with 2,048-token responses (token ids and text, ~200 MB in all) in one client call."""
    n, tokens = 8192, 2048
    response = "word " * (tokens // 2) + "\\boxed{12}"
    batch = ScoreBatch.from_texts(["What is 5+7? " * 20] * n, [response] * n, ["12"] * n,
                                  prompt_token_ids=[torch.arange(256)] * n,
                                  response_token_ids=[torch.arange(tokens) % 600] * n)
    out = score(math_service.address, batch)
    assert out.rewards.shape == (n,) and out.rewards.min() == 1.0


def test_batch_metrics_of_a_function_file_travel_over_grpc(tmp_path):
    """OpenRLHF's math reward file returns one accuracy per call: the service answers it as a batch
    metric (value x samples, samples), and a reward service that calls that one over grpc:// passes
    the sums on, so the caller's mean is the accuracy over all the samples."""
    from tests.reward.test_function_source import OPENRLHF_MATH_FILE

    path = tmp_path / "math_reward_func.py"
    path.write_text(OPENRLHF_MATH_FILE)
    inner = start_reward_service(tmp_path, "--remote_rm_url", str(path), "--remote_rm_batch_size", "3",
                                 "--remote_rm_max_in_flight", "1")
    outer = None
    try:
        outer = start_reward_service(tmp_path, "--remote_rm_url", f"grpc://{inner.address}",
                                     "--remote_rm_batch_size", "4")
        batch = ScoreBatch.from_texts(["q"] * 7, ["4", "5", "4", "4", "x", "4", "4"], ["4"] * 7)
        for address in (inner.address, outer.address):
            out = score(address, batch)
            np.testing.assert_array_equal(out.rewards, [1, 0, 1, 1, 0, 1, 1])
            assert "math_accuracy" not in out.extra
            weighted_sum, samples = out.batch["math_accuracy"]
            assert samples == 7 and weighted_sum == pytest.approx(5.0)
    finally:
        inner.stop()
        if outer is not None:
            outer.stop()


VERL_EXTRA_INFO_FILE = '''
def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [float(info.get("index", -1)) + (5.0 if info.get("split") == "test" else 0.0) for info in extra_infos]
'''


def test_extra_info_reaches_a_verl_reward_file_and_bad_json_is_refused(tmp_path):
    """Each sample's extra_info (veRL data's column) arrives as the row's dict, also through a reward
    service that calls another over grpc://; a row without one gets {}; text that is not a JSON
    object is INVALID_ARGUMENT naming the field and the sample, and the service serves on."""
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_EXTRA_INFO_FILE)
    inner = start_reward_service(tmp_path, "--remote_rm_url", str(path), "--remote_rm_batch_size", "2")
    outer = None
    try:
        outer = start_reward_service(tmp_path, "--remote_rm_url", f"grpc://{inner.address}")
        infos = ['{"split": "train", "index": 3}', "", '{"split": "test", "index": 1, "question": "1+1"}']
        batch = ScoreBatch.from_texts(["q"] * 3, ["a", "b", "c"], ["1"] * 3, extra_infos=infos)
        for address in (inner.address, outer.address):
            np.testing.assert_array_equal(score(address, batch).rewards, [3.0, -1.0, 6.0])
        for bad, problem in (('{"index": 3', "is not JSON"), ("[1, 2]", "is JSON of a list, not an object")):
            wrong = ScoreBatch.from_texts(["q"] * 2, ["a", "b"], ["1"] * 2, sample_ids=["s0", "s1"],
                                          extra_infos=['{"index": 0}', bad])
            with pytest.raises(grpc.RpcError) as err:
                score(inner.address, wrong)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert 'extra_info of sample 1 (id "s1")' in err.value.details() and problem in err.value.details()
            assert "JSON text of an object" in err.value.details()
        np.testing.assert_array_equal(score(inner.address, batch).rewards, [3.0, -1.0, 6.0])  # still serving
    finally:
        inner.stop()
        if outer is not None:
            outer.stop()
