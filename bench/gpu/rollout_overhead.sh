#!/usr/bin/env bash
# Rollout service vs in-process vLLM on one GPU: random Qwen2 with Qwen2.5-0.5B shapes, bf16, CUDA
# graphs on. Prints tokens/s both ways, GPU busy and the ratio (target >= 0.9). Skips without a GPU.
#   . /tmp/gpu-env.sh; bash bench/gpu/rollout_overhead.sh [extra bench/rollout_overhead.py options]
#     128 prompts of 128 tokens x n=2 = 256 concurrent samples of 256 tokens, vocabulary 151,936
#   bash bench/gpu/rollout_overhead.sh --as_run [options]
#     what a GRPO step of bench/gpu/vs_peers.py job A asks of the engine: its model (the project's
#     660-token tokenizer), 64 prompts x n=8 = 512 samples of 512 tokens, a seed per sample, text
#     decoded, max_num_seqs 512, max_num_batched_tokens 4096
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "skipped: no CUDA GPU"; exit 0
fi
# Absolute paths in front of what PYTHONPATH holds already (vLLM and grpcio >= 1.85 on the GPU machine).
export PYTHONPATH="$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--as_run" ]; then
  shift
  model=${RLMESH_BENCH_MODEL:-/tmp/rlmesh-bench-qwen05-tinyvocab}
  if [ ! -f "$model/config.json" ]; then
    "$py" -c "
import sys, torch
from transformers import AutoModelForCausalLM
from services.common.tiny import make_tiny_model
make_tiny_model(sys.argv[1], size='qwen2.5-0.5b', seed=0)
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).save_pretrained(sys.argv[1])" "$model"
  fi
  exec "$py" bench/rollout_overhead.py --pretrain "$model" --dtype bfloat16 --gpu_memory_utilization 0.4 \
    --max_model_len 1024 --max_num_seqs 512 --max_num_batched_tokens 4096 --no-enforce_eager --prompts 64 --n 8 \
    --prompt_len 40 --max_tokens 512 --repeats 3 --seeded --return_text "$@"
fi
# One engine runs at a time (40% of the GPU is plenty for this model). Both get the same step
# budget: left alone, LLM takes 16384 tokens per step on this GPU and an AsyncLLM engine 2048.
exec "$py" bench/rollout_overhead.py --model_shape qwen2.5-0.5b --dtype bfloat16 --gpu_memory_utilization 0.4 \
  --max_model_len 1024 --max_num_seqs 256 --max_num_batched_tokens 16384 --no-enforce_eager --prompts 128 --n 2 \
  --prompt_len 128 --max_tokens 256 --repeats 3 "$@"
