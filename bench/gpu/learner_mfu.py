"""Learner training throughput and model FLOPs utilisation on one GPU, through the real service.

    python bench/gpu/learner_mfu.py                                  # Qwen2.5-0.5B shapes, random, bf16, ZeRO-2
    python bench/gpu/learner_mfu.py --variants plain fast --batch 16 --seq_len 2048 --calls 4
    python bench/gpu/learner_mfu.py --variants fast lora         # LoRA against full fine-tuning

A random Qwen2 with Qwen2.5-0.5B's shapes (494M parameters, 151,936-token vocabulary) is written
to a temp folder; for each variant a learner service is started on the GPU (`python -m
services.learner --num_gpus 1 --bf16 --zero_stage 2 ...`) and sent TrainActor calls of --batch
random sequences (lengths uniform in [seq_len/2, seq_len], one prompt token, the rest response),
one optimizer step per call, after one warm-up call. Variants:
  plain: padded micro-batches of --plain_micro samples, full logits + log-softmax, sdpa attention;
  fast:  the same samples packed into one row per micro-batch of --fast_micro samples, varlen
         FlashAttention (PyTorch's), the fused log-prob head (--logprobs_head fused: no float32
         logits, no recomputation), and liger-kernel's RMSNorm / SwiGLU / RoPE when installed;
  lora:  fast, training LoRA adapters only (--lora_rank 16 --lora_alpha 32, every linear module):
         the base weights take no gradients and no optimizer states.
For each variant the GPU's memory in use (nvidia-smi, sampled every 0.1 s) is reported at its
peak over the timed calls. MFU counts the full model's FLOPs for every variant (LoRA still runs
the whole forward and the activations' backward; its skipped weight gradients are not credited).
Both use torch's fused AdamW (the learner's default on CUDA). The learner processes run with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (unless set already): a packed micro-batch of 64
samples (~100k tokens) needs most of the GPU and fits only without the caching allocator's
fragmentation.
MFU = model FLOPs per second / --peak_tflops (H200 bf16 dense: 989). Model FLOPs per token:
6 x (parameters of every matmul, the output projection included) + 6 x layers x hidden x sequence
length (causal attention, forward and backward); the recomputation of checkpointing is not counted.
Prints tokens/s and MFU per variant and the ratio fast / plain (target MFU >= 0.40).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

from bench.shapes import QWEN25_05B  # noqa: E402

import torch  # noqa: E402

from rlmesh.learner.v1 import learner_pb2 as pb  # noqa: E402
from tests.learner.learner_helpers import experience, logprobs, start_learner  # noqa: E402



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="*", default=["plain", "fast"], choices=["plain", "fast", "lora"])
    p.add_argument("--batch", type=int, default=128, help="samples per TrainActor call = train_batch_size (OpenRLHF's default)")
    p.add_argument("--seq_len", type=int, default=2048, help="longest sequence, tokens")
    p.add_argument("--plain_micro", type=int, default=4, help="plain: samples per micro-batch")
    p.add_argument("--fast_micro", type=int, default=64, help="fast: samples per (packed) micro-batch")
    p.add_argument("--calls", type=int, default=4, help="timed TrainActor calls per variant")
    p.add_argument("--peak_tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, TFLOP/s")
    p.add_argument("--gradient_checkpointing", action="store_true", help="also recompute activations")
    return p.parse_args(argv)


def write_model(folder: pathlib.Path) -> tuple[int, int]:
    """Random Qwen2.5-0.5B-shaped model in bf16; returns (matmul parameters, all parameters)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_05B, dtype="bfloat16")
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    total = sum(p.numel() for p in model.parameters())
    # Every weight of a matmul: all 2-D weights except the embedding lookup, plus the output
    # projection (with tied embeddings it is the embedding matrix, used once more as a matmul).
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    matmul += model.lm_head.weight.numel() if config.tie_word_embeddings else 0
    del model
    torch.cuda.empty_cache()
    return matmul, total


def make_batch(batch: int, seq_len: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch,), generator=g)
    seqs = [torch.randint(0, vocab, (int(n),), generator=g) for n in lengths]
    return seqs, torch.ones(batch, dtype=torch.int64)


def variant_args(name: str, args) -> list[str]:
    common = ["--num_gpus", "1", "--bf16", "--zero_stage", "2", "--train_batch_size", str(args.batch),
              "--actor_learning_rate", "1e-6", "--lr_warmup_ratio", "0", "--micro_forward_batch_size", "8",
              "--max_len", str(args.seq_len + 1)]
    if args.gradient_checkpointing:
        common.append("--gradient_checkpointing")
    if name == "plain":
        return common + ["--micro_train_batch_size", str(args.plain_micro), "--attn_implementation", "sdpa"]
    liger = ["--use_liger_kernel"] if importlib.util.find_spec("liger_kernel") else []
    lora = ["--lora_rank", "16", "--lora_alpha", "32", "--target_modules", "all-linear"] if name == "lora" else []
    return common + ["--micro_train_batch_size", str(args.fast_micro), "--packing_samples",
                     "--attn_implementation", "varlen", "--logprobs_head", "fused", *liger, *lora]


class MemorySampler:
    """The GPU's memory in use (MiB, nvidia-smi) every 0.1 s on a thread; `peak` over the samples."""

    def __init__(self):
        gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        self.cmd = ["nvidia-smi", "-i", gpu, "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            out = subprocess.run(self.cmd, capture_output=True, text=True).stdout.strip()
            if out:
                self.peak = max(self.peak, int(out.splitlines()[0]))
            self._stop.wait(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_variant(name: str, args, model_dir: pathlib.Path, tmp: pathlib.Path, flops_per_token) -> dict:
    learner = start_learner(tmp, "--pretrain", str(model_dir), *variant_args(name, args), timeout_s=900)
    try:
        seqs, starts = make_batch(args.batch, args.seq_len, QWEN25_05B["vocab_size"], seed=0)
        old = logprobs(learner.stub, seqs, starts)
        adv = [torch.randn(len(o), generator=torch.Generator().manual_seed(i)) for i, o in enumerate(old)]
        request = pb.TrainActorRequest(batch=experience(seqs, starts, old_logprobs=old, advantages=adv))
        learner.stub.TrainActor(request, timeout=900)  # warm-up
        tokens = sum(len(s) for s in seqs)
        with MemorySampler() as memory:
            start = time.perf_counter()
            for _ in range(args.calls):
                r = learner.stub.TrainActor(request, timeout=900)
                assert r.optimizer_steps == 1, r
            seconds = (time.perf_counter() - start) / args.calls
    finally:
        learner.stop()
    flops = sum(flops_per_token(len(s)) * len(s) for s in seqs)
    return {"variant": name, "tokens_per_s": tokens / seconds, "mfu": flops / seconds / (args.peak_tflops * 1e12),
            "seconds": seconds, "peak_mib": memory.peak}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # for the learner processes
    if not torch.cuda.is_available():
        print("bench/gpu/learner_mfu.py needs a CUDA GPU; skipped")
        return 0
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = pathlib.Path(tmp_dir)
        matmul, total = write_model(tmp / "model")
        L, H = QWEN25_05B["num_hidden_layers"], QWEN25_05B["hidden_size"]

        def flops_per_token(seq_len: int) -> float:
            return 6 * matmul + 6 * L * H * seq_len

        print(f"learner MFU on {torch.cuda.get_device_name()}: random Qwen2.5-0.5B shapes ({total / 1e6:.0f}M "
              f"params, {matmul / 1e6:.0f}M in matmuls), bf16, ZeRO-2, {args.batch} samples of "
              f"{args.seq_len // 2}-{args.seq_len} tokens per step, peak {args.peak_tflops:.0f} TFLOP/s")
        print(f"liger-kernel {'installed' if importlib.util.find_spec('liger_kernel') else 'not installed'}; "
              f"PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}")
        print(f"{'variant':>8} {'s/step':>8} {'tokens/s':>10} {'MFU':>6} {'GPU MiB':>8}")
        results = {}
        for name in args.variants:
            r = run_variant(name, args, tmp / "model", tmp, flops_per_token)
            results[name] = r
            print(f"{name:>8} {r['seconds']:>8.3f} {r['tokens_per_s']:>10.0f} {r['mfu']:>6.3f} {r['peak_mib']:>8}",
                  flush=True)
        if {"plain", "fast"} <= results.keys():
            print(f"fast / plain: {results['fast']['tokens_per_s'] / results['plain']['tokens_per_s']:.2f}x "
                  f"(target MFU >= 0.40)")
        if {"fast", "lora"} <= results.keys():
            print(f"lora / fast: step time {results['lora']['seconds'] / results['fast']['seconds']:.2f}x, "
                  f"peak GPU memory {results['lora']['peak_mib'] / results['fast']['peak_mib']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
