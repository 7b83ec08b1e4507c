#!/usr/bin/env bash
# The GPU suite in one command, for a machine with accelerators (e.g. the lent H200s):
# tests marked `gpu`, the staging and engine benchmarks, the `gpu` topologies through
# `pdctl nightly --suite gpu` (each verified against a colocated reference), and the
# PD benchmark on the 2-GPU topology. Reports go under $OUT (default gpu-reports/).
#
# Python packages the machine lacks travel as wheels in .whl/ and .whl-gpu/ (the CUDA
# Mooncake and NIXL wheels), Debian's libibverbs1 and libnl as .debs/ (unpacked to
# /tmp/ibv, never to /): scripts/gpu_wheels.sh fills those folders. STAGES picks
# parts: tests,bench,nightly,pd, transport (`pdctl bench transport --device`: every
# transport between two processes in device memory, beside the device's copy), and
# engine (the engine bench alone, deterministic and vendor modes side by side), launch
# (`pdctl up` of PD_TOPOLOGY to ready, cold then warm Triton cache), sweep
# (staging kernel variants, device-only and end to end) and invariance (vendor vs
# Triton products across batch sizes and TP splits), fault (the staging profile with
# the upload kernel on and off, cold caches, FAULT_ROUNDS rounds; then replays with a
# changing page list checked bitwise, under compute-sanitizer's memcheck where present). One device call runs for at
# most 10 minutes and brings back 8 files: split the stages over calls, e.g.
# STAGES=sweep,invariance then STAGES=tests,pd then STAGES=nightly.
# SUITE picks the nightly suite (default gpu; gpu-1 on one GPU, gpu-4 on four), TOPOLOGIES
# the files or folders it selects from (default topologies), NIGHTLY_TIMEOUT its
# limit in seconds (default 420), and PD_TOPOLOGY the topology the pd stage
# benchmarks (default the 2-GPU staging one; e.g.
# topologies/cuda-4gpu-p1d4-tcp-staging.yaml on 4 GPUs, cuda-1gpu-p1d1-tcp.yaml on one)
# with the transports in PD_BACKENDS (default tcp,mooncake,nixl). The nightly stage ends with
# per-request KV transfer time against bytes (benchmarks/kv_transfer_table.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-reports}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
STAGES=${STAGES:-tests,bench,nightly,pd}
SUITE=${SUITE:-gpu}
TOPOLOGIES=${TOPOLOGIES:-topologies}
NIGHTLY_TIMEOUT=${NIGHTLY_TIMEOUT:-420}
PD_TOPOLOGY=${PD_TOPOLOGY:-topologies/cuda-2gpu-p1d2-tcp-staging.yaml}
PD_BACKENDS=${PD_BACKENDS:-tcp,mooncake,nixl}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# CARRIED=0 skips the carried wheels and debs (a machine that has the packages)
CARRIED=${CARRIED:-1}
wheels=$([ "$CARRIED" = 1 ] && { compgen -G ".whl/*.whl"; compgen -G ".whl-gpu/*.whl"; })
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pdctl-site $wheels || exit 1
  export PYTHONPATH=/tmp/pdctl-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$CARRIED" = 1 ] && compgen -G ".debs/*.deb" >/dev/null; then
  for deb in .debs/*.deb; do dpkg -x "$deb" /tmp/ibv; done
  export LD_LIBRARY_PATH=/tmp/ibv/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
has() { [[ ",$STAGES," == *",$1,"* ]]; }

status=0
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  python3 -c 'import mooncake.engine; print("mooncake.engine importable")' 2>&1 | tail -n 1
  python3 -c 'import nixl; print("nixl importable:", nixl.__file__)' 2>&1 | tail -n 1
  python3 -m pdctl doctor 2>&1 | tail -n 12
} 2>&1 | tee "$OUT/machine.txt"

if has tests; then
  timeout 240 python3 -m pytest -q -s -m gpu tests/staging tests/serve -p no:cacheprovider -x 2>&1 \
    | tail -n 30 | tee "$OUT/gpu-tests.log"
  grep -q ' passed' "$OUT/gpu-tests.log" && ! grep -q 'failed\|error' "$OUT/gpu-tests.log" \
    || status=1
fi

if has bench; then
  { for backend in triton torch; do
      python3 -m pdctl bench staging --device "$DEVICE" --backend "$backend" --json \
        | python3 -c 'import json,sys; r=json.load(sys.stdin); r["backend_run"]=sys.argv[1]; print(json.dumps(r))' "$backend"
    done
    python3 -m pdctl.serve.bench --preset small --device "$DEVICE" --batches 1,8,32 \
      --modes deterministic,vendor --json
  } > "$OUT/bench.jsonl" || status=1
  python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    report = json.loads(line)
    if "results" in report:
        print(f"staging bench, {report['backend_run']}, target {report['target_ratio']}x of a device copy")
        for row in report["results"]:
            print(f"  {row['shape']:<38} copy {row['copy_gbps']:8.1f} GB/s  gather {row['gather_ratio']:.2f}  scatter {row['scatter_ratio']:.2f}")
    else:
        print("engine bench:", json.dumps(report.get("rows", report)))
PY
fi

if has engine; then
  timeout 200 python3 -m pdctl.serve.bench --preset small --device "$DEVICE" --batches 1,8,32 \
    --new-tokens 32 --modes deterministic,vendor 2>&1 | tee "$OUT/engine.log" || status=1
fi

if has transport; then
  timeout 200 python3 -m pdctl bench transport --device "$DEVICE" --json \
    > "$OUT/bench-transport.json" 2> "$OUT/bench-transport.err" || status=1
  python3 - "$OUT/bench-transport.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for row in report["rows"]:
    first = f", first {row['first_ms']:.2f} ms" if row.get("first_ms") is not None else ""
    print(f"  {row['variant']:<24} {row['label']:<14} {row['gbps']:10.2f} GB/s  p50 {row['p50_ms']:.4f} ms{first}  ok {row['consistent']}")
print("unavailable:", report["unavailable"], "targets:", report["targets"])
PY
fi

if has sweep; then
  timeout 300 python3 benchmarks/staging_kernel_sweep.py 2>&1 | tee "$OUT/sweep.log" \
    | tail -n 40 || status=1
fi

if has fault; then
  # The upload kernel's unexplained fault (docs/benchmarks.md, session 14): full runs of
  # the end-to-end staging profile, the upload kernel on and off in turn, each with cold
  # Triton and C-library caches as on a freshly started machine; one line a run.
  for round in $(seq "${FAULT_ROUNDS:-3}"); do
    for upload in kernel copy; do
      log="$OUT/fault-$round-upload-$upload.log"
      TRITON_CACHE_DIR=$(mktemp -d) PDCTL_NATIVE_DIR=$(mktemp -d) timeout 150 \
        python3 benchmarks/staging_e2e_profile.py --upload "$upload" > "$log" 2>&1
      rc=$?
      echo "round $round upload=$upload rc=$rc shapes=$(grep -c e2e10 "$log")" \
        "illegal=$(grep -c 'illegal memory' "$log")" | tee -a "$OUT/fault.txt"
    done
  done
  # the default (ids copied ahead of the graph), then the upload inside it: kernel, copy
  for upload in ahead kernel copy; do
    timeout 120 python3 benchmarks/staging_e2e_profile.py --stress 12 --upload "$upload" \
      > "$OUT/stress-upload-$upload.log" 2>&1 || status=1
    tail -n 1 "$OUT/stress-upload-$upload.log" | tee -a "$OUT/fault.txt"
  done
  if command -v compute-sanitizer >/dev/null; then
    timeout 280 compute-sanitizer --tool memcheck --print-limit 20 \
      python3 benchmarks/staging_e2e_profile.py --stress 3 > "$OUT/memcheck.log" 2>&1 || status=1
    grep 'ERROR SUMMARY' "$OUT/memcheck.log" | tee -a "$OUT/fault.txt"
  fi
fi

if has invariance; then
  timeout 150 python3 benchmarks/batch_invariance.py --device "$DEVICE" 2>&1 \
    | tee "$OUT/invariance.log" | tail -n 40 || status=1
fi

if has nightly; then
  # shellcheck disable=SC2086
  timeout "$NIGHTLY_TIMEOUT" python3 -m pdctl nightly $TOPOLOGIES --suite "$SUITE" \
    --junit "$OUT/nightly.xml" --json "$OUT/nightly.json" 2>&1 | tail -n 40 || status=1
  python3 benchmarks/kv_transfer_table.py "$OUT/nightly.json" 2>&1 | tee "$OUT/kv-transfer.md"
fi

if has launch; then  # `pdctl up` to ready, on a cold then a warm Triton cache
  for attempt in cold warm; do
    started=$(date +%s.%N)
    python3 -m pdctl up -d --json "$PD_TOPOLOGY" > "$OUT/up-$attempt.json" \
      2> "$OUT/up-$attempt.err" || status=1
    ended=$(date +%s.%N)
    name=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["name"])' \
      "$OUT/up-$attempt.json" 2>/dev/null)
    python3 -c 'import sys; print(f"pdctl up {sys.argv[1]} ({sys.argv[2]} Triton cache): '\
'{float(sys.argv[4]) - float(sys.argv[3]):.1f} s to ready")' \
      "$PD_TOPOLOGY" "$attempt" "$started" "$ended" | tee -a "$OUT/launch.log"
    [ -n "$name" ] && python3 -m pdctl down "$name" > /dev/null 2>&1
  done
fi

if has pd; then
  timeout 300 python3 -m pdctl bench pd "$PD_TOPOLOGY" \
    --backends "$PD_BACKENDS" --prompts 8 --prompt-len 2048 --new-tokens 32 --concurrency 4 \
    --json > "$OUT/bench-pd.json" || status=1
  python3 -c 'import json,sys; [print(r) for r in json.load(open(sys.argv[1]))["rows"]]' "$OUT/bench-pd.json"
fi
tar czf "$OUT/runs.tgz" runs 2>/dev/null
exit $status
