"""The remote HTTP reward source against a real aiohttp reward server on loopback."""

import asyncio
import random
import time

import grpc
import numpy as np
import pytest

from services.common.errors import ServiceError
from services.reward.http_source import HttpRewardSource
from services.reward.remote import RemotePolicy, backoff_delay
from services.reward.source import ScoreBatch
from tests.reward.conftest import http_stats


def batch(n: int) -> ScoreBatch:
    labels = [str(i % 7) for i in range(n)]
    # Odd samples contain their label, even ones do not.
    responses = [f"answer {lab}" if i % 2 else "no idea" for i, lab in enumerate(labels)]
    return ScoreBatch.from_texts([f"q{i}: " for i in range(n)], responses, labels,
                                 sample_ids=[f"s{i}" for i in range(n)])


def expected_rewards(b: ScoreBatch) -> np.ndarray:
    return np.array([1.0 if lab in q else 0.0 for q, lab in zip(b.queries, b.labels)])


def score(urls, b, **policy):
    async def run():
        source = HttpRewardSource(urls, RemotePolicy(**{"backoff_s": 0.01, "backoff_max_s": 0.05, **policy}), seed=0)
        await source.start()
        try:
            return await source.score(b)
        finally:
            await source.close()

    return asyncio.run(run())


def score_error(urls, b, **policy) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        score(urls, b, **policy)
    return err.value


def test_rewards_scores_and_extra_logs_in_order_across_batches(http_server):
    http_stats(http_server, reset=True)
    b = batch(50)
    # Each call takes 0.2 s, so the limit of 3 calls in flight is reached and not exceeded.
    out = score([f"{http_server}/slow?s=0.2"], b, batch_size=8, max_in_flight=3)
    np.testing.assert_array_equal(out.rewards, expected_rewards(b))
    np.testing.assert_array_equal(out.scores, [len(q) for q in b.queries])
    np.testing.assert_array_equal(out.extra["query_len"], [len(q) for q in b.queries])
    stats = http_stats(http_server)
    assert sorted(stats["batch_sizes"]) == sorted([8] * 6 + [2])
    assert stats["max_concurrent"] == 3


def test_load_balances_by_outstanding_requests(http_server):
    """A slow and a fast URL: the fast one, free more often, gets most of the calls."""
    http_stats(http_server, reset=True)
    out = score([f"{http_server}/slow?s=0.5", f"{http_server}/ok"], batch(40), batch_size=2, max_in_flight=2)
    assert len(out.rewards) == 40
    stats = http_stats(http_server)
    assert stats["slow"] >= 1 and stats["ok"] >= 3 * stats["slow"], stats


def test_500_then_200_is_retried(http_server):
    http_stats(http_server, reset=True)
    b = batch(4)
    out = score([f"{http_server}/flaky?fails=2&key=a"], b, max_retries=3)
    np.testing.assert_array_equal(out.rewards, expected_rewards(b))
    assert http_stats(http_server)["flaky"] == 3


def test_retry_budget_spent_on_500_gives_unavailable(http_server):
    err = score_error([f"{http_server}/flaky?fails=99&key=b"], batch(3), max_retries=2)
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "3 attempts" in err.message and "HTTP 500" in err.message and "/flaky" in err.message


def test_slow_server_times_out_then_unavailable(http_server):
    t0 = time.monotonic()
    err = score_error([f"{http_server}/slow?s=5"], batch(2), timeout_s=0.3, max_retries=1)
    assert time.monotonic() - t0 < 3
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "no answer within" in err.message and "/slow" in err.message


def test_server_down_spends_retries_then_unavailable(down_url):
    err = score_error([down_url], batch(2), max_retries=2)
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "3 attempts" in err.message and down_url in err.message and "ClientConnectorError" in err.message


def test_down_url_is_avoided_when_another_is_up(http_server, down_url):
    b = batch(12)
    out = score([down_url, f"{http_server}/ok"], b, batch_size=2, max_retries=1)
    np.testing.assert_array_equal(out.rewards, expected_rewards(b))


def test_connection_closed_mid_response_is_retried_then_unavailable(http_server):
    http_stats(http_server, reset=True)
    err = score_error([f"{http_server}/cut"], batch(3), max_retries=1)
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "ClientPayloadError" in err.message
    assert http_stats(http_server)["cut"] == 2


@pytest.mark.parametrize("route, problem", [
    ("garbage", "not JSON"),
    ("empty", "empty body"),
    ("short", "'rewards' has 4 values for 5 samples"),
    ("nan", "'rewards'[4] (sample index 4) is nan"),
    ("string", "'rewards'[0] (sample index 0) is 'high', not a number"),
    ("missing", "no 'rewards' field"),
])
def test_bad_answers_fail_at_once_naming_url_and_sample(http_server, route, problem):
    http_stats(http_server, reset=True)
    err = score_error([f"{http_server}/{route}"], batch(5), max_retries=3)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert problem in err.message and f"{http_server}/{route}" in err.message
    assert http_stats(http_server)[route] == 1  # not retried


def test_sample_index_counts_from_start_of_request(http_server):
    """The bad sample is the 3rd of the second chunk: its index is in request numbering."""
    b = batch(10)
    b.labels[7] = "bad"
    err = score_error([f"{http_server}/nan?label=bad"], b, batch_size=5)
    assert "sample index 7" in err.message


def test_4xx_is_not_retried(http_server):
    http_stats(http_server, reset=True)
    err = score_error([f"{http_server}/reject"], batch(2), max_retries=3)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "HTTP 400" in err.message and "labels required" in err.message
    assert http_stats(http_server)["reject"] == 1


def test_empty_batch_makes_no_call(http_server):
    http_stats(http_server, reset=True)
    out = score([f"{http_server}/ok"], batch(0))
    assert len(out.rewards) == 0 and len(out.scores) == 0
    assert "ok" not in http_stats(http_server)


def test_backoff_grows_exponentially_with_jitter():
    rng = random.Random(0)
    delays = [[backoff_delay(a, 0.5, 8.0, rng) for _ in range(200)] for a in range(6)]
    for attempt, ds in enumerate(delays):
        cap = min(8.0, 0.5 * 2 ** attempt)
        assert cap / 2 <= min(ds) and max(ds) <= cap
        assert max(ds) - min(ds) > cap / 4  # jittered, not constant


def test_failed_url_gets_traffic_again_after_the_back_off_window(http_server):
    http_stats(http_server, reset=True)
    urls = [f"{http_server}/flaky?fails=1&key=recover", f"{http_server}/ok"]

    async def run():
        source = HttpRewardSource(urls, RemotePolicy(batch_size=1, max_in_flight=1, backoff_s=0.01,
                                                     backoff_max_s=0.2), seed=0)
        await source.start()
        try:
            await source.score(batch(1))  # fails at the flaky URL, the retry goes to /ok
            first = http_stats(http_server)["flaky"]
            await source.score(batch(4))  # within the window: /ok only
            within = http_stats(http_server)["flaky"]
            await asyncio.sleep(0.3)
            await source.score(batch(4))
            return first, within, http_stats(http_server)["flaky"]
        finally:
            await source.close()

    first, within, after = asyncio.run(run())
    assert (first, within) == (1, 1)
    assert after >= 2  # back in rotation, and now answering


def test_openrlhf_one_sample_servers_may_answer_single_numbers(http_server):
    """OpenRLHF 0.10 posts one sample per request, and its servers may answer {"rewards": 1.0, ...};
    --remote_rm_batch_size 1 is that convention. A single number for several samples is an error."""
    b = batch(5)
    out = score([f"{http_server}/scalar"], b, batch_size=1)
    np.testing.assert_array_equal(out.rewards, expected_rewards(b))
    np.testing.assert_array_equal(out.scores, [len(q) for q in b.queries])
    # extra_logs given as one number per call: a batch metric, not a per-sample value.
    assert "query_len" not in out.extra
    assert out.batch["query_len"] == (float(sum(len(q) for q in b.queries)), 5)
    err = score_error([f"{http_server}/scalar"], b, batch_size=4)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'rewards' is one number" in err.message and "--remote_rm_batch_size 1" in err.message
