"""What the supervisor (services/coordinator/fleet/supervisor.py) tells the user when it stops a run:
an instance that died past --max_restarts points at --max_restarts; one that cannot be placed
anywhere (NoRoom: its node was lost and no node has room) does not, since more restarts would not
help, and says what can instead (the placement's own message)."""

from __future__ import annotations

import asyncio

from services.coordinator.fleet.supervisor import NoRoom, ServiceFailed, Supervisor

NO_ROOM = ("rollout-0: no node took its bundle (...) within --ray_placement_timeout_s 30 s; ... a node with room for "
           "the bundle must join (`ray start --address 10.0.0.1:41234 --num-gpus 1`)")


class DyingPlacement:
    """One rollout instance that is dead at every check; a restart raises `restart_error`."""

    def __init__(self, restart_error: Exception):
        self.restart_error = restart_error
        self.restarts = 0

    def instances(self):
        return [("rollout-0", ("rollout",), "127.0.0.1:1")]

    async def check(self, name: str) -> str:
        return "exit code -9"

    async def restart(self, name: str) -> str:
        self.restarts += 1
        raise self.restart_error

    def log_tail(self, name: str) -> str:
        return "Last lines of rollout-0's log: (none)"


def stopped_with(placement, max_restarts: int, tmp_path) -> tuple[str, list]:
    async def run() -> str:
        supervisor = Supervisor(placement, max_restarts, backoff_s=0.0, poll_s=0.01, run_dir=tmp_path)
        supervisor.start()
        try:
            await asyncio.wait_for(supervisor.run_unless_failed(asyncio.sleep(30)), 10)
        except ServiceFailed as exc:
            return str(exc)
        finally:
            await supervisor.stop()
        raise AssertionError("the run did not stop")

    message = asyncio.run(run())
    return message, (tmp_path / "events.jsonl").read_text().splitlines()


def test_no_room_does_not_suggest_more_restarts(tmp_path):
    placement = DyingPlacement(NoRoom(NO_ROOM))
    message, events = stopped_with(placement, max_restarts=8, tmp_path=tmp_path)
    assert placement.restarts == 1  # given up at once: a retry per --max_restarts would only wait again
    assert message.startswith(f"rollout-0 (rollout) could not be restarted: {NO_ROOM}; the run stops. "), message
    assert "raise --max_restarts" not in message and "ray start --address 10.0.0.1:41234" in message, message
    assert message.endswith("Last lines of rollout-0's log: (none)"), message
    assert any('"service.failed"' in line for line in events), events


def test_deaths_past_the_budget_suggest_raising_it(tmp_path):
    placement = DyingPlacement(RuntimeError("never reached"))
    message, _ = stopped_with(placement, max_restarts=0, tmp_path=tmp_path)
    assert placement.restarts == 0
    assert message.startswith("rollout-0 (rollout) died (exit code -9) after 0 restart(s) of --max_restarts 0; "
                              "the run stops. Fix the cause and rerun with --load_checkpoint, or raise --max_restarts. "
                              "Last lines of rollout-0's log"), message
