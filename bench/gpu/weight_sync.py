"""Weight sync at hardware speed: rlmesh's pushes against the plain copy they ride on, in one run.

    python3 bench/gpu/weight_sync.py                      # 0.5B and 7B shapes (random, bf16)
    python3 bench/gpu/weight_sync.py --models 0.5b --repeats 5

For each model (a random Qwen2 with Qwen2.5-0.5B or Qwen2.5-7B shapes, bf16, written once):
  (a) the limit: a plain torch.distributed NCCL broadcast of the same bytes (in buckets of
      --bucket_mb) from GPU 0 to GPU 1, each process seeing one GPU as the services do; and a plain
      device-to-device copy of the same bytes on one GPU (the limit of a CUDA IPC push);
  (b) rlmesh over nccl into the vLLM rollout service on GPU 1, end to end: from the first message
      of the push to the engine's final UpdateWeights reply (the engine serves the new weights from
      then on), checksum verified against the sender's;
  (c) the same over CUDA IPC with the sender on GPU 1 beside the engine;
  (d) one broadcast per parameter (bucket_bytes = 1), plain and through rlmesh.
The 0.5B sender is the learner service (DeepSpeed ZeRO-2, PushWeights driven as the coordinator
drives it); the 7B sender is `services.rollout.pusher.WeightPusher` holding random weights on the
GPU (a 7B ZeRO-2 learner with its Adam states does not fit on a GPU beside a vLLM engine; the
pusher runs the same buckets, digests and engine side). Prints seconds, GB/s and (b)/(a).
Needs two GPUs for (a), (b), (d); on one GPU only the IPC rows run. Every push is checked: the
engine's checksum equals the sender's and GetModelInfo reports the pushed version, READY.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

from bench.shapes import QWEN25_05B, QWEN25_7B  # noqa: E402
# Child processes (services, senders) import this checkout and what PYTHONPATH already holds.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "protos"),
                                            *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

import torch  # noqa: E402

SHAPES = {"0.5b": QWEN25_05B, "7b": QWEN25_7B}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["0.5b", "7b"], choices=sorted(SHAPES))
    p.add_argument("--bucket_mb", type=int, default=1024, help="largest bucket, MiB (both the limit and rlmesh)")
    p.add_argument("--repeats", type=int, default=3, help="timed pushes after one warm-up; the median is shown")
    p.add_argument("--work_dir", default="", help="where the models are written (default: a temporary folder)")
    p.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--model_dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)
    p.add_argument("--address", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_env(gpu: int) -> dict:
    # Each process sees the one GPU it uses (as the services are placed); set before CUDA starts.
    return {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONUNBUFFERED": "1"}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# ----------------------------------------------------------------------------------------------
# The model and its tensors


def write_model(shape: str, folder: pathlib.Path) -> None:
    """A random bf16 Qwen2 with the given shapes, initialised on the GPU, with the tiny tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.common.tiny import build_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer().save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


def parameter_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of the checkpoint (what a push sends), from the file headers."""
    from safetensors import safe_open

    from services.rollout.engine import checkpoint_files

    shapes = {}
    for path in checkpoint_files(pathlib.Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def random_weights(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """New random bf16 weights on this process's GPU, one per checkpoint tensor."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {n: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
            for n, s in parameter_shapes(model_dir).items()}


def bucket_sizes(model_dir: str, bucket_bytes: int) -> list[int]:
    from services.common.weights import plan_buckets

    _, sizes = plan_buckets([(n, torch.bfloat16, s) for n, s in parameter_shapes(model_dir).items()], bucket_bytes)
    return sizes


# ----------------------------------------------------------------------------------------------
# (a) and (d): the limits, in child processes


def role_broadcast(args) -> None:
    """One rank of a plain NCCL broadcast between two processes; rank 0 prints the timings."""
    import datetime

    torch.cuda.set_device(0)
    store = torch.distributed.TCPStore("127.0.0.1", args.port, 2, is_master=args.rank == 0,
                                       timeout=datetime.timedelta(seconds=300))
    torch.distributed.init_process_group("nccl", store=store, rank=args.rank, world_size=2,
                                         device_id=torch.device("cuda", 0))
    per_param = [int(torch.Size(s).numel()) * 2 for s in parameter_shapes(args.model_dir).values()]
    buckets = bucket_sizes(args.model_dir, args.bucket_mb * 1024 * 1024)
    big = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in buckets]
    small = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in per_param]

    def timed(buffers) -> float:
        torch.distributed.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for b in buffers:
            torch.distributed.broadcast(b, 0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    results = {}
    for name, buffers in (("bucketed", big), ("per_parameter", small)):
        timed(buffers)  # warm-up
        results[name] = median([timed(buffers) for _ in range(max(3, args.repeats))])
    if args.rank == 0:
        print("RESULT " + json.dumps({**results, "bytes": sum(buckets)}), flush=True)
    torch.distributed.destroy_process_group()


def role_copy(args) -> None:
    """A plain device-to-device copy of the same buckets on one GPU."""
    buckets = bucket_sizes(args.model_dir, args.bucket_mb * 1024 * 1024)
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for n in buckets]
    dst = [torch.empty_like(t) for t in src]

    def timed() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for s, d in zip(src, dst):
            d.copy_(s)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def timed_sums() -> float:
        from services.common.weights import ParamSlot, bucket_sums

        # One slot per bucket: the per-byte cost of the push's checksum (each side pays it once).
        slots = [[ParamSlot("b", torch.uint8, (n,), 0, 0)] for n in buckets]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for d, members in zip(dst, slots):
            bucket_sums(d, members)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed()
    timed_sums()
    repeats = max(3, args.repeats)
    print("RESULT " + json.dumps({"copy": median([timed() for _ in range(repeats)]),
                                  "sums": median([timed_sums() for _ in range(repeats)]),
                                  "bytes": sum(buckets)}), flush=True)


def role_pusher(args) -> None:
    """services.rollout.pusher.WeightPusher with random weights on this GPU; prints every push."""
    import asyncio

    from services.rollout.pusher import WeightPusher

    async def run() -> dict:
        bucket_bytes = args.bucket_mb * 1024 * 1024 if args.bucket_mb > 0 else 1  # 0: one per parameter
        pusher = WeightPusher([args.address], backend=args.backend, bucket_bytes=bucket_bytes, timeout_s=600)
        try:
            await pusher.connect()
            seconds, consistent, versions = [], [], []
            base = int(pusher.infos[0].weight_version)
            for i in range(args.repeats + 1):
                tensors = random_weights(args.model_dir, seed=100 + i)
                torch.cuda.synchronize()
                result = await pusher.push(base + 1 + i, tensors.items())
                consistent.append(result.consistent)
                versions.append(result.version)
                if i:
                    seconds.append(result.seconds)
                del tensors
            return {"seconds": seconds, "consistent": all(consistent), "last_version": versions[-1],
                    "checksum": result.sent_checksum}
        finally:
            await pusher.close()

    print("RESULT " + json.dumps(asyncio.run(run())), flush=True)


def run_child(role: str, gpu: int, args, *extra: str, timeout_s: float = 1200) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--model_dir", args.model_dir, "--bucket_mb", str(args.bucket_mb),
           "--repeats", str(args.repeats), *extra]
    out = subprocess.run(cmd, env=gpu_env(gpu), capture_output=True, text=True, timeout=timeout_s)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{role} on GPU {gpu} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")


def plain_broadcast(args) -> dict:
    port = free_port()
    cmds = [[sys.executable, __file__, "--role", "broadcast", "--rank", str(r), "--port", str(port),
             "--model_dir", args.model_dir, "--bucket_mb", str(args.bucket_mb), "--repeats", str(args.repeats)]
            for r in (0, 1)]
    procs = [subprocess.Popen(c, env=gpu_env(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, c in enumerate(cmds)]
    outs = [p.communicate(timeout=900) for p in procs]
    for line in outs[0][0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"plain broadcast failed:\n{outs[0][1][-4000:]}\n{outs[1][1][-4000:]}")


# ----------------------------------------------------------------------------------------------
# (b), (c), (d) through the services


class Service:
    def __init__(self, tmp: pathlib.Path, module: str, args: list[str], gpus: str):
        import grpc

        self.ready = tmp / f"{module.rsplit('.', 1)[-1]}-{time.monotonic_ns()}.json"
        self.log = self.ready.with_suffix(".log")
        with self.log.open("w") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", module, "--host", "127.0.0.1", "--grace_period_s", "5",
                 "--ready_file", str(self.ready), *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "PYTHONUNBUFFERED": "1"})
        self._grpc = grpc
        self.address = ""

    def wait(self, timeout_s: float = 900):
        from services.common.ready_file import ServiceStartError, wait_for_ready_file

        try:
            info = wait_for_ready_file(self.ready, self.popen, timeout_s, log_path=self.log, poll_s=0.2,
                                       tail_lines=80)
        except ServiceStartError:
            self.stop()
            raise
        self.address = info["address"]
        self.channel = self._grpc.insecure_channel(self.address, options=[
            ("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)])
        return self

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def learner_push(learner_stub, engine, version: int, dtype, bucket_bytes: int) -> tuple[object, float, float]:
    """The coordinator's side of PushWeights: every chunk forwarded to the engine, then acked."""
    from rlmesh.learner.v1 import learner_pb2 as pb

    requests: queue.Queue = queue.Queue()
    requests.put(pb.PushWeightsRequest(start=pb.PushWeightsStart(
        version=version, weights_dtype=dtype, bucket_bytes=bucket_bytes)))
    start = time.perf_counter()
    done, last, engine_s = None, None, 0.0
    for response in learner_stub.PushWeights(iter(requests.get, None), timeout=900):
        if response.HasField("done"):
            done = response.done
            requests.put(None)
            continue
        update = response.chunk.update
        # nccl: the engine joins the broadcast the learner starts after yielding the chunk.
        last = engine.UpdateWeights(update, timeout=900)
        engine_s += last.duration_s
        requests.put(pb.PushWeightsRequest(ack=pb.PushWeightsAck(chunk_index=update.chunk_index)))
    seconds = time.perf_counter() - start
    if last.weights_checksum != done.weights_checksum or last.weight_version != version:
        raise AssertionError(f"engine reports version {last.weight_version} checksum {last.weights_checksum}; "
                             f"the learner pushed {version} {done.weights_checksum}")
    return done, seconds, engine_s


def check_engine(engine, version: int, checksum: str) -> None:
    from rlmesh.rollout.v1 import rollout_pb2

    info = engine.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=60)
    if (info.weight_version, info.weights_checksum, info.weights_state) != (version, checksum,
                                                                           rollout_pb2.WEIGHTS_STATE_READY):
        raise AssertionError(f"engine: version {info.weight_version} checksum {info.weights_checksum} state "
                             f"{info.weights_state}; expected {version} {checksum} READY")


def init_nccl(learner_stub, engine) -> None:
    from rlmesh.learner.v1 import learner_pb2 as pb
    from rlmesh.rollout.v1 import rollout_pb2

    port = free_port()
    errors = []

    def join_engine():
        try:
            engine.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(
                backend=rollout_pb2.WEIGHT_BACKEND_NCCL, master_address="127.0.0.1", master_port=port, world_size=2,
                rank_offset=1, timeout_s=300), timeout=400)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=join_engine)
    thread.start()
    learner_stub.InitWeightTransfer(pb.InitWeightTransferRequest(
        backend=rollout_pb2.WEIGHT_BACKEND_NCCL, master_address="127.0.0.1", master_port=port, world_size=2,
        timeout_s=300), timeout=400)
    thread.join(400)
    if errors:
        raise errors[0]


def init_ipc(learner_stub, engine) -> None:
    from rlmesh.learner.v1 import learner_pb2 as pb
    from rlmesh.rollout.v1 import rollout_pb2

    engine.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(backend=rollout_pb2.WEIGHT_BACKEND_IPC),
                              timeout=120)
    learner_stub.InitWeightTransfer(pb.InitWeightTransferRequest(backend=rollout_pb2.WEIGHT_BACKEND_IPC), timeout=120)


def timed_learner_pushes(learner_stub, engine, version: int, bucket_bytes: int, repeats: int) -> tuple[list, int, str]:
    from rlmesh.rollout.v1 import rollout_pb2

    info = engine.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=60)
    times, engine_times, learner_times = [], [], []
    for i in range(repeats + 1):
        done, seconds, engine_s = learner_push(learner_stub, engine, version + i, info.weights_dtype, bucket_bytes)
        check_engine(engine, version + i, done.weights_checksum)
        if i:
            times.append(seconds)
            engine_times.append(engine_s)
            learner_times.append(done.duration_s)
    # Where the time goes: the engine's UpdateWeights handling (receive, load, check) and the
    # learner's PushWeights (pack, send, check), each as the service measured it.
    print(f"    end to end {median(times):.4f} s; engine UpdateWeights {median(engine_times):.4f} s; learner "
          f"PushWeights {median(learner_times):.4f} s (medians)", flush=True)
    return times, version + repeats + 1, done.weights_checksum


def bench_model(shape: str, args, tmp: pathlib.Path, two_gpus: bool) -> list[tuple[str, float, int]]:
    from rlmesh.learner.v1 import learner_pb2_grpc
    from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc

    model_dir = tmp / shape
    started = time.perf_counter()
    write_model(shape, model_dir)
    args.model_dir = str(model_dir)
    total = sum(int(torch.Size(s).numel()) * 2 for s in parameter_shapes(args.model_dir).values())
    print(f"[{shape}] model written in {time.perf_counter() - started:.0f} s: {total / 1e9:.2f} GB of bf16 "
          "parameters", flush=True)
    rows: list[tuple[str, float, int]] = []
    engine_gpu = 1 if two_gpus else 0
    if two_gpus:
        plain = plain_broadcast(args)
        rows += [("(a) plain NCCL broadcast GPU0 -> GPU1, bucketed", plain["bucketed"], plain["bytes"]),
                 ("(d) plain NCCL broadcast, one per parameter", plain["per_parameter"], plain["bytes"])]
    copy = run_child("copy", engine_gpu, args)
    rows.append(("(a) plain device-to-device copy, one GPU", copy["copy"], copy["bytes"]))
    rows.append(("checksum sums of the same bytes, one GPU", copy["sums"], copy["bytes"]))
    for r in rows:
        print(f"[{shape}] {r[0]}: {r[1]:.4f} s", flush=True)

    bucket_bytes = args.bucket_mb * 1024 * 1024
    rollout = Service(tmp, "services.rollout", ["--pretrain", str(model_dir), "--gpu_memory_utilization", "0.3",
                                                "--enforce_eager", "--max_model_len", "2048"], str(engine_gpu))
    learner_args = ["--pretrain", str(model_dir), "--num_gpus", "1", "--bf16", "--zero_stage", "2",
                    "--train_batch_size", "8"]
    use_learner = shape == "0.5b"
    learners = {}
    if use_learner:
        if two_gpus:
            learners["nccl"] = Service(tmp, "services.learner", learner_args, "0")
        learners["ipc"] = Service(tmp, "services.learner", learner_args, str(engine_gpu))
    try:
        rollout.wait()
        for s in learners.values():
            s.wait()
        print(f"[{shape}] services up {time.perf_counter() - started:.0f} s after the start", flush=True)
        engine = rollout_pb2_grpc.RolloutServiceStub(rollout.channel)
        version = engine.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=60).weight_version + 1
        sender = "learner PushWeights" if use_learner else "WeightPusher"
        if use_learner and two_gpus:
            stub = learner_pb2_grpc.LearnerServiceStub(learners["nccl"].channel)
            init_nccl(stub, engine)
            times, version, checksum = timed_learner_pushes(stub, engine, version, bucket_bytes, args.repeats)
            rows.append((f"(b) rlmesh {sender} nccl -> vLLM on GPU1", median(times), total))
            times, version, _ = timed_learner_pushes(stub, engine, version, 1, args.repeats)
            rows.append((f"(d) rlmesh {sender} nccl, one bucket per parameter", median(times), total))
        if use_learner:
            stub = learner_pb2_grpc.LearnerServiceStub(learners["ipc"].channel)
            init_ipc(stub, engine)
            times, version, _ = timed_learner_pushes(stub, engine, version, bucket_bytes, args.repeats)
            rows.append((f"(c) rlmesh {sender} CUDA IPC, same GPU", median(times), total))
            for s in learners.values():  # frees the GPU memory before the pusher rows
                s.stop()
        if not use_learner:  # the WeightPusher rows
            if two_gpus:
                result = run_child("pusher", 0, args, "--backend", "nccl", "--address", rollout.address)
                assert result["consistent"], result
                check_engine(engine, result["last_version"], result["checksum"])
                rows.append(("(b) rlmesh WeightPusher nccl -> vLLM on GPU1", median(result["seconds"]), total))
                per_param = argparse.Namespace(**{**vars(args), "bucket_mb": 0})
                result = run_child("pusher", 0, per_param, "--backend", "nccl", "--address", rollout.address)
                assert result["consistent"], result
                rows.append(("(d) rlmesh WeightPusher nccl, one bucket per parameter", median(result["seconds"]),
                             total))
            result = run_child("pusher", engine_gpu, args, "--backend", "ipc", "--address", rollout.address)
            assert result["consistent"], result
            check_engine(engine, result["last_version"], result["checksum"])
            rows.append(("(c) rlmesh WeightPusher CUDA IPC, same GPU", median(result["seconds"]), total))
    finally:
        for s in learners.values():
            s.stop()
        rollout.stop()
    return rows


def print_table(shape: str, rows: list[tuple[str, float, int]]) -> None:
    print(f"\n{shape}: median of timed pushes (checksum verified on every push)")
    print(f"{'what':58s} {'seconds':>9s} {'GB/s':>8s}")
    for what, seconds, nbytes in rows:
        print(f"{what:58s} {seconds:9.4f} {nbytes / seconds / 1e9:8.1f}")
    by = {what: seconds for what, seconds, _ in rows}
    limit = by.get("(a) plain NCCL broadcast GPU0 -> GPU1, bucketed")
    copy = by.get("(a) plain device-to-device copy, one GPU")
    for what, seconds, _ in rows:
        if what.startswith("(b)") and limit:
            print(f"ratio (b)/(a) bandwidth, {what[4:]}: {limit / seconds:.2f}")
        if what.startswith("(c)") and copy:
            print(f"ratio (c)/(a) bandwidth, {what[4:]}: {copy / seconds:.3f}")
    sys.stdout.flush()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role == "broadcast":
        role_broadcast(args)
        return 0
    if args.role == "copy":
        role_copy(args)
        return 0
    if args.role == "pusher":
        role_pusher(args)
        return 0
    if not torch.cuda.is_available():
        print("bench/gpu/weight_sync.py needs a CUDA GPU; skipped")
        return 0
    two_gpus = torch.cuda.device_count() >= 2
    if not two_gpus:
        print("one GPU: only the CUDA IPC rows run ((a), (b), (d) need two GPUs)")
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"bucket {args.bucket_mb} MiB", flush=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir or None) as tmp_dir:
        for shape in args.models:
            rows = bench_model(shape, args, pathlib.Path(tmp_dir), two_gpus)
            print_table(shape, rows)
            for path in (pathlib.Path(tmp_dir) / shape).glob("*.safetensors"):
                path.unlink()  # the next model needs the disk
    return 0


if __name__ == "__main__":
    sys.exit(main())
