"""One layer retries each hop: the reward service retries its remote server, and the client channel
(RewardClient, as the coordinator uses it) never sends the service's final answer again. A hanging
server surfaces as the reward service's own message within a bounded time, also when the caller's
deadline is shorter than the retries; and a batch sent twice under one request id is scored once.
All against a real HTTP reward server that counts its calls."""

import asyncio
import re
import time

import grpc
import pytest

from rlmesh.reward.v1 import reward_pb2_grpc
from services.common.client import make_sync_channel, returned_by_service
from services.reward.client import RewardClient, score_request
from services.reward.source import ScoreBatch
from tests.reward.conftest import http_stats, metrics_text, start_reward_service

RETRIES = 2  # --remote_rm_retries: 3 attempts per chunk
TIMEOUT_S = 1.0  # --remote_rm_timeout_s


@pytest.fixture(scope="module")
def service(http_server, tmp_path_factory):
    proc = start_reward_service(
        tmp_path_factory.mktemp("svc_retry"), "--remote_rm_url", f"{http_server}/by_label",
        "--remote_rm_timeout_s", str(TIMEOUT_S), "--remote_rm_retries", str(RETRIES),
        "--remote_rm_backoff_s", "0.05", "--remote_rm_backoff_max_s", "0.2")
    yield proc
    proc.stop()


def batch(labels: list[str], prompt: str = "q: ") -> ScoreBatch:
    return ScoreBatch.from_texts([prompt] * len(labels), [f"it is {x}" for x in labels], labels,
                                 sample_ids=[f"s{i}" for i in range(len(labels))])


def score(address: str, labels: list[str], request_id: str = "", timeout_s: float = 60.0):
    async def run():
        client = RewardClient(address, timeout_s=timeout_s)
        try:
            return await client.score(batch(labels), request_id=request_id)
        finally:
            await client.close()

    return asyncio.run(run())


def calls(http_server: str, route: str) -> int:
    return http_stats(http_server).get(route, 0)


def test_server_failing_every_call_is_called_exactly_the_services_retry_budget(service, http_server):
    before = calls(http_server, "flaky")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        score(service.address, ["mode:flaky:1000:budget", "x"])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"{RETRIES + 1} attempts" in err.value.details() and "/by_label" in err.value.details()
    assert returned_by_service(err.value)  # final: carries the pushback trailer
    # The client channel retries UNAVAILABLE for Score, yet the service's own final answer is not re-sent:
    # without the trailer this was (RETRIES + 1) x 5 calls.
    assert calls(http_server, "flaky") - before == RETRIES + 1


def test_hanging_server_gives_the_services_message_within_its_bound(service, http_server):
    before = calls(http_server, "slow")
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        score(service.address, ["mode:slow:30"])
    elapsed = time.monotonic() - t0
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"no answer within --remote_rm_timeout_s {TIMEOUT_S:g} s" in err.value.details()
    # Bound: (retries + 1) x timeout + back-offs (<= 0.05 + 0.1); the slack is for a loaded machine.
    assert elapsed < (RETRIES + 1) * TIMEOUT_S + 0.15 + 5.0
    assert calls(http_server, "slow") - before == RETRIES + 1


def test_caller_deadline_shorter_than_the_retries_gets_the_reason_before_it(tmp_path, http_server):
    proc = start_reward_service(tmp_path, "--remote_rm_url", f"{http_server}/by_label", "--remote_rm_timeout_s", "20",
                                "--remote_rm_retries", "3")
    try:
        before = calls(http_server, "slow")
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            score(proc.address, ["mode:slow:60"], request_id="deadline", timeout_s=4.0)
        elapsed = time.monotonic() - t0
        # The service's answer, sent before the caller's deadline, not the caller's own DEADLINE_EXCEEDED.
        assert returned_by_service(err.value), err.value
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "did not score the 1 samples of request deadline within the caller's deadline" in err.value.details()
        assert "--remote_rm_timeout_s" in err.value.details()
        assert elapsed < 4.0
        time.sleep(1.0)
        assert calls(http_server, "slow") - before == 1  # the retries stopped with the caller
    finally:
        proc.stop()


def test_a_batch_sent_again_under_its_request_id_is_scored_once(service, http_server):
    labels = ["mode:slow:0.5", "a", "b"]
    before = calls(http_server, "slow")
    joined_before = deduplicated(service)
    first = score(service.address, labels, request_id="run/step1/mb0")
    again = score(service.address, labels, request_id="run/step1/mb0")
    assert calls(http_server, "slow") - before == 1
    assert first.rewards.tolist() == again.rewards.tolist() and first.scores.tolist() == again.scores.tolist()

    async def twice_at_once():
        # Sent again while the first is still being scored (two channels, as after a reset): joined.
        clients = [RewardClient(service.address, timeout_s=60) for _ in range(2)]
        try:
            return await asyncio.gather(*(c.score(batch(labels), request_id="run/step1/mb1") for c in clients))
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    a, b = asyncio.run(twice_at_once())
    assert calls(http_server, "slow") - before == 2
    assert a.rewards.tolist() == b.rewards.tolist()
    # Other samples under the same id, or no id at all, are scored: the id alone is not the key.
    score(service.address, labels + ["c"], request_id="run/step1/mb0")
    score(service.address, labels)
    score(service.address, labels)
    assert calls(http_server, "slow") - before == 5
    assert deduplicated(service) - joined_before == 2


def deduplicated(service) -> float:
    found = re.search(r"^rlmesh_reward_deduplicated_requests_total (\S+)$", metrics_text(service), re.M)
    return float(found.group(1)) if found else 0.0


def test_sync_channel_without_retries_sees_the_same_final_status(service):
    with make_sync_channel(service.address, default_timeout_s=30) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(score_request(batch(["mode:reject"])))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert returned_by_service(err.value)
