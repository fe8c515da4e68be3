"""The reward service process with remote HTTP reward servers, over gRPC: results, faults (each
against a real aiohttp server on loopback), chunked big batches, and the metrics it exports."""

import asyncio
import re
import threading
import time

import grpc
import numpy as np
import pytest

from rlmesh.reward.v1 import reward_pb2, reward_pb2_grpc
from services.common.client import make_sync_channel
from services.common.tensors import from_proto
from services.reward.client import RewardClient, score_request
from services.reward.source import ScoreBatch
from tests.conftest import get_free_port
from tests.reward.conftest import http_stats, metrics_text, start_reward_service


@pytest.fixture(scope="module")
def service(http_server, tmp_path_factory):
    """Reward service -> {http_server}/by_label: the first label of each call picks the server's behaviour."""
    proc = start_reward_service(
        tmp_path_factory.mktemp("svc_http"), "--remote_rm_url", f"{http_server}/by_label",
        "--remote_rm_timeout_s", "1", "--remote_rm_retries", "2", "--remote_rm_backoff_s", "0.05",
        "--remote_rm_backoff_max_s", "0.2", "--remote_rm_batch_size", "16", "--reward_clip_range", "0", "0.5",
        "--max_message_mb", "1")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stub(service):
    with make_sync_channel(service.address, default_timeout_s=60) as channel:
        yield reward_pb2_grpc.RewardServiceStub(channel)


def request_for(labels: list[str], prompt: str = "q: ") -> reward_pb2.ScoreRequest:
    responses = [f"it is {label}" if i % 2 == 0 else "unsure" for i, label in enumerate(labels)]
    return score_request(ScoreBatch.from_texts([prompt] * len(labels), responses, labels,
                                               sample_ids=[f"s{i}" for i in range(len(labels))]))


def rpc_error(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args)
    return err.value


def test_scores_rewards_clipped_scores_raw_extra_logs(stub):
    labels = [str(i) for i in range(40)]  # 40 samples: three calls of at most 16
    request = request_for(labels)
    reply = stub.Score(request)
    rewards, scores = from_proto(reply.rewards).numpy(), from_proto(reply.scores).numpy()
    # The server gives 1 when the label is in the query (even samples); clipped to 0.5.
    np.testing.assert_array_equal(rewards, [0.5 if i % 2 == 0 else 0.0 for i in range(40)])
    np.testing.assert_array_equal(scores, [len(s.query) for s in request.samples])
    np.testing.assert_array_equal(from_proto(reply.extra_metrics["query_len"]).numpy(), scores)
    assert list(reply.sample_ids) == [f"s{i}" for i in range(40)] and reply.source == "http"


def test_500_then_200_succeeds(stub, http_server):
    http_stats(http_server, reset=True)
    reply = stub.Score(request_for(["mode:flaky:2:svc", "x"]))
    assert len(reply.sample_ids) == 2
    assert http_stats(http_server)["flaky"] == 3


@pytest.mark.parametrize("label, code, words", [
    ("mode:garbage", grpc.StatusCode.FAILED_PRECONDITION, ["not JSON", "/by_label"]),
    ("mode:short", grpc.StatusCode.FAILED_PRECONDITION, ["'rewards' has 2 values for 3 samples"]),
    ("mode:nan", grpc.StatusCode.FAILED_PRECONDITION, ["sample index 2", "nan"]),
    ("mode:empty", grpc.StatusCode.FAILED_PRECONDITION, ["empty body"]),
    ("mode:reject", grpc.StatusCode.FAILED_PRECONDITION, ["HTTP 400"]),
    ("mode:cut", grpc.StatusCode.UNAVAILABLE, ["3 attempts", "ClientPayloadError"]),
    ("mode:slow:5", grpc.StatusCode.UNAVAILABLE, ["3 attempts", "no answer within --remote_rm_timeout_s 1 s"]),
])
def test_faults_give_clear_status_and_service_keeps_serving(stub, label, code, words):
    err = rpc_error(stub.Score, request_for([label, "a", "b"]))
    assert err.code() == code, err.details()
    for word in words:
        assert word in err.details()
    # The same service answers the next caller.
    assert len(stub.Score(request_for(["1", "2"])).sample_ids) == 2


def test_other_callers_are_served_while_one_waits_on_a_slow_server(stub):
    slow_error = {}

    def slow_call():
        try:
            stub.Score(request_for(["mode:slow:5"]))
        except grpc.RpcError as exc:
            slow_error["code"] = exc.code()

    thread = threading.Thread(target=slow_call)
    thread.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    for _ in range(5):
        stub.Score(request_for(["7", "8"]))
    assert time.monotonic() - t0 < 1.0  # not queued behind the ~3 s of slow attempts
    thread.join(30)
    assert slow_error["code"] == grpc.StatusCode.UNAVAILABLE


def test_empty_request_gives_empty_answer(stub):
    reply = stub.Score(reward_pb2.ScoreRequest())
    assert len(reply.sample_ids) == 0 and reply.rewards.shape == [0]


def test_big_batch_goes_through_in_chunks_below_the_message_limit(service):
    """The service accepts 1 MiB messages; 3,000 samples of ~1 KiB are cut into requests of 0.5 MiB."""
    n = 3000
    labels = [str(i) for i in range(n)]
    batch = ScoreBatch.from_texts(["p" * 500] * n, [f"it is {lab} " + "r" * 500 for lab in labels], labels)
    with pytest.raises(grpc.RpcError) as err:  # one request would be too big
        with make_sync_channel(service.address, max_message_mb=64) as channel:
            reward_pb2_grpc.RewardServiceStub(channel).Score(score_request(batch), timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    async def chunked():
        client = RewardClient(service.address, max_request_mb=0.5)
        try:
            return await client.score(batch)
        finally:
            await client.close()

    result = asyncio.run(chunked())
    np.testing.assert_array_equal(result.rewards, np.full(n, 0.5, dtype=np.float32))
    np.testing.assert_array_equal(result.scores, [len(q) for q in batch.queries])


def test_info(stub, http_server):
    info = stub.GetRewardInfo(reward_pb2.GetRewardInfoRequest())
    assert info.source == "http" and info.description == f"{http_server}/by_label"
    assert (info.clip_low, info.clip_high) == (0.0, 0.5) and not info.requires_labels


def test_metrics(service, stub, http_server):
    stub.Score(request_for(["mode:flaky:1:metrics", "z"]))
    text = metrics_text(service)
    url = f"{http_server}/by_label"

    def value(pattern: str) -> float:
        match = re.search(pattern + r" ([0-9.e+]+)", text)
        assert match, f"{pattern} not in metrics"
        return float(match.group(1))

    assert value(r'rlmesh_reward_score_duration_seconds_count\{source="http"\}') >= 1
    assert value(rf'rlmesh_reward_remote_requests_total\{{outcome="http_5xx",url="{url}"\}}') >= 1
    assert value(rf'rlmesh_reward_remote_requests_total\{{outcome="ok",url="{url}"\}}') >= 1
    assert value(rf'rlmesh_reward_remote_retries_total\{{url="{url}"\}}') >= 1
    assert value(r'rlmesh_reward_reward_value_bucket\{le="0.5",source="http"\}') >= 1
    assert value(r'rlmesh_reward_scored_samples_total\{source="http"\}') >= 2


def test_server_down_gives_unavailable_after_retries(tmp_path):
    down = f"http://127.0.0.1:{get_free_port()}/get_reward"
    proc = start_reward_service(tmp_path, "--remote_rm_url", down, "--remote_rm_retries", "2",
                                "--remote_rm_backoff_s", "0.05")
    try:
        with make_sync_channel(proc.address) as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            err = rpc_error(stub.Score, request_for(["1"]))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "3 attempts" in err.details() and down in err.details() and "check that the servers are up" in err.details()
            # Still serving: the health of the process is unaffected, and a second call gets the same answer.
            assert rpc_error(stub.Score, request_for(["2"])).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.stop()


def test_token_ids_that_do_not_fit_the_samples_are_invalid_argument(stub):
    import torch

    from services.common.tensors import ragged_to_proto

    request = request_for(["1", "2", "3"])
    request.prompt_token_ids.CopyFrom(ragged_to_proto([[1, 2], [3]]))
    err = rpc_error(stub.Score, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in err.details() and "2 sequences for 3 samples" in err.details()
    request.prompt_token_ids.CopyFrom(ragged_to_proto([[1.5], [2.0], [3.0]], torch.float32))
    err = rpc_error(stub.Score, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "INT32 or INT64" in err.details()
