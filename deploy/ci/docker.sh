#!/usr/bin/env bash
# Docker for tests/deploy on a Debian machine without systemd or registry access (CI, as root).
#
#   deploy/ci/docker.sh        # idempotent: installs, starts, builds only what is missing
#
# 1. Debian's docker.io (its client has BuildKit built in; a bare docker CLI without the buildx
#    plugin cannot build), docker-compose v1 and debootstrap, with apt.
# 2. dockerd, started by hand in the background when no daemon answers (log: $DOCKERD_LOG).
# 3. Base images no registry is needed for, each cached between runs:
#    - $BASE_IMAGE: debootstrap bookworm minbase + python3, python3-venv and the host's CA bundle
#      (the machine's TLS to PyPI needs it), imported with `docker import`; the Dockerfile's
#      PYTHON_IMAGE build argument points at it instead of python:3.11-slim-bookworm. Its rootfs
#      tarball is kept in $CACHE, so a rebuilt daemon re-imports it in seconds.
#    - mha-serve-ci/nginx and mha-serve-ci/prometheus: Debian's nginx and prometheus packages on
#      that base (deploy/ci/*.Dockerfile), standing in for the nginx and prom/prometheus images.
# Exit status 0 when Docker is usable; otherwise one line on stderr saying why, and status 1.
set -euo pipefail
cd "$(dirname "$0")/../.."

CACHE=${MHA_DOCKER_CACHE:-/var/cache/mha-serve}
BASE_IMAGE=${MHA_BASE_IMAGE:-mha-serve-ci/python:3.11-bookworm}
MIRROR=${MHA_DEBIAN_MIRROR:-http://deb.debian.org/debian}
DOCKERD_LOG=${MHA_DOCKERD_LOG:-/var/log/mha-dockerd.log}
DOCKER=/usr/bin/docker  # Debian's client, not a buildx-less one earlier on PATH
# Bump when the base image's recipe changes (the cached tarball is keyed on it).
ROOTFS="$CACHE/bookworm-minbase-python3-v1.tar"

fail() { echo "deploy/ci/docker.sh: $*" >&2; exit 1; }
step() { echo "== docker.sh: $*"; }

[ "$(id -u)" = 0 ] || fail "needs root (apt-get, dockerd, debootstrap)"

if [ ! -x /usr/sbin/dockerd ] || [ ! -x "$DOCKER" ] || ! command -v docker-compose >/dev/null \
  || ! command -v debootstrap >/dev/null; then
  step "installing docker.io docker-compose debootstrap"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends docker.io docker-compose debootstrap) >/dev/null \
    || fail "apt-get could not install docker.io docker-compose debootstrap"
fi

if ! "$DOCKER" info >/dev/null 2>&1; then
  step "starting dockerd (log: $DOCKERD_LOG)"
  # setsid + nohup: the daemon outlives this script and the CI step that ran it.
  setsid nohup /usr/sbin/dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
  for _ in $(seq 60); do
    "$DOCKER" info >/dev/null 2>&1 && break
    sleep 1
  done
  "$DOCKER" info >/dev/null 2>&1 \
    || fail "dockerd did not answer within 60 s: $(tail -n 1 "$DOCKERD_LOG" 2>/dev/null)"
fi

if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  if [ ! -s "$ROOTFS" ]; then
    step "debootstrap bookworm minbase + python3 -> $ROOTFS"
    mkdir -p "$CACHE"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      bookworm "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
      || fail "debootstrap failed: $(tail -n 1 "$work/debootstrap.log")"
    # The host's CA bundle (it trusts whatever the machine's TLS to PyPI presents) and apt
    # sources (bookworm + updates + security, as the host has them).
    cp /etc/ssl/certs/ca-certificates.crt "$work/rootfs/etc/ssl/certs/ca-certificates.crt"
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
      cp /etc/apt/sources.list.d/debian.sources "$work/rootfs/etc/apt/sources.list.d/"
      : >"$work/rootfs/etc/apt/sources.list"
    fi
    rm -rf "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/cache/apt/"*.bin
    tar -C "$work/rootfs" -cf "$ROOTFS.tmp" . && mv "$ROOTFS.tmp" "$ROOTFS"
    rm -rf "$work"
    trap - EXIT
  fi
  step "docker import $ROOTFS -> $BASE_IMAGE"
  # pip in a venv uses its own certifi bundle unless told otherwise.
  "$DOCKER" import \
    --change 'ENV LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' \
    "$ROOTFS" "$BASE_IMAGE" >/dev/null || fail "docker import of $ROOTFS failed"
fi

# Built every time: the layer cache makes an unchanged one a no-op, a changed one is rebuilt.
for name in nginx prometheus; do
  step "building mha-serve-ci/$name (Debian's package on $BASE_IMAGE)"
  DOCKER_BUILDKIT=1 "$DOCKER" build -q --network host --build-arg "BASE=$BASE_IMAGE" \
    -t "mha-serve-ci/$name" -f "deploy/ci/$name.Dockerfile" deploy/ci >/dev/null \
    || fail "could not build mha-serve-ci/$name from deploy/ci/$name.Dockerfile"
done

step "ready: $("$DOCKER" version --format 'docker {{.Server.Version}}'), $(docker-compose version --short 2>/dev/null | sed 's/^/docker-compose /'), base $BASE_IMAGE"
