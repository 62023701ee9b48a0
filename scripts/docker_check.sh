#!/usr/bin/env bash
# Smoke test of docker/Dockerfile on a GPU-less Debian machine with no Docker Hub: builds the image on a local
# Debian bookworm base with DS_ACCELERATOR=cpu, then runs the demo in it as the README runs it (minus --gpus).
# Run as root from anywhere: `bash scripts/docker_check.sh`; 6-11 min on 2 cores (measured), less when cached.
# Needs docker (client + dockerd; dockerd is started here if none answers, and stopped at the end if so) and,
# the first time, debootstrap (local/bookworm is made from the mirror in this machine's apt sources).
# The base adds this machine's CA certificates (a TLS-intercepting proxy's CA reaches pip in the container) and,
# when $WHEELS (default: $PIP_FIND_LINKS, else /opt/wheels) holds a cp311 torch wheel, a pip.conf that finds it,
# so setup.sh takes that (CPU) wheel instead of PyPI's multi-GB CUDA build.
# Env: STEPS (demo steps, default 30), WHEELS, TAG (default deepseek-ds:cpu-check). Idempotent: reuses the images.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS=${STEPS:-30}
TAG=${TAG:-deepseek-ds:cpu-check}
WHEELS=${WHEELS:-${PIP_FIND_LINKS:-/opt/wheels}}
BASE=local/bookworm
CHECK_BASE=local/deepseek-ds-check-base
export DOCKER_BUILDKIT=0   # the classic builder takes FROM images from the local store, never from a registry

log() { echo "[docker_check] $*"; }
die() { log "FAIL: $*" >&2; exit 1; }
t0=$SECONDS; phase_t=$SECONDS; timings=()
phase_done() { timings+=("$(printf '%-14s %4ds' "$1" $((SECONDS - phase_t)))"); log "phase $1: $((SECONDS - phase_t))s"; phase_t=$SECONDS; }

tmp=$(mktemp -d /var/tmp/docker_check.XXXXXX)
dockerd_pid=
cleanup() {
  rm -rf "$tmp"
  if [[ -n $dockerd_pid ]]; then
    log "stopping the dockerd this script started (pid $dockerd_pid)"
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

[[ $(id -u) -eq 0 ]] || die "run as root (dockerd, debootstrap)"
command -v docker >/dev/null || die "no docker client (apt-get install docker.io)"

# 1. daemon
if ! docker info >/dev/null 2>&1; then
  log "no dockerd answers: starting one (log: /var/tmp/docker_check.dockerd.log)"
  # Host networking only (the build and the run below use --network=host): with its default bridge, dockerd sets
  # the FORWARD policy to DROP and turns on bridge netfilter, and leaves both after it stops, which cut the
  # multi-host tests' namespace bridge (launch/testcluster.sh) off.
  nohup dockerd --storage-driver=overlay2 --iptables=false --bridge=none \
    >/var/tmp/docker_check.dockerd.log 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || die "dockerd did not start (see /var/tmp/docker_check.dockerd.log)"
fi
phase_done dockerd

# 2. local/bookworm, from this machine's apt mirror
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || die "no debootstrap (apt-get install debootstrap)"
  mirror=$( { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' || true
              grep -hs '^deb ' /etc/apt/sources.list | grep -o 'https\?://[^ ]*' || true; } \
            | grep -v security | awk 'NR == 1')
  [[ -n $mirror ]] || die "no Debian mirror found in /etc/apt/sources.list{,.d}"
  log "debootstrap bookworm from $mirror"
  debootstrap --variant=minbase bookworm "$tmp/rootfs" "$mirror" >"$tmp/debootstrap.log" 2>&1 \
    || { tail -n 20 "$tmp/debootstrap.log"; die "debootstrap"; }
  rm -rf "$tmp"/rootfs/var/cache/apt/archives/*.deb "$tmp"/rootfs/var/lib/apt/lists/*
  tar -C "$tmp/rootfs" -c . | docker import - "$BASE" >/dev/null
  rm -rf "$tmp/rootfs"
fi
phase_done base-os

# 3. the stand-in for CUDA_IMAGE: CAs, pip.conf, the local torch wheel (rebuilt each run: the proxy CA changes)
ctx=$tmp/base; mkdir -p "$ctx/wheels" "$ctx/certs"
cp /usr/local/share/ca-certificates/*.crt "$ctx/certs/" 2>/dev/null || log "no /usr/local/share/ca-certificates/*.crt"
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$ctx/pip.conf"
shopt -s nullglob; whl=("$WHEELS"/torch-*-cp311-*linux*x86_64.whl); shopt -u nullglob
if ((${#whl[@]})); then
  log "torch wheel for the image: ${whl[*]}"
  cp -l "${whl[@]}" "$ctx/wheels/" 2>/dev/null || cp "${whl[@]}" "$ctx/wheels/"
  printf 'find-links = /opt/wheels\n' >>"$ctx/pip.conf"
else
  die "no cp311 torch wheel in $WHEELS: the image's CPU lock (requirements/cpu.txt) pins torch 2.13.0+cpu, not on PyPI"
fi
cat >"$ctx/Dockerfile" <<DF
FROM $BASE
COPY certs/ /usr/local/share/ca-certificates/
COPY pip.conf /etc/pip.conf
COPY wheels/ /opt/wheels/
RUN mkdir -p /etc/ssl/certs \\
 && find /usr/local/share/ca-certificates -name '*.crt' -exec cat {} + >/etc/ssl/certs/ca-certificates.crt
DF
docker build -q --network=host -t "$CHECK_BASE" "$ctx" >"$tmp/base.log" 2>&1 || { cat "$tmp/base.log"; die "docker build of $CHECK_BASE"; }
rm -rf "$ctx"
phase_done check-base

# 4. the project image, CPU flavour
docker build --network=host -f docker/Dockerfile --build-arg CUDA_IMAGE="$CHECK_BASE" --build-arg DS_ACCELERATOR=cpu \
  -t "$TAG" . 2>&1 | tee "$tmp/build.log" | grep --line-buffered -E '^(Step |Successfully|Sending build context)' || true
docker image inspect "$TAG" >/dev/null 2>&1 && grep -q '^Successfully tagged' "$tmp/build.log" \
  || { tail -n 40 "$tmp/build.log"; die "docker build"; }
phase_done image-build
size=$(docker image inspect -f '{{.Size}}' "$TAG")
log "image $TAG: $((size / 1024 / 1024)) MiB"

# 5. the demo, as the README runs it (no --gpus here)
rc=0
docker run --rm --ipc=host --network=host "$TAG" bash scripts/demo.sh --set train.steps="$STEPS" \
  >"$tmp/demo.log" 2>&1 || rc=$?
((rc == 0)) || { tail -n 40 "$tmp/demo.log"; die "demo exited with $rc"; }
phase_done demo
summary=$(awk '/done:$/ {on = 1; print; next} on && /^  [a-z]/ {print; next} {on = 0}' "$tmp/demo.log")
loss=$(grep -E -o 'loss +[0-9.]+ -> [0-9.]+ over [0-9]+ steps' "$tmp/demo.log" | tail -n 1 || true)
[[ -n $loss ]] || { tail -n 40 "$tmp/demo.log"; die "no 'loss first -> last' summary in the demo's output"; }
echo "$summary"
read -r first last steps < <(awk '{print $2, $4, $6}' <<<"$loss")
[[ $steps -eq $STEPS ]] || die "the demo ran $steps steps, not $STEPS"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || die "loss did not fall ($first -> $last)"

log "timings:"; printf '  %s\n' "${timings[@]}"
log "PASS in $((SECONDS - t0))s: $TAG builds with DS_ACCELERATOR=cpu and its demo trains ($first -> $last, $steps steps)"
