"""The test-only crash switch (services/common/crash_points.py) on real processes: who dies, where,
how often, and what a wrong entry says."""

import os
import pathlib
import signal
import subprocess
import sys

from services.common import crash_points

REPO = pathlib.Path(__file__).resolve().parents[2]
POINT = "coordinator.step.trained"


def run(times: int, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RLMESH_") and k != "RANK"}
    code = ("from services.common.crash_points import crash_point\n"
            f"for i in range({times}):\n    print(i, flush=True)\n    crash_point({POINT!r})\nprint('lived')")
    return subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(REPO), **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_unset_the_switch_does_nothing():
    assert crash_points._PLAN is None or os.environ.get("RLMESH_CRASH_AT")
    proc = run(3)
    assert proc.returncode == 0 and proc.stdout.split() == ["0", "1", "2", "lived"]


def test_the_named_point_kills_the_process_at_the_nth_time():
    proc = run(3, RLMESH_CRASH_AT=f"{POINT}#2")
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["0", "1"]  # killed at its second pass, before the third


def test_the_process_filter_names_a_service_or_a_rank():
    assert run(1, RLMESH_CRASH_AT=f"{POINT}@rollout-1", RLMESH_SERVICE="rollout-0").returncode == 0
    assert run(1, RLMESH_CRASH_AT=f"{POINT}@rollout-1", RLMESH_SERVICE="rollout-1").returncode == -signal.SIGKILL
    assert run(1, RLMESH_CRASH_AT=f"{POINT}@rank1", RANK="0").returncode == 0
    assert run(1, RLMESH_CRASH_AT=f"{POINT}@rank1", RANK="1").returncode == -signal.SIGKILL
    # Another point in the list does not fire here.
    assert run(2, RLMESH_CRASH_AT="coordinator.step.pushed").returncode == 0


def test_with_a_once_dir_a_restarted_process_lives_on(tmp_path):
    env = {"RLMESH_CRASH_AT": POINT, "RLMESH_CRASH_ONCE_DIR": str(tmp_path)}
    assert run(1, **env).returncode == -signal.SIGKILL
    fired = list(tmp_path.iterdir())
    assert [p.name for p in fired] == [f"fired-{POINT}"]
    assert run(1, **env).returncode == 0  # "the restart": the same point, no second kill


def test_a_wrong_entry_stops_the_process_with_the_fix():
    proc = run(1, RLMESH_CRASH_AT="coordinator.step.trianed")
    assert proc.returncode == 1 and "names no point" in proc.stderr and POINT in proc.stderr
    proc = run(1, RLMESH_CRASH_AT=f"{POINT}#0")
    assert proc.returncode == 1 and "whole number >= 1" in proc.stderr


def test_a_call_filter_matches_the_request_id_or_its_prefix_before_a_dash():
    """The ':<call>' filter hold points take (crash points are passed no request id: refused)."""
    def passes(*ids: str) -> list[str]:
        entry = crash_points.Entry(f"{POINT}:step3", POINT, "", "step3", 1)
        out = []
        for call in ids:
            out.append(call)
            if entry.reached(POINT, call):
                return out
        return [*out, "lived"]

    assert passes("step30", "step13", "step3-ab12", "step4") == ["step30", "step13", "step3-ab12"]
    assert passes("step2", "step3") == ["step2", "step3"]
    assert passes("step2", "step30-x", "step4") == ["step2", "step30-x", "step4", "lived"]


def test_a_crash_entry_naming_a_call_is_refused():
    proc = run(1, RLMESH_CRASH_AT=f"{POINT}:step3")
    assert proc.returncode == 1 and "take no ':<request id>'" in proc.stderr and "'#N'" in proc.stderr