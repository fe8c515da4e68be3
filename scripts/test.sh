#!/usr/bin/env bash
# Runs the whole CPU test suite (tests/gpu skip themselves without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} TOKENIZERS_PARALLELISM=false
export RAY_USAGE_STATS_ENABLED=0 WANDB_MODE=offline HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest tests -q -rs --durations=25 "$@"
