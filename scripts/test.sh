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
# The tests run in a shuffled order (pytest-randomly). -q hides the plugin's header, so the seed is
# drawn and printed here: `scripts/test.sh ... -p randomly --randomly-seed=N` replays an order.
order=()
case " $* " in
  *" --randomly-seed"*|*"no:randomly"*) ;;
  *) seed=$(( (RANDOM << 15) | RANDOM )); order=(-p randomly "--randomly-seed=$seed")
     echo "Using --randomly-seed=$seed" ;;
esac
# Tests marked `slow` (learning-quality runs of several minutes each: async GRPO against synchronous
# accuracy, the agent's multi-turn success rising) run with RLMESH_TEST_SLOW=1 (`make test-all`), or
# when the arguments choose markers themselves (-m).
select=(-m "not slow")
case " $* " in *" -m "*) select=() ;; esac
[ "${RLMESH_TEST_SLOW:-0}" = 1 ] && select=()
# Two pytest-xdist workers (RLMESH_TEST_WORKERS=N for N, 0 for one process); the tests of a module,
# and of modules that share a session's services or Ray, stay on one worker (tests/conftest.py:
# group_for_workers).
workers=(-n "${RLMESH_TEST_WORKERS:-2}" --dist loadgroup)
if [ "${RLMESH_TEST_WORKERS:-2}" = 0 ]; then
  workers=(-p no:xdist)
else
  # One compute thread per process: the workers' services share the machine's cores, and torch's
  # default (a thread per core in every process) has them spinning against each other.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
# The repository's modules compiled once, cached in __pycache__ (git-ignored): every service process
# the tests start reads the cache instead of compiling what it imports again, also where
# the environment sets PYTHONDONTWRITEBYTECODE.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m compileall -q services protos tests > /dev/null
exec .venv/bin/python -m pytest "${targets[@]}" -q -rs --durations=25 "${workers[@]}" ${select[@]+"${select[@]}"} ${order[@]+"${order[@]}"} "$@"
