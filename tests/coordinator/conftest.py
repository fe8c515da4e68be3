"""Helpers shared by the coordinator's end-to-end tests: running the real coordinator process."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from rlmesh.coordinator.v1 import coordinator_pb2_grpc
from services.common.client import make_sync_channel
from services.common.ready_file import ServiceStartError, wait_for_ready_file
from services.common.security import ClientCredentials

REPO = pathlib.Path(__file__).resolve().parents[2]


def service_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline")
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    return env


def start_coordinator(module: str, argv: list[str], log_path: pathlib.Path,
                      cwd: pathlib.Path = REPO) -> subprocess.Popen:
    """The coordinator as a user starts it, from `cwd` (the repository importable from anywhere)."""
    env = service_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    log = open(log_path, "wb")
    return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=cwd, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, log_path: pathlib.Path, timeout_s: float) -> str:
    """Waits for the coordinator; returns its log. Kills it (and fails) past timeout_s."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(60)
        pytest.fail(f"the coordinator ran past {timeout_s} s:\n{log_path.read_text(errors='replace')[-6000:]}")
    return log_path.read_text(errors="replace")


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def wait_for_file(path: pathlib.Path, proc: subprocess.Popen, log_path: pathlib.Path, timeout_s: float) -> dict:
    """The coordinator's (or a service's) ready file, once written; fails the test with the log's end."""
    try:
        return wait_for_ready_file(path, proc, timeout_s, name="the coordinator", log_path=log_path, poll_s=0.2,
                                   tail_lines=80)
    except ServiceStartError as exc:
        pytest.fail(str(exc))


def control_stub(address: str, run_dir: pathlib.Path | None = None):
    """A stub of the coordinator's control API; with run_dir it sends the run's token
    ({run_dir}/auth_token), which Pause / Resume / Stop require."""
    token = (run_dir / "auth_token").read_text().strip() if run_dir is not None else ""
    channel = make_sync_channel(address, credentials=ClientCredentials(token=token))
    return channel, coordinator_pb2_grpc.CoordinatorServiceStub(channel)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def service_pids(run_dir: pathlib.Path) -> dict[str, int]:
    return {p.name.removesuffix(".ready.json"): json.loads(p.read_text())["pid"]
            for p in (run_dir / "logs").glob("*.ready.json")}
