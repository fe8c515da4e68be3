#!/usr/bin/env bash
# Prepares TRL, OpenRLHF, veRL and what they import that the GPU machine lacks, as pieces the device tool
# can carry, for bench/gpu/vs_peers.py. Run it here, in the project root, AFTER
# `bash ../shared/gpu/stage-vllm.sh --with-ray` (which empties .gpu/):
#
#   bash bench/gpu/stage_peers.sh
#
# Writes .gpu/peers-N/ (git-ignored) and .gpu/proj.tar (this checkout's HEAD: the run uses committed
# code only), then prints the device calls: the vLLM pieces, these pieces, and a last call that
# installs everything and starts the benchmark detached (logs in /tmp/logs on the GPU machine).
# Everything goes to /tmp/peers-site there, which vs_peers.py puts in front of PYTHONPATH for the
# TRL, OpenRLHF and veRL runs only, so the rlmesh run sees the machine's own packages.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
ls .gpu/part-0/stage.sh > /dev/null || { echo "run ../shared/gpu/stage-vllm.sh --with-ray first"; exit 1; }
rm -rf .gpu/peers-* .gpu/peer-wheels .gpu/proj.tar && mkdir -p .gpu/peer-wheels .gpu/peers-run
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform any)
# TRL 1.16.0 + datasets + multiprocess were seen working there with vLLM 0.26, torch 2.11 and
# transformers 5.17. OpenRLHF's wheel is pure Python (tagged cp312); it pins vllm 0.29,
# transformers 5.15, deepspeed 0.19.6, ray 2.55 and flash-attn: installed without its pins.
# datasets 5.2 wants pyarrow >= 24: pyarrow and pandas are carried and installed only when the
# machine's own are missing or older.
# veRL 0.9.1 pins transformers <5.11 and (its [vllm] extra) vllm 0.24: installed without its pins, like
# OpenRLHF, on the machine's transformers 5.17 and vLLM 0.26. Its default v1 trainer imports transferqueue,
# which needs tensordict >= 0.10 while veRL wants <= 0.10: 0.10.0, whose compiled part (tensordict/_C, key
# helpers in pybind11) links no torch symbols, so the cp312 wheel runs on torch 2.11. hydra-core 1.3.8 wants
# omegaconf < 2.4 and antlr4 4.9.*. wandb and tensorboard are imported only for those loggers (not used);
# pybind11, listed by veRL, is not imported. einops, cloudpickle and psutil come with the machine's vLLM.
# jmespath: vLLM's OpenAI server, which veRL's rollout starts, imports it (its model_hosting_container_standards).
python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu/peer-wheels \
  trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 xxhash==4.1.0 openrlhf==0.11.2 torchdata==0.11.0 \
  pyarrow==24.0.0 pandas==3.0.0 \
  verl==0.9.1 transferqueue==0.1.11 tensordict==0.10.0 pyvers==0.1.0 orjson==3.11.4 hydra-core==1.3.8 \
  omegaconf==2.3.0 codetiming==1.4.0 jmespath==1.1.0
# published as source archives only
python3 -m pip wheel -q --no-deps -w .gpu/peer-wheels pylatexenc==2.11 antlr4-python3-runtime==4.9.3
tar -cf .gpu/peers.tar -C .gpu peer-wheels
sum=$(sha256sum .gpu/peers.tar | cut -c1-64)
split -b 40m -d .gpu/peers.tar .gpu/peers.part.
rm -rf .gpu/peer-wheels .gpu/peers.tar
git archive --format=tar -o .gpu/proj.tar HEAD
parts=(.gpu/peers.part.*)
n=${#parts[@]}
i=0
for p in "${parts[@]}"; do
  d=.gpu/peers-$i; mkdir -p "$d"; mv "$p" "$d/peers.part"
  printf '#!/usr/bin/env bash\nset -eu\nmkdir -p /tmp/peers-stage && cp "$(dirname "$0")/peers.part" /tmp/peers-stage/peers.part.%02d\necho "peers piece %d of %d staged"\n' "$i" "$i" "$n" > "$d/stage.sh"
  i=$((i+1))
done
cat > .gpu/peers-run/install.sh <<EOF
#!/usr/bin/env bash
# Installs the staged peers' wheels into /tmp/peers-site (after the vLLM bundle's own install).
set -eu
have=\$(ls /tmp/peers-stage | wc -l)
if [ "\$have" -ne $n ]; then echo "only \$have of $n peers pieces on this machine: stage them all again"; exit 1; fi
cat /tmp/peers-stage/peers.part.* > /tmp/peers-stage/peers.tar
echo "$sum  /tmp/peers-stage/peers.tar" | sha256sum -c --quiet
mkdir -p /tmp/peer-wheels && tar -xf /tmp/peers-stage/peers.tar -C /tmp/peer-wheels
w=/tmp/peer-wheels/peer-wheels
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peers-site \\
  \$(ls \$w/*.whl | grep -v -e pyarrow- -e pandas-)
PYTHONPATH=/tmp/site python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null \\
  || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peers-site \$w/pyarrow-*.whl \$w/pandas-*.whl
PYTHONPATH=/tmp/peers-site:/tmp/site python3 -c "import trl, datasets, pyarrow; print('trl', trl.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)"
# veRL gets a site of its own without TRL (vs_peers.py VERL_SITE says why).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/verl-site \
  \$(ls \$w/*.whl | grep -v -e pyarrow- -e pandas- -e trl- -e openrlhf-)
PYTHONPATH=/tmp/site python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null \
  || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/verl-site \$w/pyarrow-*.whl \$w/pandas-*.whl
PYTHONPATH=/tmp/verl-site:/tmp/site python3 -c "import verl, tensordict, transfer_queue, hydra; print('verl', verl.__version__, 'tensordict', tensordict.__version__)"
EOF
# The benchmark's runner: a copy of HEAD in /tmp/proj, then vs_peers.py; logs and results (small)
# in /tmp/logs, models and checkpoints in /tmp/vs_peers_scratch.
cat > .gpu/peers-run/runner.sh <<'EOF'
#!/usr/bin/env bash
. /tmp/gpu-env.sh
mkdir -p /tmp/proj /tmp/logs && tar -xf /tmp/proj.tar -C /tmp/proj && cd /tmp/proj
nvidia-smi > /tmp/logs/nvidia-smi.txt 2>&1
# --budget_s: what a 30-minute device session leaves after staging, polls and a margin.
python3 bench/gpu/vs_peers.py --out /tmp/logs/vs_peers --scratch /tmp/vs_peers_scratch --budget_s 1300 "$@" \
  > /tmp/logs/vs_peers.out 2>&1
echo "runner done rc=$?" >> /tmp/logs/vs_peers.out
EOF
chmod +x .gpu/peers-*/*.sh
vparts=$(ls -d .gpu/part-* | wc -l)
last=.gpu/part-$((vparts-1))
echo "Device calls, back to back (each within 30 s of the last):"
for ((k=0; k<vparts-1; k++)); do echo "  run(carry=[\".gpu/part-$k\"], command=\"bash .gpu/part-$k/stage.sh\")"; done
for ((k=0; k<n; k++)); do echo "  run(carry=[\".gpu/peers-$k\"], command=\"bash .gpu/peers-$k/stage.sh\")"; done
echo "  run(carry=[\"$last\", \".gpu/peers-run\", \".gpu/proj.tar\"], command=\"cp .gpu/proj.tar .gpu/peers-run/runner.sh /tmp/ && bash $last/stage.sh && bash .gpu/peers-run/install.sh && (setsid nohup bash /tmp/runner.sh > /tmp/runner.log 2>&1 &); sleep 5; cat /tmp/runner.log\")"
echo "then, back to back until it ends (each returns when the runner is done or after ~550 s):"
echo "  run(command=\"for i in \$(seq 110); do grep -qs 'runner done' /tmp/logs/vs_peers.out && break; sleep 5; done; tail -5 /tmp/logs/vs_peers.out; cp -r /tmp/logs \$OUT/\", timeout_s=580)"
