"""The learner's offload and reload (--deepspeed_enable_sleep) on one GPU: DeepSpeed's own
offload_states / reload_states against services/learner/host_offload.py, on the same engine, in one run.

    python bench/gpu/learner_offload.py                 # Qwen2.5-0.5B shapes, random, bf16, ZeRO-2, AdamW
    python bench/gpu/learner_offload.py --zero_stage 3 --cycles 5

A random Qwen2 with Qwen2.5-0.5B's shapes is loaded into a DeepSpeed engine (one process, nccl,
bf16, ZeRO-2 by default, torch's fused AdamW as the learner uses on CUDA) and takes one optimizer
step so every state exists. Then --cycles offload + reload cycles with DeepSpeed's calls, and as
many with host_offload's after them (not interleaved: buffers host_offload keeps would serve
DeepSpeed's next offload too); the first cycle of each is a warm-up, shown and not counted. After every
reload the checksums of the weights and of the optimizer's states must equal the ones before the
offload (the states back on the device), and an optimizer step runs after the cycles. Prints the
median seconds of each direction and the ratio ours / DeepSpeed.

Before the cycles, the copy rates this GPU reaches between device and pinned host memory (one
1 GiB tensor each way, median of 3) say what an offload could cost at best. After them, one more
offload of host_offload's is taken apart (--breakdown, on by default): DeepSpeed's part per kind
of state, the optimizer's states, and the time DeepSpeed spends in gc.collect and empty_cache,
each with the bytes it moved off the device.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import socket
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

import torch  # noqa: E402

from bench.gpu.timing import timed_into  # noqa: E402
from bench.shapes import QWEN25_05B  # noqa: E402
from services.learner import host_offload  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zero_stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--cycles", type=int, default=4, help="timed cycles per method (after one warm-up each)")
    p.add_argument("--no_breakdown", dest="breakdown", action="store_false",
                   help="skip the offload taken apart after the cycles")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def optimizer_checksum(engine) -> float:
    """Every tensor of the wrapped optimizer's state (Adam's moments), summed."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    with torch.no_grad():
        return float(sum(v.detach().double().sum() for s in inner.state.values() for v in s.values()
                         if torch.is_tensor(v)))


def checksum(model: torch.nn.Module) -> float:
    with torch.no_grad():
        # ZeRO-3 keeps each parameter's partition in ds_tensor (the parameter itself is empty).
        return float(sum(getattr(p, "ds_tensor", p).detach().float().sum() for p in model.parameters()))


def build_engine(zero_stage: int):
    import deepspeed
    from transformers import AutoModelForCausalLM, Qwen2Config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN25_05B), dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ids = torch.randint(0, QWEN25_05B["vocab_size"], (1, 256), device=engine.device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    torch.cuda.synchronize()
    return engine


def _timed(call) -> float:
    t0 = time.monotonic()
    call()
    torch.cuda.synchronize()
    return time.monotonic() - t0


# method -> (offload, reload), each returning its seconds
METHODS = {"deepspeed": (lambda engine: _timed(engine.offload_states), lambda engine: _timed(engine.reload_states)),
           "host_offload": (host_offload.offload_engine, host_offload.reload_engine)}


def copy_rates(gib: float = 1.0, repeats: int = 3) -> tuple[float, float]:
    """(device -> pinned host, pinned host -> device) GB/s for one tensor of `gib` GiB, median of `repeats`."""
    device = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    host = torch.empty(device.numel(), dtype=torch.uint8, pin_memory=True)
    rates = {"d2h": [], "h2d": []}
    for _ in range(repeats):
        rates["d2h"].append(device.numel() / 1e9 / _timed(lambda: host.copy_(device, non_blocking=True)))
        rates["h2d"].append(device.numel() / 1e9 / _timed(lambda: device.copy_(host, non_blocking=True)))
    return statistics.median(rates["d2h"]), statistics.median(rates["h2d"])


def offload_parts(engine) -> list[tuple[str, float, int]]:
    """host_offload's offload of a ZeRO-1/2 engine in its parts, a synchronize after each:
    [(part, seconds, bytes freed on the device)], DeepSpeed's gc.collect and empty_cache apart."""
    spent = {"gc.collect (in DeepSpeed)": 0.0, "empty_cache (in DeepSpeed)": 0.0}
    real = {"gc.collect (in DeepSpeed)": (gc, "collect", gc.collect),
            "empty_cache (in DeepSpeed)": (torch.cuda, "empty_cache", torch.cuda.empty_cache)}
    parts = []

    def part(name, call):
        before = torch.cuda.memory_allocated()
        seconds = _timed(call)
        parts.append((name, seconds, before - torch.cuda.memory_allocated()))

    for name, (owner, attr, fn) in real.items():
        setattr(owner, attr, timed_into(spent, name, fn))
    try:
        for state in host_offload._ZERO12_STATES:
            part(f"DeepSpeed {state.name}", lambda: engine.offload_states(include=(state,), pin_memory=True,
                                                                          non_blocking=True))
        part("optimizer states (host_offload)", lambda: host_offload._offload_optimizer_states(engine))
    finally:
        for owner, attr, fn in real.values():
            setattr(owner, attr, fn)
    parts += [(name, seconds, 0) for name, seconds in spent.items()]
    return parts


def cycle(engine, method: str) -> tuple[float, float, int]:
    """One offload + reload; (offload s, reload s, GPU bytes allocated while offloaded)."""
    before, moments = checksum(engine.module), optimizer_checksum(engine)
    offload, reload = METHODS[method]
    off = offload(engine)
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated()
    back = reload(engine)
    after = checksum(engine.module)
    if after != before:
        raise SystemExit(f"{method}: weights changed over an offload + reload ({before} -> {after})")
    if optimizer_checksum(engine) != moments:
        raise SystemExit(f"{method}: optimizer states changed over an offload + reload")
    if any(torch.is_tensor(v) and v.device.type == "cpu" and v.numel() > 1
           for s in getattr(engine.optimizer, "optimizer", engine.optimizer).state.values() for v in s.values()):
        raise SystemExit(f"{method}: optimizer states left in host memory after the reload")
    return off, back, resident


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    tempfile.tempdir = tempfile.mkdtemp(prefix="rlmesh-offload-")
    engine = build_engine(args.zero_stage)
    loaded = torch.cuda.memory_allocated()
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    print(f"ZeRO-{args.zero_stage}, {params / 1e6:.0f}M parameters, "
          f"{loaded / 2**30:.2f} GiB allocated with the optimizer states")
    d2h, h2d = copy_rates()
    print(f"copy rates with pinned host memory: device -> host {d2h:.1f} GB/s, host -> device {h2d:.1f} GB/s")
    times = {method: [] for method in METHODS}
    for method in times:
        for i in range(args.cycles + 1):
            off, back, resident = cycle(engine, method)
            tag = "warm-up" if i == 0 else f"cycle {i}"
            print(f"{method:12s} {tag:8s} offload {off:.3f} s  reload {back:.3f} s  "
                  f"allocated while offloaded {resident / 2**30:.2f} GiB")
            if i:
                times[method].append((off, back))
    med = {m: (statistics.median(o for o, _ in v), statistics.median(b for _, b in v)) for m, v in times.items()}
    for m, (o, b) in med.items():
        print(f"median {m:12s} offload {o:.3f} s  reload {b:.3f} s")
    (do, db), (ho, hb) = med["deepspeed"], med["host_offload"]
    print(f"ratio host_offload / deepspeed: offload {ho / do:.2f}x, reload {hb / db:.2f}x")
    if args.breakdown and args.zero_stage in (1, 2):
        parts = offload_parts(engine)
        print("one host_offload offload in parts (DeepSpeed's gc.collect and empty_cache are inside its parts):")
        for name, seconds, freed in parts:
            rate = f"  {freed / 1e9 / seconds:.1f} GB/s" if freed > 0 and seconds > 0 else ""
            print(f"  {name:34s} {seconds:.3f} s  {freed / 1e9:.2f} GB off the device{rate}")
        host_offload.reload_engine(engine)
    ids = torch.randint(0, QWEN25_05B["vocab_size"], (1, 256), device=engine.device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # the optimizer steps on the reloaded states
    torch.cuda.synchronize()
    print("an optimizer step after the cycles: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
