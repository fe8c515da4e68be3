"""Rollout service processes, request builders and transformers references for the rollout tests
(also used by tests/gpu/test_rollout_gpu.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request

import grpc
import torch

from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.client import make_sync_channel
from services.common.logprobs import sequence_logprobs
from services.common.ready_file import ServiceStartError, wait_for_ready_file
from services.common.tensors import from_proto, to_proto

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256
# The tiny model in float32 (so that vLLM, the hf engine and a transformers forward pass compare tightly).
ENGINE_ARGS = ("--dtype", "float32", "--max_model_len", str(MAX_MODEL_LEN), "--seed", "0")
VLLM_ARGS = (*ENGINE_ARGS, "--engine", "vllm", "--gpu_memory_utilization", "0.1", "--enforce_eager")


@dataclasses.dataclass
class RolloutProcess:
    proc: subprocess.Popen
    address: str
    metrics_port: int
    log_path: pathlib.Path
    # GetModelInfo(include_parameters) right after the start, before any test pushed weights.
    info_at_start: rollout_pb2.GetModelInfoResponse | None = None

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
    try:
        info = wait_for_ready_file(ready, proc, timeout_s, name="rollout service", log_path=log_path, poll_s=0.2,
                                   tail_lines=100)
    except ServiceStartError:
        stop_rollout(proc)
        raise
    service = RolloutProcess(proc, info["address"], info["metrics_port"], log_path)
    with service.channel() as channel:
        service.info_at_start = service.stub(channel).GetModelInfo(
            rollout_pb2.GetModelInfoRequest(include_parameters=True), timeout=60)
    return service


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


def token_prompt(prompt_id: str, ids) -> rollout_pb2.Prompt:
    return rollout_pb2.Prompt(prompt_id=prompt_id, token_ids=to_proto(torch.tensor(ids, dtype=torch.int64)))


def text_prompt(prompt_id: str, text: str) -> rollout_pb2.Prompt:
    return rollout_pb2.Prompt(prompt_id=prompt_id, text=text)


def chat_prompt(prompt_id: str, user: str) -> rollout_pb2.Prompt:
    return rollout_pb2.Prompt(prompt_id=prompt_id, chat=rollout_pb2.ChatMessages(
        messages=[rollout_pb2.ChatMessage(role="user", content=user)]))


def generate(stub, prompts, n=1, timeout=120, **sampling) -> list[rollout_pb2.GenerateResponse]:
    request = rollout_pb2.GenerateRequest(request_id="test", prompts=prompts, n=n,
                                          sampling=rollout_pb2.SamplingOptions(**sampling))
    return list(stub.Generate(request, timeout=timeout))


def by_key(responses) -> dict[tuple[str, int], rollout_pb2.GenerateResponse]:
    return {(r.prompt_id, r.sample_index): r for r in responses}


def tokens(response) -> list[int]:
    return from_proto(response.response_token_ids).tolist()


def logprobs(response) -> list[float]:
    return from_proto(response.logprobs).tolist()


def greedy_ids(stub, prompt_ids: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    responses = by_key(generate(stub, [token_prompt(str(i), p) for i, p in enumerate(prompt_ids)],
                                temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [tokens(responses[(str(i), 0)]) for i in range(len(prompt_ids))]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes (no cache): the plainest reference."""
    ids = list(prompt)
    for _ in range(new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def hf_response_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response token t | prompt, response < t) from one transformers forward pass."""
    ids = torch.tensor([prompt + response])
    logp = sequence_logprobs(model, ids, torch.ones_like(ids))  # (1, T-1)
    return logp[0, len(prompt) - 1:].tolist()


def rpc_error(call) -> grpc.RpcError:
    """Runs call(); returns the RpcError it raised (fails the test if it succeeded)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded but should have failed")


def push_checkpoint(address: str, checkpoint, version: int, bucket_mb: float = 1, chunk_buckets: int = 0) -> dict:
    """Pushes a checkpoint from a separate process (the pusher CLI, as a learner would push)."""
    proc = subprocess.run([sys.executable, "-m", "services.rollout.pusher", "--rollout_addresses", address,
                           "--checkpoint", str(checkpoint), "--version", str(version), "--backend", "gloo",
                           "--bucket_mb", str(bucket_mb), "--chunk_buckets", str(chunk_buckets), "--timeout_s", "60"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"push failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
