"""Processes the reward tests talk to: real HTTP reward servers and the reward service itself."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from services.common.ready_file import ServiceStartError, wait_for_ready_file
from tests.conftest import get_free_port

REPO = pathlib.Path(__file__).resolve().parents[2]


class Proc:
    """A started process and what its ready file said."""

    def __init__(self, popen: subprocess.Popen, info: dict, log: pathlib.Path):
        self.popen, self.info, self.log = popen, info, log

    @property
    def address(self) -> str:
        return self.info["address"]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def start_process(argv: list[str], ready_file: pathlib.Path, timeout_s: float = 120.0) -> Proc:
    """Runs `python -m ...argv` in the repo root and waits for its ready file."""
    log = ready_file.with_suffix(".log")
    with log.open("w") as out:
        popen = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        info = wait_for_ready_file(ready_file, popen, timeout_s, log_path=log, poll_s=0.05, tail_lines=60)
    except ServiceStartError:
        popen.kill()
        popen.wait(10)
        raise
    return Proc(popen, info, log)


def start_http_reward_server(tmp: pathlib.Path) -> Proc:
    ready = tmp / f"http-{time.monotonic_ns()}.json"
    proc = start_process(["tests.reward.http_reward_server", "--ready_file", str(ready)], ready, 30)
    proc.info["url"] = f"http://127.0.0.1:{proc.info['port']}"
    return proc


def start_reward_service(tmp: pathlib.Path, *args: str) -> Proc:
    ready = tmp / f"reward-{time.monotonic_ns()}.json"
    return start_process(["services.reward", "--host", "127.0.0.1", "--port", "0", "--metrics_port", "0",
                          "--grace_period_s", "2", "--ready_file", str(ready), *args], ready)


def http_stats(base_url: str, reset: bool = False) -> dict:
    """The server's counters; reset=True first waits (at most 30 s) for calls an earlier test left
    in flight, so that they do not count in the next test's concurrency."""
    deadline = time.monotonic() + 30.0
    while reset and time.monotonic() < deadline:
        with urllib.request.urlopen(f"{base_url}/stats", timeout=10) as r:
            if not json.loads(r.read()).get("in_flight", 0):
                break
        time.sleep(0.1)
    with urllib.request.urlopen(f"{base_url}/stats" + ("?reset=1" if reset else ""), timeout=10) as r:
        return json.loads(r.read())


def metrics_text(proc: Proc) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.info['metrics_port']}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    proc = start_http_reward_server(tmp_path_factory.mktemp("http"))
    yield proc.info["url"]
    proc.stop()


@pytest.fixture
def down_url() -> str:
    """An HTTP URL where nothing listens."""
    return f"http://127.0.0.1:{get_free_port()}/get_reward"
