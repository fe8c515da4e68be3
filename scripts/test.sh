#!/usr/bin/env bash
# Runs the CPU test suite (tests/gpu skip themselves without a GPU). With no paths among the
# arguments it runs every test under tests/; `scripts/test.sh tests/reward -x` runs only those.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} TOKENIZERS_PARALLELISM=false
export RAY_USAGE_STATS_ENABLED=0 WANDB_MODE=offline HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
targets=(tests)
for arg in "$@"; do
  case "$arg" in
    tests/*|./tests/*) targets=(); break ;;
  esac
done
exec .venv/bin/python -m pytest "${targets[@]}" -q -rs --durations=25 "$@"
