"""The coordinator's ScoringPool against real reward service processes and a real HTTP reward server
that counts its calls: a reward instance killed with SIGKILL while it scores has its batches moved
to the other instance (or to its restart at the same address), every sample gets exactly one
score, and the retries are counted; final answers are not retried; the supervisor's hooks
(mark_dead, replace, add, remove) move or drain calls."""

import asyncio
import os
import signal
import time

import prometheus_client
import pytest

from services.coordinator.loop.scoring_pool import ScoringError, ScoringPool
from services.reward.client import RewardClient
from services.reward.source import ScoreBatch
from tests.conftest import get_free_port
from tests.reward.conftest import http_stats, start_http_reward_server, start_reward_service


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    proc = start_http_reward_server(tmp_path_factory.mktemp("http"))
    yield proc.info["url"]
    proc.stop()


def reward_service(tmp_path, url: str, *args: str):
    return start_reward_service(tmp_path, "--remote_rm_url", f"{url}/by_label", "--remote_rm_timeout_s", "30", *args)


def make_pool(addresses, **kwargs) -> ScoringPool:
    return ScoringPool("reward", addresses, lambda a: RewardClient(a, timeout_s=60, channel_retries=False), **kwargs)


def batch(k: int, first_label: str) -> ScoreBatch:
    """Micro-batch k: 4 samples; rewards 1, 0, 1, 0 (the label occurs in every other query)."""
    labels = [first_label] + [f"L{k}-{i}" for i in range(1, 4)]
    responses = [labels[0] if i % 2 == 0 else "no" for i in range(4)]
    responses[2] = labels[2]
    return ScoreBatch.from_texts(["q "] * 4, responses, labels, sample_ids=[f"p{k}/{i}" for i in range(4)])


def retries_metric() -> float:
    return prometheus_client.REGISTRY.get_sample_value("rlmesh_coordinator_rpc_retries_total",
                                                       {"service": "reward"}) or 0.0


async def wait_for_calls(url: str, route: str, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while http_stats(url).get(route, 0) < count:
        assert time.monotonic() < deadline, f"the HTTP server saw {http_stats(url)} calls, waited for {count} {route}"
        await asyncio.sleep(0.05)


def kill9(proc) -> None:
    os.kill(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(10)


def test_killed_instance_batches_move_to_the_other_and_each_sample_is_scored_once(tmp_path, http_server):
    services = [reward_service(tmp_path, http_server) for _ in range(2)]
    http_stats(http_server, reset=True)
    metric_before = retries_metric()
    events = []

    async def run():
        pool = make_pool([s.address for s in services])
        pool.on_event = lambda kind, **fields: events.append((kind, fields))
        try:
            batches = [batch(k, "mode:slow:3") for k in range(8)]
            tasks = [asyncio.ensure_future(pool.call(lambda c, b=b, k=k: c.score(b, request_id=f"run/step1/mb{k}")))
                     for k, b in enumerate(batches)]
            await wait_for_calls(http_server, "slow", 8)  # every batch is at the HTTP server
            assert [i.in_flight for i in pool.instances] == [4, 4]
            kill9(services[0])
            results = await asyncio.gather(*tasks)
            return pool.retries, results
        finally:
            await pool.close()

    try:
        retries, results = asyncio.run(run())
    finally:
        for s in services:
            s.stop()
    # Each micro-batch has one answer with one reward per sample, the right ones.
    for result in results:
        assert result.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    # The 4 batches of the killed instance were sent once more, to the survivor: 8 + 4 calls.
    assert retries == 4
    assert retries_metric() - metric_before == 4
    assert http_stats(http_server)["slow"] == 12
    # The supervisor's event sink (events.jsonl) hears of the death and of each retry.
    assert [k for k, _ in events].count("scoring.retry") == 4
    assert ("scoring.instance_down", "reward-0") in [(k, f["instance"]) for k, f in events]


def test_single_instance_restarted_at_its_address_finishes_the_call(tmp_path, http_server):
    port = get_free_port()
    first = reward_service(tmp_path, http_server, "--port", str(port))
    http_stats(http_server, reset=True)
    restarted = []

    async def run():
        pool = make_pool([first.address], probe_interval_s=0.2)
        try:
            task = asyncio.ensure_future(pool.call(lambda c: c.score(batch(0, "mode:slow:1"), request_id="r/1/0")))
            await wait_for_calls(http_server, "slow", 1)
            kill9(first)
            await asyncio.sleep(1.0)
            assert not task.done()  # waiting for a serving instance
            restarted.append(await asyncio.to_thread(reward_service, tmp_path, http_server, "--port", str(port)))
            result = await asyncio.wait_for(task, 60)
            return pool.retries, result, pool.instances[0].state
        finally:
            await pool.close()

    try:
        retries, result, state = asyncio.run(run())
    finally:
        first.stop()
        for s in restarted:
            s.stop()
    assert result.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert retries == 1 and state == "serving"
    assert http_stats(http_server)["slow"] == 2


def test_waiting_for_a_serving_instance_is_bounded_and_names_the_instance(tmp_path, http_server):
    proc = reward_service(tmp_path, http_server)
    address = proc.address
    kill9(proc)

    async def run():
        pool = make_pool([address], wait_s=2.0)
        try:
            t0 = time.monotonic()
            with pytest.raises(ScoringError) as err:
                await pool.call(lambda c: c.score(batch(0, "x")))
            return time.monotonic() - t0, str(err.value)
        finally:
            await pool.close()

    elapsed, message = asyncio.run(run())
    assert 2.0 <= elapsed < 10.0
    assert f"reward-0 at {address} is down" in message and "--scoring_wait_s" in message


def test_a_services_own_error_is_final_and_names_the_instance(tmp_path, http_server):
    proc = reward_service(tmp_path, http_server)
    http_stats(http_server, reset=True)

    async def run():
        pool = make_pool([proc.address])
        try:
            with pytest.raises(ScoringError) as err:
                await pool.call(lambda c: c.score(batch(0, "mode:reject")))
            return pool.retries, str(err.value)
        finally:
            await pool.close()

    try:
        retries, message = asyncio.run(run())
    finally:
        proc.stop()
    assert retries == 0 and http_stats(http_server)["reject"] == 1
    assert message.startswith(f"reward service reward-0 at {proc.address}: FAILED_PRECONDITION")


def test_supervisor_hooks_move_and_drain_calls(tmp_path, http_server):
    a, b, c = (reward_service(tmp_path, http_server) for _ in range(3))
    http_stats(http_server, reset=True)

    async def run():
        pool = make_pool([a.address])
        try:
            # mark_dead: the call in flight on reward-0 moves to the instance added next.
            moving = asyncio.ensure_future(pool.call(lambda cl: cl.score(batch(0, "mode:slow:1"), request_id="h/0")))
            await wait_for_calls(http_server, "slow", 1)
            pool.mark_dead(0, "process exited with code -9")
            await asyncio.sleep(0.2)
            assert not moving.done()
            assert pool.add(b.address) == 1
            assert (await asyncio.wait_for(moving, 30)).rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
            assert pool.retries == 1
            # replace: reward-0 lives at c's address now and takes calls again.
            pool.replace(0, c.address)
            assert [i.state for i in pool.instances] == ["serving", "serving"]
            # remove: reward-1 drains (its call finishes there), new calls go to reward-0.
            draining = asyncio.ensure_future(pool.call(lambda cl: cl.score(batch(1, "mode:slow:1"), request_id="h/1")))
            await asyncio.sleep(0.1)
            busy = next(i for i in pool.instances if i.in_flight)
            removal = asyncio.ensure_future(pool.remove(busy.address))
            await asyncio.sleep(0.1)
            assert not removal.done()
            later = await pool.call(lambda cl: cl.score(batch(2, "x"), request_id="h/2"))
            assert later.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
            await asyncio.wait_for(removal, 30)
            assert draining.done() and draining.result().rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
            assert busy not in pool.instances and len(pool.instances) == 1
            assert pool.instances[0].address == (b.address if busy.index == 0 else c.address)
            return pool.retries
        finally:
            await pool.close()

    try:
        assert asyncio.run(run()) == 1
    finally:
        for s in (a, b, c):
            s.stop()


def test_reference_calls_move_off_a_killed_instance(tmp_path, tiny_model_dir):
    import torch

    from services.reward.client import ReferenceClient

    services = [start_reward_service(tmp_path, "--ref_pretrain", str(tiny_model_dir)) for _ in range(2)]
    kill9(services[0])
    sequences = [torch.arange(4, 4 + n) for n in (6, 9, 7)]
    starts = [2, 3, 4]

    async def run():
        pool = ScoringPool("reference", [s.address for s in services],
                           lambda a: ReferenceClient(a, timeout_s=60, channel_retries=False))
        try:
            # reference-0 is tried first (least loaded, lowest index), found dead, and left.
            out = await pool.call(lambda c: c.ref_logprobs(sequences, starts, 1.0, request_id="ref/1"))
            again = await pool.call(lambda c: c.ref_logprobs(sequences, starts, 1.0, request_id="ref/2"))
            return out, again, pool.retries, [i.state for i in pool.instances]
        finally:
            await pool.close()

    try:
        out, again, retries, states = asyncio.run(run())
    finally:
        for s in services:
            s.stop()
    assert [len(t) for t in out] == [4, 6, 3]
    assert all(torch.equal(a, b) for a, b in zip(out, again))
    assert retries == 1 and states == ["down", "serving"]
