#!/usr/bin/env bash
# The GPU suite in one command, for a machine with an accelerator (e.g. the lent H200):
# tests marked `gpu`, then the benchmarks, with reports under $OUT (default gpu-reports/).
# Wheels that the machine lacks can be carried in .whl/ (see docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-reports}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pdctl-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/pdctl-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

status=0
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} | tee "$OUT/machine.txt"

python3 -m pytest -q -m gpu tests/staging -p no:cacheprovider \
  --junitxml "$OUT/gpu-tests.xml" 2>&1 | tail -n 30 | tee "$OUT/gpu-tests.log" || status=1
grep -q 'failed' "$OUT/gpu-tests.log" && status=1

for backend in triton torch; do
  python3 -m pdctl bench staging --device "$DEVICE" --backend "$backend" --json \
    > "$OUT/bench-staging-$backend.json" || status=1
done
python3 - "$OUT" <<'PY'
import json, sys
for backend in ("triton", "torch"):
    report = json.load(open(f"{sys.argv[1]}/bench-staging-{backend}.json"))
    print(f"staging bench, {backend}, target {report['target_ratio']}x of a device copy")
    for row in report["results"]:
        print(f"  {row['shape']:<38} copy {row['copy_gbps']:8.1f} GB/s  gather {row['gather_ratio']:.2f}  scatter {row['scatter_ratio']:.2f}")
PY
exit $status
