#!/usr/bin/env bash
# The CPU compose stack end to end, as a new user would run it, with checks and timings:
#   a Docker engine (started if none runs), the images, `up`, the run to its end, the saved model,
#   Prometheus holding rlmesh_ series from every service (the coordinator's last step included),
#   `down`.
#
#   bash deploy/smoke.sh                         # one rollout engine
#   SMOKE_ROLLOUTS=2 bash deploy/smoke.sh        # `--scale rollout=2`: checks both engines generated
#
# Where no image registry is reachable it makes what it cannot pull: a Debian base from
# debootstrap (with this machine's CA bundle, for HTTPS-intercepting proxies), Prometheus from
# Debian's package (deploy/prometheus/Dockerfile); Grafana has no such fallback and is left out
# then. Where PyTorch's CPU wheel index is not reachable, the torch wheel is taken from this
# machine's pip find-links folder into deploy/wheels/.
# Environment: RLMESH_BASE_IMAGE, RLMESH_IMAGE, PROMETHEUS_IMAGE, GRAFANA_IMAGE, PROMETHEUS_PORT,
# SMOKE_ROLLOUTS (1), SMOKE_TIMEOUT_S (1800), SMOKE_KEEP=1 (no `down` at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export RLMESH_IMAGE=${RLMESH_IMAGE:-rlmesh:cpu}
export RLMESH_BASE_IMAGE=${RLMESH_BASE_IMAGE:-python:3.11-slim-bookworm}
export PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-prom/prometheus:v3.5.0}
export GRAFANA_IMAGE=${GRAFANA_IMAGE:-grafana/grafana:12.2.0}
export PROMETHEUS_PORT=${PROMETHEUS_PORT:-9090}
export RLMESH_MODEL_DIR=$ROOT/runs/smoke/model RLMESH_DATA_DIR=$ROOT/runs/smoke/data
ROLLOUTS=${SMOKE_ROLLOUTS:-1}
TIMEOUT_S=${SMOKE_TIMEOUT_S:-1800}
PROJECT=rlmesh-smoke
declare -a TIMINGS=()
T0=$(date +%s)
log() { echo "[smoke $(date +%H:%M:%S)] $*"; }
fail() { echo "[smoke] FAILED: $*" >&2; exit 1; }
timed() {  # timed LABEL command...: runs it and records its seconds
  local label=$1 start=$(date +%s); shift
  "$@"
  TIMINGS+=("$label: $(( $(date +%s) - start )) s")
}
have_image() { docker image inspect "$1" >/dev/null 2>&1; }
obtain_image() { have_image "$1" || docker pull "$1" >/dev/null 2>&1; }

# ---- a Docker engine -------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || fail "no Docker engine runs and dockerd is not installed (Debian: apt-get install docker.io)"
  log "starting a Docker engine (log: /tmp/rlmesh-smoke-dockerd.log)"
  dockerd >/tmp/rlmesh-smoke-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || fail "the Docker engine did not start; see /tmp/rlmesh-smoke-dockerd.log"
fi
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
command -v "${COMPOSE[0]}" >/dev/null || fail "neither 'docker compose' nor docker-compose is installed"
DC=("${COMPOSE[@]}" -p "$PROJECT" -f deploy/docker-compose.yml)

# ---- base images ------------------------------------------------------------------------------
if ! obtain_image "$RLMESH_BASE_IMAGE"; then
  command -v debootstrap >/dev/null || fail "cannot pull $RLMESH_BASE_IMAGE and debootstrap is not installed to make a base"
  mirror=$(grep -rhoE 'https?://[^ ]+/debian/?' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | head -1)
  log "cannot pull $RLMESH_BASE_IMAGE: building base:local with debootstrap from ${mirror:=http://deb.debian.org/debian}"
  rootfs=$(mktemp -d)
  timed "base image (debootstrap)" debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
  # This machine's CA bundle, beside (not instead of) the image's own: apt's ca-certificates
  # rewrites /etc/ssl/certs later.
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/host-ca.crt"
  tar -C "$rootfs" -c . | docker import --change 'ENV PIP_CERT=/etc/ssl/host-ca.crt SSL_CERT_FILE=/etc/ssl/host-ca.crt REQUESTS_CA_BUNDLE=/etc/ssl/host-ca.crt' - base:local >/dev/null
  rm -rf "$rootfs"
  export RLMESH_BASE_IMAGE=base:local
fi

# ---- torch's CPU wheel when its index is out of reach ------------------------------------------
if ! ls deploy/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 && \
   ! curl -fsS --max-time 15 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
  links="${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true)"
  wheel=$(for d in $links; do ls "$d"/torch-2.13.0+cpu-*.whl 2>/dev/null; done | head -1)
  [ -n "$wheel" ] || fail "PyTorch's CPU wheel index is not reachable and no torch-2.13.0+cpu wheel is in pip's find-links; put one in deploy/wheels/"
  log "PyTorch's CPU wheel index is not reachable: using $wheel"
  cp "$wheel" deploy/wheels/
fi

# ---- images -------------------------------------------------------------------------------------
mkdir -p runs/smoke
log "building $RLMESH_IMAGE on $RLMESH_BASE_IMAGE"
timed "build rlmesh image" docker build -q -f deploy/Dockerfile --build-arg BASE="$RLMESH_BASE_IMAGE" -t "$RLMESH_IMAGE" . \
  >runs/smoke/build.log 2>&1 || { tail -30 runs/smoke/build.log; fail "the image build failed (runs/smoke/build.log)"; }
if ! obtain_image "$PROMETHEUS_IMAGE"; then
  log "cannot pull $PROMETHEUS_IMAGE: building Prometheus from Debian's package"
  export PROMETHEUS_IMAGE=rlmesh-prometheus:debian
  timed "build prometheus image" docker build -q -f deploy/prometheus/Dockerfile --build-arg BASE="$RLMESH_BASE_IMAGE" \
    -t "$PROMETHEUS_IMAGE" deploy/prometheus >>runs/smoke/build.log 2>&1 || fail "the Prometheus build failed (runs/smoke/build.log)"
fi
SERVICES=(rollout reward learner coordinator prometheus)
if obtain_image "$GRAFANA_IMAGE"; then SERVICES+=(grafana); else log "cannot pull $GRAFANA_IMAGE: Grafana left out of this run"; fi
echo "image sizes:"
for image in "$RLMESH_IMAGE" "$PROMETHEUS_IMAGE" "$GRAFANA_IMAGE"; do
  have_image "$image" && printf '  %-32s %s MB\n' "$image" $(( $(docker image inspect -f '{{.Size}}' "$image") / 1000000 ))
done

# ---- model and data, made by the image itself ------------------------------------------------------
if [ ! -f "$RLMESH_MODEL_DIR/config.json" ] || [ ! -f "$RLMESH_DATA_DIR/arith_train.jsonl" ]; then
  timed "make-tiny-model + make-data" docker run --rm --user "$(id -u):$(id -g)" -e HOME=/tmp -v "$ROOT/runs/smoke:/out" \
    "$RLMESH_IMAGE" make-tiny-model /out/model >runs/smoke/make.log 2>&1
  docker run --rm --user "$(id -u):$(id -g)" -e HOME=/tmp -v "$ROOT/runs/smoke:/out" "$RLMESH_IMAGE" make-data /out/data \
    >>runs/smoke/make.log 2>&1
fi

# ---- up, the run, checks --------------------------------------------------------------------------
"${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
cleanup() {
  if [ "${SMOKE_KEEP:-0}" != 1 ]; then
    log "down"; "${DC[@]}" logs --no-color > runs/smoke/compose.log 2>&1 || true
    "${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
log "up: ${SERVICES[*]} (rollout x $ROLLOUTS)"
up_start=$(date +%s)
"${DC[@]}" up -d --no-build --scale rollout="$ROLLOUTS" "${SERVICES[@]}" 2>&1 | grep -v "^$" || fail "compose up failed"
coordinator=$("${DC[@]}" ps -q coordinator)
[ -n "$coordinator" ] || fail "no coordinator container"
log "waiting for the run to end (at most $TIMEOUT_S s)"
code=$(timeout "$TIMEOUT_S" docker wait "$coordinator") || fail "the run did not end within $TIMEOUT_S s"
TIMINGS+=("up -> run finished (services start, train, save): $(( $(date +%s) - up_start )) s")
"${DC[@]}" logs --no-color coordinator > runs/smoke/coordinator.log 2>&1 || true
[ "$code" = 0 ] || { tail -40 runs/smoke/coordinator.log; fail "the coordinator exited with $code"; }
grep -q '"run.done"\|run.done' runs/smoke/coordinator.log || fail "the coordinator log has no run.done"
log "coordinator exited 0: $(grep -o 'run.done.*' runs/smoke/coordinator.log | head -1 | cut -c1-120)"
runs_volume=$(docker inspect -f '{{range .Mounts}}{{if eq .Destination "/runs"}}{{.Name}}{{end}}{{end}}' "$coordinator")
docker run --rm -v "$runs_volume:/runs" --entrypoint sh "$RLMESH_IMAGE" -c \
  'ls /runs/model/config.json /runs/model/*.safetensors && ls -d /runs/ckpt/global_step_*' \
  || fail "no saved model under /runs/model in the runs volume"

log "querying Prometheus on 127.0.0.1:$PROMETHEUS_PORT"
python3 - "$PROMETHEUS_PORT" "$ROLLOUTS" <<'PY' || fail "Prometheus does not hold what it should"
import json, sys, urllib.parse, urllib.request
port, rollouts = sys.argv[1], int(sys.argv[2])
def query(q):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    return json.load(urllib.request.urlopen(url, timeout=10))["data"]["result"]
# Over the last hour: the coordinator has exited, so its series are no longer current.
series = {r["metric"]["job"]: int(r["value"][1])
          for r in query('count by (job) (last_over_time({__name__=~"rlmesh_.+"}[1h]))')}
print("  rlmesh_ series per job:", series)
missing = {"rollout", "reward", "learner", "coordinator"} - set(series)
assert not missing, f"no rlmesh_ series from {sorted(missing)}"
step = query("max(max_over_time(rlmesh_coordinator_global_step[1h]))")
print("  last global step scraped from the coordinator:", step[0]["value"][1] if step else None)
engines = {r["metric"]["instance"]: float(r["value"][1])
           for r in query("max by (instance) (max_over_time(rlmesh_rollout_generated_tokens_total[1h]))")}
print("  tokens generated per engine:", engines)
assert len([v for v in engines.values() if v > 0]) >= rollouts, f"expected {rollouts} engines generating, got {engines}"
PY
steps=$(awk '/^max_steps:/ {print $2}' deploy/config/grpo.yaml)
python3 - "$PROMETHEUS_PORT" "$steps" <<'PY' || fail "the coordinator's last step was not scraped before it exited"
import json, sys, urllib.parse, urllib.request
port, steps = sys.argv[1], int(sys.argv[2])
q = urllib.parse.urlencode({"query": "max(max_over_time(rlmesh_coordinator_global_step[1h]))"})
value = float(json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{q}", timeout=10))["data"]["result"][0]["value"][1])
assert value == steps, f"Prometheus last saw global step {value}, the run did {steps}"
PY
TIMINGS+=("total: $(( $(date +%s) - T0 )) s")
log "OK"
echo "timings:"
printf '  %s\n' "${TIMINGS[@]}"
