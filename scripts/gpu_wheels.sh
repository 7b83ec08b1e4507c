#!/usr/bin/env bash
# Fill .whl/, .whl-gpu/ and .debs/ with what the lent H200 machine (Python 3.12, torch
# 2.11 + CUDA 13, no registry) lacks for scripts/gpu_check.sh, from this machine's
# registries. Run it in the repo root; the folders are ignored by git (.git/info/exclude)
# and travel with `carry: [".whl", ".whl-gpu", ".debs"]` (about 43 MiB of the 64 a call
# may carry). The CUDA Mooncake and nixl-cu13 wheels are repacked without the parts pdctl
# never loads (Mooncake's store, EP and bench binaries; NIXL's EP extension and UCX
# perftest), which are most of their size.
set -euo pipefail
cd "$(dirname "$0")/.."
for folder in .whl .whl-gpu .debs; do
  grep -qx "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >> .git/info/exclude
  mkdir -p "$folder"
done
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
fetch() {  # folder, requirement...
  local folder=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$folder" "$@" 2>&1 | grep -v "is ignored" || true
}
# pdctl's own needs that the machine's image does not have
fetch .whl fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 \
  pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  setproctitle==1.3.8 typing_extensions==4.16.0 opentelemetry-api==1.45.2
# the sampling profiler benchmarks/host_profile.sh runs (its binary lands in /tmp/pdctl-site/bin)
fetch .whl py-spy==0.4.1
raw=$(mktemp -d)
fetch "$raw" mooncake-transfer-engine-cuda13==0.3.14 nixl-cu13==1.5.1 nixl==1.5.1
python3 - "$raw" .whl-gpu <<'PY'
"""Repack each wheel without the files pdctl never loads; RECORD rewritten to match."""
import pathlib, re, shutil, sys, zipfile

raw, out = map(pathlib.Path, sys.argv[1:])
unused = {
    "mooncake_transfer_engine_cuda13": [r"_store\.", r"mooncake_client$", r"mooncake_master$",
        r"libmooncake_pg", r"transfer_engine_bench$", r"_ep\.cpython", r"libmooncake_ep_device",
        r"libetcd_wrapper-ed49c416", r"mooncake/_pg_jit/", r"mooncake/mooncake_ep_jit/"],
    "nixl_cu13": [r"nixl_ep_cu13/", r"perftest"],
}
for wheel in raw.glob("*.whl"):
    patterns = unused.get(wheel.name.split("-")[0])
    if not patterns:
        shutil.copy(wheel, out / wheel.name)
        continue
    drop = re.compile("|".join(patterns))
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out / wheel.name, "w",
                                                        zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if drop.search(item.filename):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                kept = [l for l in data.decode().splitlines() if l and not drop.search(l.split(",")[0])]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(item, data)
    print(f"{wheel.name}: {wheel.stat().st_size >> 20} MiB -> {(out / wheel.name).stat().st_size >> 20} MiB")
PY
rm -rf "$raw"
# Mooncake's engine links libibverbs (and libnl, rdmacm, numa, mlx5) even for TCP
(cd .debs && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 librdmacm1 \
  libnuma1 ibverbs-providers 2>/dev/null)
du -sh .whl .whl-gpu .debs
