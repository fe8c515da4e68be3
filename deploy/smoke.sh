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
# debootstrap (from the Debian mirror in this machine's apt sources, with this machine's CA
# bundle, for HTTPS-intercepting proxies), Prometheus from Debian's package
# (deploy/prometheus/Dockerfile); Grafana has no such fallback and is left out then. Where
# PyTorch's CPU wheel index is not reachable, the torch wheel is taken from this machine's pip
# find-links folders into deploy/wheels/. The services get a fresh shared token (RLMESH_AUTH_TOKEN)
# unless one is set.
# Environment: RLMESH_BASE_IMAGE, RLMESH_IMAGE, PROMETHEUS_IMAGE, GRAFANA_IMAGE, PROMETHEUS_PORT,
# RLMESH_AUTH_TOKEN, SMOKE_ROLLOUTS (1), SMOKE_TIMEOUT_S (1800), SMOKE_KEEP=1 (no `down` at the end).
#
# Every failure says where: the step, the command, its status and the end of its output (an ERR
# trap). Sourced (`source deploy/smoke.sh`), it only defines its functions; tests/deploy runs the
# ones that need no Docker engine.

SMOKE_STEP="start"
SMOKE_STEP_LOG=/dev/null
SMOKE_FAILED=0
SMOKE_CLEANUP=""
SMOKE_CONSOLE=2  # where failures are reported: install_traps keeps the console's stderr here

log() { echo "[smoke $(date +%H:%M:%S)] $*"; }

# step NAME [LOG]: the step every later failure is reported in; commands that would print a lot
# send their output to LOG (made empty here), and a failure shows its last lines.
step() {
  SMOKE_STEP=$1 SMOKE_STEP_LOG=${2:-/dev/null}
  [ "$SMOKE_STEP_LOG" = /dev/null ] || : >"$SMOKE_STEP_LOG"
  log "$SMOKE_STEP"
}

show_step_log() {
  if [ "$SMOKE_STEP_LOG" != /dev/null ] && [ -s "$SMOKE_STEP_LOG" ]; then
    echo "[smoke] last lines of $SMOKE_STEP_LOG:" >&"$SMOKE_CONSOLE"
    tail -30 "$SMOKE_STEP_LOG" >&"$SMOKE_CONSOLE"
  fi
}

fail() {
  SMOKE_FAILED=1
  echo "[smoke] FAILED in step '$SMOKE_STEP': $*" >&"$SMOKE_CONSOLE"
  show_step_log
  exit 1
}

on_error() {  # the ERR trap: any command that fails outside a condition ends the run here, loudly
  local status=$1 line=$2 command=$3
  # Reported already (the `exit` below, run from timed rather than as the trap, fires it again).
  [ "$SMOKE_FAILED" = 0 ] || exit "$status"
  SMOKE_FAILED=1
  echo "[smoke] FAILED in step '$SMOKE_STEP' (deploy/smoke.sh line $line): \`$command\` exited with status $status" >&"$SMOKE_CONSOLE"
  show_step_log
  exit "$status"
}

on_exit() {  # also reports exits the ERR trap does not see (e.g. an unset variable under set -u)
  local status=$?
  if [ "$status" != 0 ] && [ "$SMOKE_FAILED" = 0 ]; then
    echo "[smoke] FAILED in step '$SMOKE_STEP': exited with status $status" >&"$SMOKE_CONSOLE"
    show_step_log
  fi
  [ -z "$SMOKE_CLEANUP" ] || $SMOKE_CLEANUP
  return "$status"
}

install_traps() {
  set -eEuo pipefail  # -E: the ERR trap also fires inside functions
  # The console's stderr, kept: a step that sends a command's output to its log (e.g.
  # `timed ... >>"$SMOKE_STEP_LOG" 2>&1`) would otherwise bury its failure in that log.
  exec {SMOKE_CONSOLE}>&2
  trap 'on_error $? $LINENO "$BASH_COMMAND"' ERR
  trap on_exit EXIT
}

# debian_mirror [APT_DIR]: the first Debian archive URI in APT_DIR's sources (default /etc/apt):
# sources.list, sources.list.d/*.list (one-line `deb [options] URI suite ...`) and
# sources.list.d/*.sources (deb822 `URIs:` of stanzas not `Enabled: no`), comments ignored; the
# security archive (…/debian-security) is not a mirror of the packages. Prints deb.debian.org's
# address when none is found.
debian_mirror() {
  local apt=${1:-/etc/apt}
  local uri
  while read -r uri; do
    if [[ $uri =~ ^https?://.+/debian/?$ ]]; then echo "$uri"; return 0; fi
  done < <(apt_source_uris "$apt")
  echo "http://deb.debian.org/debian"
}

# apt_source_uris APT_DIR: the archive URIs of every enabled apt source, in apt's order.
apt_source_uris() {
  local apt=$1 file
  for file in "$apt/sources.list" "$apt"/sources.list.d/*.list; do
    [ -f "$file" ] || continue
    awk '{ sub(/#.*/, "") }
         $1 == "deb" || $1 == "deb-src" {
           for (i = 2; i <= NF; i++) {
             if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; continue }  # [options]
             print $i; break } }' "$file"
  done
  for file in "$apt"/sources.list.d/*.sources; do
    [ -f "$file" ] || continue
    # deb822: one stanza per paragraph; its URIs count unless it says Enabled: no.
    awk 'function flush() { if (enabled) printf "%s", uris; uris = ""; enabled = 1 }
         BEGIN { enabled = 1 }
         /^[ \t]*#/ { next }
         /^[ \t]*$/ { flush(); next }
         tolower($1) == "enabled:" && tolower($2) == "no" { enabled = 0 }
         tolower($1) == "uris:" { for (i = 2; i <= NF; i++) uris = uris $i "\n" }
         END { flush() }' "$file"
  done
}

# find_wheel PATTERN FOLDER...: the first file matching PATTERN in the folders (a folder may be
# named more than once, e.g. by PIP_FIND_LINKS and pip's configuration); status 1 when none.
find_wheel() {
  local pattern=$1 folder file
  shift
  for folder in "$@"; do
    for file in "$folder"/$pattern; do
      if [ -f "$file" ]; then echo "$file"; return 0; fi
    done
  done
  return 1
}

# pip_find_links: the find-links folders pip uses here (env PIP_FIND_LINKS, then its config).
pip_find_links() {
  echo "${PIP_FIND_LINKS:-}"
  { python3 -m pip config get global.find-links || python3 -m pip config get :env:.find-links; } 2>/dev/null || true
}

# make_base_image IMAGE: a Debian bookworm base from debootstrap, with this machine's CA bundle.
make_base_image() {
  local image=$1 mirror rootfs
  command -v debootstrap >/dev/null || fail "cannot pull $RLMESH_BASE_IMAGE and debootstrap is not installed to make a base (apt-get install debootstrap)"
  mirror=$(debian_mirror)
  step "base image: debootstrap from $mirror (cannot pull $RLMESH_BASE_IMAGE)" runs/smoke/debootstrap.log
  rootfs=$(mktemp -d)
  timed "base image (debootstrap)" debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >>"$SMOKE_STEP_LOG" 2>&1
  # This machine's CA bundle, beside (not instead of) the image's own: apt's ca-certificates
  # rewrites /etc/ssl/certs later. A minbase root has no /etc/ssl yet.
  mkdir -p "$rootfs/etc/ssl"
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/host-ca.crt"
  tar -C "$rootfs" -c . | docker import --change 'ENV PIP_CERT=/etc/ssl/host-ca.crt SSL_CERT_FILE=/etc/ssl/host-ca.crt REQUESTS_CA_BUNDLE=/etc/ssl/host-ca.crt' - "$image" >/dev/null
  rm -rf "$rootfs"
}

timed() {  # timed LABEL command...: runs it and records its seconds
  local label=$1 start
  start=$(date +%s)
  shift
  "$@" || on_error $? "$LINENO" "$*"
  TIMINGS+=("$label: $(( $(date +%s) - start )) s")
}
have_image() { docker image inspect "$1" >/dev/null 2>&1; }
obtain_image() { have_image "$1" || docker pull "$1" >/dev/null 2>&1; }
new_token() { python3 -c 'import secrets; print(secrets.token_hex(32))'; }

main() {
  install_traps
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  ROOT=$PWD
  export RLMESH_IMAGE=${RLMESH_IMAGE:-rlmesh:cpu}
  export RLMESH_BASE_IMAGE=${RLMESH_BASE_IMAGE:-python:3.11-slim-bookworm}
  export PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-prom/prometheus:v3.5.0}
  export GRAFANA_IMAGE=${GRAFANA_IMAGE:-grafana/grafana:12.2.0}
  export PROMETHEUS_PORT=${PROMETHEUS_PORT:-9090}
  export RLMESH_MODEL_DIR=$ROOT/runs/smoke/model RLMESH_DATA_DIR=$ROOT/runs/smoke/data
  # The services refuse 0.0.0.0 without a token: a fresh one for this run unless one is given.
  export RLMESH_AUTH_TOKEN=${RLMESH_AUTH_TOKEN:-$(new_token)}
  ROLLOUTS=${SMOKE_ROLLOUTS:-1}
  TIMEOUT_S=${SMOKE_TIMEOUT_S:-1800}
  PROJECT=rlmesh-smoke
  TIMINGS=()
  T0=$(date +%s)
  mkdir -p runs/smoke

  # ---- a Docker engine -----------------------------------------------------------------------
  step "a Docker engine"
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

  # ---- base images --------------------------------------------------------------------------
  step "base image $RLMESH_BASE_IMAGE"
  if ! obtain_image "$RLMESH_BASE_IMAGE"; then
    make_base_image base:local
    export RLMESH_BASE_IMAGE=base:local
  fi

  # ---- torch's CPU wheel when its index is out of reach ---------------------------------------
  step "torch's CPU wheel"
  if ! find_wheel 'torch-2.13.0+cpu-*.whl' deploy/wheels >/dev/null && \
     ! curl -fsS --max-time 15 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
    # shellcheck disable=SC2046 # the folders are words
    wheel=$(find_wheel 'torch-2.13.0+cpu-*.whl' $(pip_find_links)) \
      || fail "PyTorch's CPU wheel index is not reachable and no torch-2.13.0+cpu wheel is in pip's find-links; put one in deploy/wheels/"
    log "PyTorch's CPU wheel index is not reachable: using $wheel"
    cp "$wheel" deploy/wheels/
  fi

  # ---- images ---------------------------------------------------------------------------------
  step "build $RLMESH_IMAGE on $RLMESH_BASE_IMAGE" runs/smoke/build.log
  timed "build rlmesh image" docker build -q -f deploy/Dockerfile --build-arg BASE="$RLMESH_BASE_IMAGE" \
    -t "$RLMESH_IMAGE" . >>"$SMOKE_STEP_LOG" 2>&1
  step "Prometheus image $PROMETHEUS_IMAGE" runs/smoke/build-prometheus.log
  if ! obtain_image "$PROMETHEUS_IMAGE"; then
    log "cannot pull $PROMETHEUS_IMAGE: building Prometheus from Debian's package"
    export PROMETHEUS_IMAGE=rlmesh-prometheus:debian
    timed "build prometheus image" docker build -q -f deploy/prometheus/Dockerfile --build-arg BASE="$RLMESH_BASE_IMAGE" \
      -t "$PROMETHEUS_IMAGE" deploy/prometheus >>"$SMOKE_STEP_LOG" 2>&1
  fi
  SERVICES=(rollout reward learner coordinator prometheus)
  if obtain_image "$GRAFANA_IMAGE"; then SERVICES+=(grafana); else log "cannot pull $GRAFANA_IMAGE: Grafana left out of this run"; fi
  echo "image sizes:"
  for image in "$RLMESH_IMAGE" "$PROMETHEUS_IMAGE" "$GRAFANA_IMAGE"; do
    if have_image "$image"; then
      printf '  %-32s %s MB\n' "$image" $(( $(docker image inspect -f '{{.Size}}' "$image") / 1000000 ))
    fi
  done
  builders=$(docker image ls -q --filter label=rlmesh.stage=builder | sort -u | wc -l)
  [ "$builders" = 0 ] || log "the build keeps $builders builder-stage image(s) as its cache; to remove them: docker image prune -f --filter label=rlmesh.stage=builder"

  # ---- model and data, made by the image itself --------------------------------------------------
  if [ ! -f "$RLMESH_MODEL_DIR/config.json" ] || [ ! -f "$RLMESH_DATA_DIR/arith_train.jsonl" ]; then
    step "make-tiny-model + make-data" runs/smoke/make.log
    timed "make-tiny-model + make-data" docker run --rm --user "$(id -u):$(id -g)" -e HOME=/tmp -v "$ROOT/runs/smoke:/out" \
      "$RLMESH_IMAGE" make-tiny-model /out/model >>"$SMOKE_STEP_LOG" 2>&1
    docker run --rm --user "$(id -u):$(id -g)" -e HOME=/tmp -v "$ROOT/runs/smoke:/out" "$RLMESH_IMAGE" make-data /out/data \
      >>"$SMOKE_STEP_LOG" 2>&1
  fi

  # ---- up, the run, checks ----------------------------------------------------------------------
  step "compose up" runs/smoke/up.log
  "${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  SMOKE_CLEANUP=compose_down
  log "up: ${SERVICES[*]} (rollout x $ROLLOUTS)"
  up_start=$(date +%s)
  "${DC[@]}" up -d --no-build --scale rollout="$ROLLOUTS" "${SERVICES[@]}" >>"$SMOKE_STEP_LOG" 2>&1
  coordinator=$("${DC[@]}" ps -q coordinator)
  [ -n "$coordinator" ] || fail "no coordinator container"
  step "the run (at most $TIMEOUT_S s)"
  code=$(timeout "$TIMEOUT_S" docker wait "$coordinator") || fail "the run did not end within $TIMEOUT_S s"
  TIMINGS+=("up -> run finished (services start, train, save): $(( $(date +%s) - up_start )) s")
  step "the run's result" runs/smoke/coordinator.log
  "${DC[@]}" logs --no-color coordinator >>"$SMOKE_STEP_LOG" 2>&1 || true
  [ "$code" = 0 ] || fail "the coordinator exited with $code"
  grep -q 'run.done' runs/smoke/coordinator.log || fail "the coordinator log has no run.done"
  log "coordinator exited 0: $(grep -o -m1 'run.done.*' runs/smoke/coordinator.log | cut -c1-120)"
  runs_volume=$(docker inspect -f '{{range .Mounts}}{{if eq .Destination "/runs"}}{{.Name}}{{end}}{{end}}' "$coordinator")
  docker run --rm -v "$runs_volume:/runs" --entrypoint sh "$RLMESH_IMAGE" -c \
    'ls /runs/model/config.json /runs/model/*.safetensors && ls -d /runs/ckpt/global_step_*' \
    || fail "no saved model under /runs/model in the runs volume"

  step "Prometheus on 127.0.0.1:$PROMETHEUS_PORT"
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
}

compose_down() {
  if [ "${SMOKE_KEEP:-0}" != 1 ]; then
    log "down"
    "${DC[@]}" logs --no-color > runs/smoke/compose.log 2>&1 || true
    "${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
