#!/usr/bin/env bash
# Makes sure a Docker engine answers: installs Debian's docker.io (engine, BuildKit client) and
# debootstrap when missing, starts dockerd in the background (overlay2, cgroupfs; log in
# /var/log/pdserve-dockerd.log) when none runs, and waits until it answers (60 s at most).
# Needs root for both. Prints the client to use (/usr/bin/docker: BuildKit with --secret).
set -euo pipefail
DOCKER=/usr/bin/docker
if [[ ! -x $DOCKER || ! -x /usr/sbin/dockerd ]] || ! command -v debootstrap >/dev/null; then
  echo "==> apt-get install docker.io debootstrap iptables" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap iptables >/dev/null
fi
if ! "$DOCKER" info >/dev/null 2>&1; then
  echo "==> starting dockerd (log: /var/log/pdserve-dockerd.log)" >&2
  nohup /usr/sbin/dockerd --storage-driver overlay2 --exec-opt native.cgroupdriver=cgroupfs \
    >>/var/log/pdserve-dockerd.log 2>&1 &
  for _ in $(seq 60); do
    "$DOCKER" info >/dev/null 2>&1 && break
    sleep 1
  done
  "$DOCKER" info >/dev/null 2>&1 || { echo "dockerd did not answer in 60 s: /var/log/pdserve-dockerd.log" >&2; exit 1; }
fi
echo "$DOCKER"
