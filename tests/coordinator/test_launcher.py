"""The local launcher: ready detection, start failures with the service's log, no orphans."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import pytest

from services.common.ready_file import wait_for_ready_file
from services.coordinator.fleet.launcher import ServiceStartError, spawn_service, stop_all, wait_until_ready
from tests.coordinator.conftest import REPO, pid_alive


def test_ready_then_graceful_stop(tmp_path):
    service = spawn_service("echo", "tests.common.echo_server", [], tmp_path)
    asyncio.run(wait_until_ready(service, 60))
    assert service.address.startswith("127.0.0.1:") and service.alive()
    stop_all([service], grace_s=20)
    assert service.process.returncode == 0  # SIGTERM -> drained and exited cleanly
    assert "server.stopped" in service.log_path.read_text()


def test_a_service_that_fails_to_start_is_reported_with_its_log(tmp_path):
    service = spawn_service("echo", "tests.common.echo_server", ["--no_such_flag"], tmp_path)
    with pytest.raises(ServiceStartError) as err:
        asyncio.run(wait_until_ready(service, 60))
    assert "exited with code 2" in str(err.value) and "--no_such_flag" in str(err.value)


PARENT = """
import json, sys, time, pathlib
from services.coordinator.fleet.launcher import spawn_service
s = spawn_service("echo", "tests.common.echo_server", [], pathlib.Path(sys.argv[1]))
print(json.dumps({"pid": s.pid}), flush=True)
time.sleep(600)
"""


def test_children_die_with_a_killed_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    child = json.loads(parent.stdout.readline())["pid"]
    # The parent is the process watched: it stays up until killed below.
    wait_for_ready_file(tmp_path / "echo.ready.json", parent, 60, name="the echo service")
    assert pid_alive(child)
    parent.send_signal(signal.SIGKILL)  # no cleanup code runs in the parent
    parent.wait(10)
    deadline = time.monotonic() + 30
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(child), "the service outlived its killed parent"
