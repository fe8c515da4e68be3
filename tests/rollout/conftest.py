"""Rollout service processes for the tests: one vLLM engine and one transformers engine per session.

Each is the real `python -m services.rollout` on loopback with the tiny model in float32 (so that
vLLM, the hf engine and a transformers forward pass can be compared tightly). Their logs go to
files under the session's temp dir and are printed when a start-up fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from rlmesh.rollout.v1 import rollout_pb2_grpc
from services.common.client import make_sync_channel

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256


@dataclasses.dataclass
class RolloutProcess:
    proc: subprocess.Popen
    address: str
    metrics_port: int
    log_path: pathlib.Path

    def channel(self, timeout_s: float = 120.0) -> grpc.Channel:
        return make_sync_channel(self.address, default_timeout_s=timeout_s)

    def stub(self, channel: grpc.Channel) -> rollout_pb2_grpc.RolloutServiceStub:
        return rollout_pb2_grpc.RolloutServiceStub(channel)

    def metrics(self) -> dict[str, float]:
        """The Prometheus text exposition as {'name{labels}': value}."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                values[key] = float(value)
        return values

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def start_rollout(model_dir: pathlib.Path, work_dir: pathlib.Path, *args: str, timeout_s: float = 300) -> RolloutProcess:
    """Starts the service, waits for its ready file; raises with the log tail if it does not come up."""
    work_dir.mkdir(parents=True, exist_ok=True)
    ready = work_dir / "ready.json"
    log_path = work_dir / "service.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "services.rollout", "--pretrain", str(model_dir), "--host", "127.0.0.1",
           "--port", "0", "--metrics_port", "0", "--ready_file", str(ready), "--grace_period_s", "5", *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_rollout(proc)
            raise RuntimeError(f"rollout service did not start:\n{log_path.read_text(errors='replace')[-8000:]}")
        time.sleep(0.2)
    info = json.loads(ready.read_text())
    return RolloutProcess(proc, info["address"], info["metrics_port"], log_path)


def stop_rollout(proc: subprocess.Popen) -> None:
    """SIGTERM (graceful: the engine shuts its workers down), then SIGKILL of the process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine-core and worker processes, if any remain
    except ProcessLookupError:
        pass
    proc.wait(10)


ENGINE_ARGS = ("--dtype", "float32", "--max_model_len", str(MAX_MODEL_LEN), "--seed", "0")


@pytest.fixture(scope="session")
def vllm_rollout(tiny_model_dir, tmp_path_factory):
    service = start_rollout(tiny_model_dir, tmp_path_factory.mktemp("rollout_vllm"), *ENGINE_ARGS,
                            "--engine", "vllm", "--gpu_memory_utilization", "0.1", "--enforce_eager")
    yield service
    stop_rollout(service.proc)


@pytest.fixture(scope="session")
def hf_rollout(tiny_model_dir, tmp_path_factory):
    service = start_rollout(tiny_model_dir, tmp_path_factory.mktemp("rollout_hf"), *ENGINE_ARGS, "--engine", "hf",
                            "--hf_device", "cpu")
    yield service
    stop_rollout(service.proc)
