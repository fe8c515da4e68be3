"""What the learner service tests share: starting the real service (N ranks) on loopback, batches of
random sequences, references computed with plain transformers, and a weight-push listener."""

from __future__ import annotations

import base64
import os
import pathlib
import queue
import signal
import subprocess
import sys
import time

import grpc
import torch
from safetensors.torch import load_file

from rlmesh.common.v1 import common_pb2
from rlmesh.learner.v1 import learner_pb2 as pb
from rlmesh.learner.v1 import learner_pb2_grpc as pbg
from rlmesh.rollout.v1 import rollout_pb2
from services.common.logprobs import sequence_logprobs
from services.common.ready_file import ServiceStartError, wait_for_ready_file
from services.common.tensors import ragged_from_proto, ragged_to_proto, to_proto
from services.learner.batches import Sample, forward_micro_batches
from tests.conftest import get_free_port

REPO = pathlib.Path(__file__).resolve().parents[2]


class LearnerProcess:
    """A service started as `python -m services.<name>` (the learner's rank 0 starts its other ranks);
    `stub` talks to the learner API."""

    def __init__(self, popen: subprocess.Popen, info: dict, log: pathlib.Path):
        self.popen, self.info, self.log = popen, info, log
        self.channel = grpc.insecure_channel(info["address"], options=[
            ("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)])
        self.stub = pbg.LearnerServiceStub(self.channel)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def worker_pids(self) -> list[int]:
        """Processes whose parent is rank 0 (the ranks it started)."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def stop(self) -> None:
        self.channel.close()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def _start_service(tmp: pathlib.Path, module: str, args: tuple[str, ...], timeout_s: float) -> LearnerProcess:
    ready = tmp / f"{module.rsplit('.', 1)[-1]}-{time.monotonic_ns()}.json"
    log = ready.with_suffix(".log")
    with log.open("w") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", "--grace_period_s", "5", "--ready_file", str(ready),
             *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        info = wait_for_ready_file(ready, popen, timeout_s, log_path=log, tail_lines=80)
    except ServiceStartError:
        popen.kill()
        popen.wait(10)
        raise
    return LearnerProcess(popen, info, log)


def start_learner(tmp: pathlib.Path, *args: str, timeout_s: float = 420.0) -> LearnerProcess:
    return _start_service(tmp, "services.learner", args, timeout_s)


def start_rollout(tmp: pathlib.Path, model_dir, timeout_s: float = 300.0) -> LearnerProcess:
    """The rollout service with its transformers engine (the learner tests only push weights into it)."""
    return _start_service(tmp, "services.rollout", ("--pretrain", str(model_dir), "--engine", "hf"), timeout_s)


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Waits until none of pids runs any more; returns those still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.2)
    return alive


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) does not count
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------
# Batches


def random_sequences(n: int, vocab: int, seed: int, min_len: int = 6, max_len: int = 20):
    """n random token sequences and response starts (prompts of 2-4 tokens)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, vocab, (int(torch.randint(min_len, max_len, (1,), generator=g)),), generator=g)
            for _ in range(n)]
    starts = torch.tensor([2 + i % 3 for i in range(n)])
    return seqs, starts


def response_lengths(seqs, starts) -> list[int]:
    return [len(s) - int(st) for s, st in zip(seqs, starts)]


def logprobs(stub, seqs, starts, temperature: float = 0.0, packed: bool = False) -> list[torch.Tensor]:
    r = stub.LogProbs(pb.LogProbsRequest(input_ids=ragged_to_proto(seqs), response_start=to_proto(starts),
                                         temperature=temperature, packed=packed), timeout=120)
    return ragged_from_proto(r.logprobs)


def experience(seqs, starts, **fields) -> pb.ExperienceBatch:
    """ExperienceBatch with per-response-token fields given as lists of 1-D tensors."""
    batch = pb.ExperienceBatch(input_ids=ragged_to_proto(seqs), response_start=to_proto(starts))
    for name, rows in fields.items():
        dtype = torch.uint8 if name == "action_mask" else torch.float32
        getattr(batch, name).CopyFrom(ragged_to_proto(rows, dtype=dtype))
    return batch


def signed_advantages(seqs, starts) -> list[torch.Tensor]:
    """+1 on every response token of odd samples, -1 on even ones."""
    return [torch.full((n,), 1.0 if i % 2 else -1.0) for i, n in enumerate(response_lengths(seqs, starts))]


# ----------------------------------------------------------------------------------------------
# References


def reference_logprobs(model, seqs, starts, world: int, micro: int, temperature: float = 1.0) -> list[torch.Tensor]:
    """What the learner must return: sequence_logprobs of a plain transformers model on the padded
    micro-batches the learner forms (forward_micro_batches: longest first, right-padded with 0)."""
    samples = [Sample(s, int(st), {}) for s, st in zip(seqs, starts)]
    out: list = [None] * len(seqs)
    with torch.no_grad():
        for batches in forward_micro_batches(samples, micro, world):
            for chunk in batches:
                T = max(len(seqs[i]) for i in chunk)
                ids = torch.zeros(len(chunk), T, dtype=torch.int64)
                mask = torch.zeros(len(chunk), T, dtype=torch.int64)
                for row, i in enumerate(chunk):
                    ids[row, :len(seqs[i])] = seqs[i]
                    mask[row, :len(seqs[i])] = 1
                lp = sequence_logprobs(model, ids.to(model.device), mask.to(model.device), temperature).cpu()
                for row, i in enumerate(chunk):
                    out[i] = lp[row, int(starts[i]) - 1:len(seqs[i]) - 1]
    return out


def export_weights(stub, folder: pathlib.Path) -> dict[str, torch.Tensor]:
    """ExportHF into folder; returns its tensors (name -> tensor)."""
    stub.ExportHF(pb.ExportHFRequest(output_dir=str(folder)), timeout=300)
    return load_file(str(folder / "model.safetensors"))


# ----------------------------------------------------------------------------------------------
# Weight push to a listener process


class WeightListener:
    """tests/learner/weight_listener.py as a process: one receiver rank of the weight group."""

    def __init__(self, tmp: pathlib.Path, world_size: int = 2, rank: int = 1, port: int | None = None,
                 ipc: bool = False, group_name: str = "rlmesh-weights"):
        self.port = port or get_free_port()
        self.group_name = group_name
        self.out = tmp / f"received-{time.monotonic_ns()}.pt"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.learner.weight_listener", "--port", str(self.port), "--world_size",
             str(world_size), "--rank", str(rank), "--out", str(self.out), "--group_name", group_name,
             *(["--ipc"] if ipc else [])],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def expect(self, prefix: str) -> str:
        line = self.proc.stdout.readline().strip()
        if not line.startswith(prefix):
            raise AssertionError(f"listener said {line!r}, expected {prefix}...")
        return line

    def receive(self, update: rollout_pb2.UpdateWeightsRequest) -> None:
        self.proc.stdin.write(base64.b64encode(update.SerializeToString()).decode() + "\n")
        self.proc.stdin.flush()
        self.expect(f"CHUNK {update.chunk_index}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def init_transfer(stub, listener: WeightListener, backend=rollout_pb2.WEIGHT_BACKEND_GLOO) -> None:
    stub.InitWeightTransfer(pb.InitWeightTransferRequest(
        backend=backend, master_address="127.0.0.1", master_port=listener.port, world_size=2, timeout_s=120,
        group_name=listener.group_name),
        timeout=180)
    listener.expect("JOINED")


def push_weights(stub, listener: WeightListener, version: int, dtype=common_pb2.DTYPE_FLOAT32,
                 bucket_bytes: int = 0, buckets_per_chunk: int = 0):
    """Runs a whole PushWeights conversation, forwarding each chunk to the listener as a
    coordinator forwards it to the engines. Returns (done message, chunks seen, listener checksum,
    received tensors)."""
    requests: queue.Queue = queue.Queue()
    requests.put(pb.PushWeightsRequest(start=pb.PushWeightsStart(
        version=version, weights_dtype=dtype, bucket_bytes=bucket_bytes, buckets_per_chunk=buckets_per_chunk)))

    def request_stream():
        while (item := requests.get()) is not None:
            yield item

    done, chunks = None, 0
    for response in stub.PushWeights(request_stream(), timeout=300):
        if response.HasField("chunk"):
            chunks += 1
            listener.receive(response.chunk.update)
            requests.put(pb.PushWeightsRequest(ack=pb.PushWeightsAck(chunk_index=response.chunk.update.chunk_index)))
        else:
            done = response.done
            requests.put(None)
    checksum = listener.expect("CHECKSUM").split()[1]
    listener.proc.wait(30)
    return done, chunks, checksum, torch.load(listener.out)
