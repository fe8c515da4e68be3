"""The test-only hold switch (services/common/hold_points.py) on real processes: a call held at its
point while the process goes on serving others, released by a file, held once over all processes."""

import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
POINT = "learner.train.started"
# Two calls at once: "step1" (held where the switch names it) and a ticker that must go on meanwhile.
CODE = f"""
import asyncio
from services.common.hold_points import hold

async def call(name):
    await hold({POINT!r}, name)
    print("done", name, flush=True)

async def ticker():
    for i in range(3):
        await asyncio.sleep(0.05)
        print("tick", i, flush=True)

async def main():
    await asyncio.gather(call("step1"), ticker(), call("step2"))

asyncio.run(main())
"""


def start(**env: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RLMESH_")}
    return subprocess.Popen([sys.executable, "-c", CODE], env={**clean, "PYTHONPATH": str(REPO), **env}, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_file(path: pathlib.Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_unset_nothing_holds():
    out, _ = start().communicate(timeout=60)
    assert out.split("\n")[:2] == ["done step1", "done step2"]


def test_a_held_call_waits_for_its_release_and_the_process_serves_its_other_calls(tmp_path):
    entry = f"{POINT}:step1"
    proc = start(RLMESH_HOLD_AT=entry, RLMESH_HOLD_DIR=str(tmp_path))
    wait_file(tmp_path / f"held-{entry}")
    time.sleep(1.0)
    assert proc.poll() is None  # still held
    assert (tmp_path / f"held-{entry}").read_text().split()[0] == str(proc.pid)
    (tmp_path / f"release-{entry}").write_text("")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    # step2 and the ticker went on while step1 was held; step1 finished after its release.
    assert lines == ["done step2", "tick 0", "tick 1", "tick 2", "done step1"], lines
    # Held once over all processes: "the restart" passes at once.
    out, _ = start(RLMESH_HOLD_AT=entry, RLMESH_HOLD_DIR=str(tmp_path)).communicate(timeout=60)
    assert out.splitlines()[:2] == ["done step1", "done step2"]


def test_a_wrong_entry_or_a_missing_folder_stops_the_process_with_the_fix(tmp_path):
    proc = start(RLMESH_HOLD_AT="learner.train.begun", RLMESH_HOLD_DIR=str(tmp_path))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "names no point" in err and POINT in err
    proc = start(RLMESH_HOLD_AT=POINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "needs RLMESH_HOLD_DIR" in err
