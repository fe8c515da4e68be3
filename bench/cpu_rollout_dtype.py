"""Which dtype and which vLLM mode should a rollout engine on a CPU use? The rollout service started
once per configuration (float32 / bfloat16, eager / compiled), each alone on the machine; prints its
start time (process start to ready) and its decode rate, against float32 eager measured in the same run.

    python bench/cpu_rollout_dtype.py                          # the tiny model, fp32 vs bf16, eager
    python bench/cpu_rollout_dtype.py --model_shape small --compiled
    python bench/cpu_rollout_dtype.py --pretrain DIR --onednn_max_isa AVX2

The service's `--dtype auto` and unset `--enforce_eager` on a CPU come from what this measures
(services/rollout/cpu_defaults.py). --onednn_max_isa AVX2 sets ONEDNN_MAX_CPU_ISA for the services,
so oneDNN (vLLM's CPU matmuls, and torch's) uses no AVX-512 / AMX instructions: a stand-in for a
CPU without bf16 units, on a machine that has them (vLLM's own attention kernels keep theirs).
The prints start with the machine's bf16 flags, since the answer depends on them.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

from bench import rollout_overhead  # noqa: E402 - the rollout service driven over gRPC, the model builder


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrain", default="", help="model folder; empty = build one of --model_shape in a temp dir")
    p.add_argument("--model_shape", default="tiny", choices=["tiny", "small"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--compiled", action="store_true", help="also each dtype with vLLM's compilation (--no-enforce_eager)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=2, help="samples per prompt (prompts x n decode at once)")
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--max_tokens", type=int, default=128, help="tokens decoded per sample (EOS ignored)")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per start")
    p.add_argument("--rounds", type=int, default=2,
                   help="starts of each configuration, interleaved; the best of each is printed (a shared "
                        "machine's other work only ever slows a start down)")
    p.add_argument("--onednn_max_isa", default="", help="ONEDNN_MAX_CPU_ISA for the services, e.g. AVX2")
    return p.parse_args(argv)


def measure(args, pretrain: str, dtype: str, eager: bool, work: pathlib.Path) -> dict:
    """Start seconds and decode tokens/s of one rollout service with this dtype and mode."""
    service_args = rollout_overhead.parse_args([
        "--pretrain", pretrain, "--dtype", dtype, "--prompts", str(args.prompts), "--n", str(args.n),
        "--prompt_len", str(args.prompt_len), "--max_tokens", str(args.max_tokens),
        "--enforce_eager" if eager else "--no-enforce_eager", "--sides", "service"])
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    service = rollout_overhead.Service(service_args, work)
    start_s = time.perf_counter() - t0
    try:
        service.batch()  # warm-up: first-touch allocations, any compilation of a new shape
        tokens = seconds = 0.0
        for _ in range(args.repeats):
            n, s = service.batch()
            tokens, seconds = tokens + n, seconds + s
    finally:
        service.close()
    return {"start_s": start_s, "tokens_per_s": tokens / seconds}


def main(argv=None) -> int:
    args = parse_args(argv)
    from services.rollout.cpu_defaults import BF16_CPU_FLAGS, read_cpu_flags

    flags = read_cpu_flags()
    print(f"CPU bf16 flags: {[f for f in BF16_CPU_FLAGS if f in flags] or 'none'}; cores: {os.cpu_count()}; "
          f"ONEDNN_MAX_CPU_ISA={args.onednn_max_isa or 'unset'}")
    if args.onednn_max_isa:
        os.environ["ONEDNN_MAX_CPU_ISA"] = args.onednn_max_isa  # inherited by the services
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        pretrain = args.pretrain or str(rollout_overhead.build_model(args.model_shape, tmp / "model"))
        configs = [(d, True) for d in args.dtypes] + ([(d, False) for d in args.dtypes] if args.compiled else [])
        results: dict[str, dict] = {}
        for round_index in range(args.rounds):
            for dtype, eager in configs:
                name = f"{dtype} {'eager' if eager else 'compiled'}"
                r = measure(args, pretrain, dtype, eager, tmp / f"{name.replace(' ', '_')}_{round_index}")
                print(f"  round {round_index + 1} {name}: start {r['start_s']:.1f} s, {r['tokens_per_s']:.0f} tokens/s",
                      flush=True)
                best = results.setdefault(name, r)
                best["start_s"] = min(best["start_s"], r["start_s"])
                best["tokens_per_s"] = max(best["tokens_per_s"], r["tokens_per_s"])
    base = results.get("float32 eager") or next(iter(results.values()))
    print(f"\nbest of {args.rounds} starts each\n{'configuration':20s} {'start s':>8s} {'tokens/s':>9s} "
          f"{'x fp32 eager':>13s}")
    for name, r in results.items():
        print(f"{name:20s} {r['start_s']:8.1f} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / base['tokens_per_s']:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
