"""The supervisor's restart back-off (services/coordinator/fleet/supervisor.py): doubled per restart
of an instance that has not served a finished step since (a crash loop), and back to
--restart_backoff_s once it has, so that a long run with many unrelated deaths does not end up
waiting the 60 s cap after each one."""

from __future__ import annotations

import asyncio
import json

from services.coordinator.fleet.supervisor import SERVING, Supervisor


class KillablePlacement:
    """One engine whose death the test decides; restarts always succeed."""

    def __init__(self):
        self.dead = False
        self.restarts = 0

    def instances(self):
        return [("rollout-0", ("rollout",), "127.0.0.1:1")]

    async def check(self, name: str) -> str:
        return "exit code -9" if self.dead else ""

    async def restart(self, name: str) -> str:
        self.restarts += 1
        self.dead = False
        return "127.0.0.1:1"

    def log_tail(self, name: str) -> str:
        return ""


def backoffs_of(tmp_path, finished_steps_between: list[bool]) -> list[float]:
    """Kills the instance once per entry; after each restart a step finishes when the entry says so."""

    async def run() -> None:
        placement = KillablePlacement()
        supervisor = Supervisor(placement, max_restarts=10, backoff_s=0.01, poll_s=0.005, run_dir=tmp_path)
        instance = supervisor.instances["rollout-0"]
        instance.state = SERVING

        async def serving_again(restarted):
            restarted.state = SERVING  # what recovery.py does once the engine holds the weights

        supervisor.on_restarted.append(serving_again)
        supervisor.start()
        try:
            for k, step_between in enumerate(finished_steps_between):
                placement.dead = True
                await asyncio.wait_for(_until(lambda: placement.restarts == k + 1
                                              and instance.state == SERVING), 10)
                if step_between:
                    supervisor.step_finished()
        finally:
            await supervisor.stop()

    asyncio.run(run())
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    return [e["backoff_s"] for e in events if e["event"] == "service.restarted"]


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.002)


def test_a_crash_loop_backs_off_longer_each_time(tmp_path):
    assert backoffs_of(tmp_path, [False, False, False, False]) == [0.01, 0.02, 0.04, 0.08]


def test_an_instance_that_served_a_finished_step_starts_from_the_first_back_off(tmp_path):
    # Two deaths in a row (no step between), a step, then deaths each with a step between them.
    assert backoffs_of(tmp_path, [False, True, True, False, True]) == [0.01, 0.02, 0.01, 0.01, 0.02]


def test_finished_steps_do_not_reset_the_restart_budget(tmp_path):
    # The budget (--max_restarts) is not reset by finished steps: it counts deaths over the run.
    async def run():
        placement = KillablePlacement()
        supervisor = Supervisor(placement, max_restarts=10, backoff_s=0.01, poll_s=0.005, run_dir=tmp_path)
        instance = supervisor.instances["rollout-0"]

        async def serving_again(restarted):
            restarted.state = SERVING

        supervisor.on_restarted.append(serving_again)
        supervisor.start()
        try:
            for k in range(3):
                placement.dead = True
                await asyncio.wait_for(_until(lambda: placement.restarts == k + 1 and instance.state == SERVING), 10)
                supervisor.step_finished()
        finally:
            await supervisor.stop()
        return instance

    instance = asyncio.run(run())
    assert instance.restarts == 3 and instance.backoff_level == 0
