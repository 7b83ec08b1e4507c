#!/usr/bin/env bash
# Set up .venv with everything pdctl and its tests need. Idempotent; the Makefile
# runs it only when pyproject.toml or this script changed since the last run.
set -euo pipefail

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0                   # the CPU build on this class of machine
NIXL_VERSION=1.5.1                     # nixl-cu12 + the nixl meta package, both --no-deps
SGLANG_VERSION=0.5.23                  # the SGLang pdctl's sglang engine is checked against
say() { printf 'setup: %s\n' "$*" >&2; }

# 1. System libraries. Mooncake's engine module links libibverbs even for TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing Debian's libibverbs1 (Mooncake needs it even over TCP)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q libibverbs1 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; }
  else
    say "libibverbs1 is missing and this is not root: Mooncake will not import."
    say "fix: sudo apt-get install libibverbs1   (then run make again)"
  fi
fi

# 2. The virtual environment: 3.7 GiB once set up, with pip's unpacking on top.
if [ ! -x "$VENV/bin/python" ]; then
  . "$(dirname "$0")/disk.sh"
  need_disk setup "$VENV" 5
  say "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

# 3. torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
# TORCH_INDEX_URL picks a build elsewhere (docker/cpu.Dockerfile: the CPU wheel index).
say "installing torch==$TORCH_VERSION"
pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"

# 4. pdctl itself with the extras CI exercises (Triton for the interpreter, Mooncake CPU wheel).
say "installing pdctl[dev,triton,mooncake-cpu,router,ray]"
pip install -e ".[dev,triton,mooncake-cpu,router,ray]"

# 5. NIXL without its dependency list (which would pull a CUDA torch).
say "installing nixl-cu12==$NIXL_VERSION and nixl==$NIXL_VERSION with --no-deps"
pip install --no-deps "nixl-cu12==$NIXL_VERSION" "nixl==$NIXL_VERSION"

# 6. SGLang's argument parser and environment table, for the contract tests of what pdctl
# renders for `engine: sglang`. Serving needs GPUs; parsing does not. --no-deps: SGLang pins
# a CUDA torch; these few packages are all that `sglang.srt.server_args` imports on top.
say "installing sglang==$SGLANG_VERSION with --no-deps, and its parser's imports"
pip install --no-deps "sglang==$SGLANG_VERSION"
pip install "psutil==7.2.2" "pybase64==1.5.1" "msgspec==0.23.0" "pyzmq==27.3.0" \
  "ipython==9.18.1" "traitlets==5.16.1"
# SGLang's serving benchmark client (python -m sglang.bench_serving, run against pdctl's
# router in tests/serve/test_openai_client.py) imports `datasets` at start-up; it and the
# modules it imports go in --no-deps too (datasets would otherwise pull a wide tree).
pip install --no-deps "datasets==5.2.0" "multiprocess==0.70.19" "pandas==3.1.1" \
  "pyarrow==26.0.1" "dill==0.4.1" "xxhash==4.1.0"

"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"unexpected torch {torch.__version__}"
from sglang.srt.server_args import ServerArgs  # noqa: F401  (the contract tests need it)
print(f"setup: ok (torch {torch.__version__})", flush=True)
PY
