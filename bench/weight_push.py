"""Bucketed weight push vs one broadcast per parameter, over gloo on this machine.

    python bench/weight_push.py                       # tiny model and a ~100M-parameter model, bf16
    python bench/weight_push.py --models 100m --receivers 2 --bucket_mb 64 --repeats 5

The sender (this process, rank 0 of the weight group, as the learner's rank 0 is) pushes a random
Qwen2 model's parameters, cast to --dtype, to --receivers receiver processes, two ways, in turns:
  per_param: what the most used open RLHF framework does: for every parameter, its metadata
             (name, dtype, shape) and then its tensor, each in a broadcast of its own (that framework
             sends the metadata by an RPC per parameter, which costs more than the small broadcast
             used here, so the baseline is if anything flattered);
  bucketed:  the learner's own code path (services/learner/weight_push.py: plan_chunks +
             WeightSender.send_chunk over services/common/weights.py): the layout travels once,
             buckets of up to --bucket_mb are packed, broadcast and digested for the weights
             checksum, overlapping; the receivers take them with receive_buckets, as an engine does.
Both receivers copy every tensor into a model-sized set of tensors (an engine loads them). Each
timed push ends at a barrier every receiver reaches after loading its last tensor. Prints median
seconds, MB/s of parameter bytes and the speed-up of bucketed over per_param.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

import torch  # noqa: E402

from services.common import weights  # noqa: E402
from services.learner.weight_push import WeightSender, plan_chunks  # noqa: E402

# Random Qwen2 shapes. "100m": 12 layers of width 768 and a 32k vocabulary, untied: ~125M parameters.
SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=660),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HEADER_BYTES = 512  # one parameter's metadata as JSON, zero-padded


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=["tiny", "100m"], choices=sorted(SHAPES), help="model shapes")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="wire dtype (the engines' dtype)")
    p.add_argument("--bucket_mb", type=int, default=1024, help="largest bucket, MiB (the service's --weight_bucket_mb)")
    p.add_argument("--receivers", type=int, default=1, help="receiver processes (engine workers)")
    p.add_argument("--repeats", type=int, default=5, help="timed pushes per method (after one warm-up each)")
    p.add_argument("--role", default="send", choices=["send", "receive"], help=argparse.SUPPRESS)
    p.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_model(shape: str, materialize: bool) -> torch.nn.Module:
    """A random Qwen2 model (on "meta" when not materialized: names and shapes only)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu" if materialize else "meta"):
        return Qwen2ForCausalLM(config)


def runs(repeats: int) -> list[str]:
    """The order of pushes: a warm-up of each, then the two methods taking turns."""
    return ["per_param", "bucketed"] + ["per_param", "bucketed"] * repeats


# ----------------------------------------------------------------------------------------------
# Receiver


def receive(args) -> None:
    dtype = DTYPES[args.dtype]
    meta = build_model(args.model, materialize=False)
    loaded = {n: torch.empty(p.shape, dtype=dtype) for n, p in meta.named_parameters()}
    chunks = plan_chunks(meta, dtype, args.bucket_mb * 1024 * 1024, 0)
    group = weights.open_weight_group("gloo", "127.0.0.1", args.port, args.receivers + 1, args.rank, timeout_s=600)
    header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    for method in runs(args.repeats):
        if method == "per_param":
            for _ in range(len(loaded)):
                group.broadcast_from_learner(header)
                info = json.loads(bytes(header.numpy()).rstrip(b"\0"))
                buffer = torch.empty(info["shape"], dtype=DTYPES[info["dtype"]])
                group.broadcast_from_learner(buffer)
                loaded[info["name"]].copy_(buffer)
        else:
            for chunk in chunks:
                for buffer, members in weights.receive_buckets(group, chunk.slots, chunk.bucket_sizes):
                    for name, tensor in weights.unpack_bucket(buffer, members):
                        loaded[name].copy_(tensor)
        group.process_group.barrier().wait()


# ----------------------------------------------------------------------------------------------
# Sender


def send_per_param(group, model: torch.nn.Module, dtype: torch.dtype) -> None:
    for name, p in model.named_parameters():
        text = json.dumps({"name": name, "dtype": str(dtype).removeprefix("torch."), "shape": list(p.shape)})
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[:len(text)] = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
        group.broadcast_from_learner(header)
        group.broadcast_from_learner(p.detach().to(dtype).contiguous())


def bench_model(args, shape: str) -> dict:
    dtype = DTYPES[args.dtype]
    model = build_model(shape, materialize=True)
    chunks = plan_chunks(model, dtype, args.bucket_mb * 1024 * 1024, 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--role", "receive", "--model", shape, "--port", str(port),
                               "--rank", str(r), "--receivers", str(args.receivers), "--dtype", args.dtype,
                               "--bucket_mb", str(args.bucket_mb), "--repeats", str(args.repeats)])
             for r in range(1, args.receivers + 1)]
    sender = WeightSender(rank=0, device=torch.device("cpu"))
    try:
        sender.backend = "gloo"
        sender.group = weights.open_weight_group("gloo", "127.0.0.1", port, args.receivers + 1, 0, timeout_s=600)
        times: dict[str, list[float]] = {"per_param": [], "bucketed": []}
        for i, method in enumerate(runs(args.repeats)):
            start = time.perf_counter()
            if method == "per_param":
                send_per_param(sender.group, model, dtype)
            else:
                for chunk in chunks:
                    sender.send_chunk(model, False, chunk)
            sender.group.process_group.barrier().wait()
            if i >= 2:  # the first push of each method is the warm-up
                times[method].append(time.perf_counter() - start)
    finally:
        for proc in procs:
            proc.wait(300)
    nbytes = sum(s.nbytes for c in chunks for s in c.slots)
    return {"model": shape, "params": sum(p.numel() for p in model.parameters()),
            "tensors": len(list(model.parameters())), "buckets": sum(len(c.bucket_sizes) for c in chunks),
            "mb": nbytes / 1e6, **{m: statistics.median(ts) for m, ts in times.items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role == "receive":
        receive(args)
        return 0
    print(f"weight push over gloo (loopback), wire dtype {args.dtype}, buckets <= {args.bucket_mb} MiB, "
          f"{args.receivers} receiver(s), median of {args.repeats} pushes, {torch.get_num_threads()} threads "
          f"({datetime.datetime.now().isoformat(timespec='seconds')})")
    header = (f"{'model':>6} {'params':>12} {'tensors':>8} {'buckets':>8} {'MB':>8} "
              f"{'per_param s':>12} {'MB/s':>8} {'bucketed s':>11} {'MB/s':>8} {'speed-up':>9}")
    print(header)
    print("-" * len(header))
    for shape in args.models:
        r = bench_model(args, shape)
        print(f"{r['model']:>6} {r['params']:>12,} {r['tensors']:>8} {r['buckets']:>8} {r['mb']:>8.1f} "
              f"{r['per_param']:>12.4f} {r['mb'] / r['per_param']:>8.1f} {r['bucketed']:>11.4f} "
              f"{r['mb'] / r['bucketed']:>8.1f} {r['per_param'] / r['bucketed']:>8.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
