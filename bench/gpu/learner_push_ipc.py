"""PushWeights over CUDA IPC from the learner to the vLLM rollout service on the same GPU.

    python3 bench/gpu/learner_push_ipc.py                 # random Qwen2.5-0.5B shapes, bf16, 5 pushes
    python3 bench/gpu/learner_push_ipc.py --bucket_mb 256 --repeats 10

Starts a learner service (`--num_gpus 1 --bf16 --zero_stage 2`) and a rollout service (vLLM,
`--gpu_memory_utilization 0.3 --enforce_eager`) on one GPU with the same random model, then runs
the coordinator's side of a push: InitWeightTransfer(IPC) on both, and per push a PushWeights
conversation whose every chunk is forwarded to the engine's UpdateWeights. Checks that every push
ends with the engine reporting the learner's checksum, and prints seconds and GB/s per push
(parameter bytes / wall time from the first PushWeights message to the engine's final reply).
The first push is a warm-up (CUDA IPC mappings are opened once).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import queue
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]
# The services run as child processes (`python -m services.rollout`, ...): they need the same paths,
# in front of what PYTHONPATH holds already (vLLM, DeepSpeed and grpcio >= 1.85 on the GPU machine).
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "protos"),
                                            *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

import torch  # noqa: E402

from rlmesh.learner.v1 import learner_pb2 as pb  # noqa: E402
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from tests.learner.learner_helpers import _start_service, start_learner  # noqa: E402

from bench.gpu.learner_mfu import write_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bucket_mb", type=int, default=1024, help="PushWeightsStart.bucket_bytes, MiB")
    p.add_argument("--buckets_per_chunk", type=int, default=1, help="buckets per UpdateWeights call")
    p.add_argument("--repeats", type=int, default=5, help="timed pushes after one warm-up")
    return p.parse_args(argv)


def push(learner_stub, engine, version: int, dtype, bucket_bytes: int, per_chunk: int):
    requests: queue.Queue = queue.Queue()
    requests.put(pb.PushWeightsRequest(start=pb.PushWeightsStart(
        version=version, weights_dtype=dtype, bucket_bytes=bucket_bytes, buckets_per_chunk=per_chunk)))
    start = time.perf_counter()
    done, last = None, None
    for response in learner_stub.PushWeights(iter(requests.get, None), timeout=600):
        if response.HasField("done"):
            done = response.done
            requests.put(None)
            continue
        update = response.chunk.update
        last = engine.UpdateWeights(update, timeout=600)
        requests.put(pb.PushWeightsRequest(ack=pb.PushWeightsAck(chunk_index=update.chunk_index)))
    seconds = time.perf_counter() - start
    if last.weights_checksum != done.weights_checksum:
        raise AssertionError(f"engine checksum {last.weights_checksum} != learner's {done.weights_checksum}")
    return done, seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu/learner_push_ipc.py needs a CUDA GPU; skipped")
        return 0
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = pathlib.Path(tmp_dir)
        _, total = write_model(tmp / "model")
        from services.common.tiny import build_tokenizer

        build_tokenizer().save_pretrained(tmp / "model")  # vLLM loads a tokenizer from the folder
        rollout = _start_service(tmp, "services.rollout", (
            "--pretrain", str(tmp / "model"), "--gpu_memory_utilization", "0.3", "--enforce_eager",
            "--max_model_len", "2048"), 900)
        learner = start_learner(tmp, "--pretrain", str(tmp / "model"), "--num_gpus", "1", "--bf16",
                                "--zero_stage", "2", "--train_batch_size", "8", timeout_s=900)
        try:
            engine = rollout_pb2_grpc.RolloutServiceStub(rollout.channel)
            info = engine.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=60)
            engine.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(
                backend=rollout_pb2.WEIGHT_BACKEND_IPC), timeout=120)
            learner.stub.InitWeightTransfer(pb.InitWeightTransferRequest(
                backend=rollout_pb2.WEIGHT_BACKEND_IPC), timeout=120)
            bucket_bytes = args.bucket_mb * 1024 * 1024
            times = []
            for i in range(args.repeats + 1):
                done, seconds = push(learner.stub, engine, info.weight_version + 1 + i, info.weights_dtype,
                                     bucket_bytes, args.buckets_per_chunk)
                if i:
                    times.append(seconds)
            median = statistics.median(times)
            print(f"PushWeights over CUDA IPC to vLLM on {torch.cuda.get_device_name()}: {total / 1e6:.0f}M params, "
                  f"{done.bytes / 1e9:.2f} GB in {done.num_buckets} bucket(s) of <= {args.bucket_mb} MiB, "
                  f"{args.buckets_per_chunk} per chunk")
            print(f"median of {len(times)}: {median:.3f} s, {done.bytes / median / 1e9:.2f} GB/s "
                  f"(min {min(times):.3f} s, max {max(times):.3f} s); checksum equal on every push: "
                  f"{done.weights_checksum}")
        finally:
            learner.stop()
            rollout.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
