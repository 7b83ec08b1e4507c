#!/usr/bin/env bash
# Where a GPU host's time goes: py-spy (carried as a wheel by scripts/gpu_wheels.sh)
# samples (1) the prefill server's GIL holder while `pdctl bench pd` runs on TOPOLOGY,
# and (2) a loop of checked staging calls on SHAPE (replayed from CUDA graphs). Raw
# collapsed stacks go under $OUT; benchmarks/collapse_top.py summarises them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-reports}
TOPOLOGY=${TOPOLOGY:-topologies/cuda-1gpu-p1d1-tcp.yaml}
SPY=$(command -v py-spy || echo /tmp/pdctl-site/bin/py-spy)
mkdir -p "$OUT"
python3 -m pdctl bench pd "$TOPOLOGY" --backends tcp --prompts 24 --prompt-len 2048 \
  --new-tokens 8 --concurrency 1 --json > "$OUT/bench-pd-profiled.json" 2> "$OUT/bench-pd-profiled.err" &
bench=$!
for _ in $(seq 600); do  # the PD prefill server's rank 0, once it is up
  pid=$(pgrep -f ':prefill:tp0' | head -n 1)
  [ -n "$pid" ] && break
  sleep 0.1
done
sleep 8  # past its start-up
[ -n "${pid:-}" ] && timeout 60 "$SPY" record --gil --threads -r 2000 -d 12 -f raw -o "$OUT/prefill-gil.txt" -p "$pid" > /dev/null 2>&1
wait "$bench"
cat > /tmp/staging_loop.py <<'PY'
import time, torch
from pdctl.staging.kernels import gather_all_layers_to_staging
layers, heads, dim, tokens = 28, 2, 128, 8192
pool = [torch.ones(tokens * 5 // 4 + 1, heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2 * layers)]
k, v = pool[:layers], pool[layers:]
pages = torch.randperm(tokens * 5 // 4 + 1)[:tokens].pin_memory()
staging = torch.empty(2 * layers * tokens * dim * 2, dtype=torch.uint8, device="cuda")
end = time.time() + 6
while time.time() < end:
    gather_all_layers_to_staging(k, v, pages, staging, src_head_start=1, num_heads=1, page_size=1)
torch.cuda.synchronize()
PY
timeout 60 "$SPY" record -r 5000 -f raw -o "$OUT/staging-loop.txt" -- python3 /tmp/staging_loop.py > /dev/null 2>&1
ls -la "$OUT"
