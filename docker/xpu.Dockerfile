# pdctl on Intel GPUs (XPU), mirroring the upstream XPU PD suites: SGLang's servers
# or pdctl's embedded ones on XPU, KV over Mooncake's TENT engine (TCP, no RDMA NIC).
# Build from the repository root:
#   docker build -f docker/xpu.Dockerfile -t pdctl:xpu .
#   docker run --device /dev/dri --ipc=host pdctl:xpu nightly --suite xpu
# (The development machine has no Docker engine; the file is linted in the tests.)

# oneAPI base kit: icx/icpx and the Level Zero loader Mooncake's XPU code needs.
FROM intel/oneapi-basekit:2025.2.2-0-devel-ubuntu24.04

# The Mooncake commit whose transfer engine is built below. Published Mooncake
# wheels are built for CUDA or without TENT; XPU memory needs both USE_XPU and TENT,
# so the engine is built from source, at a pinned commit for repeatable images.
ARG MOONCAKE_COMMIT=c2efc73d5d1105a6d94f126bf8faced5a6360c5f

# Build tools and the libraries Mooncake links (RDMA verbs even for TCP, gflags/glog,
# jsoncpp, yaml-cpp, curl for its metadata client). Versions follow the pinned base.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev make cmake ninja-build git pkg-config \
        libibverbs-dev librdmacm-dev libnuma-dev libgflags-dev libgoogle-glog-dev \
        libjsoncpp-dev libyaml-cpp-dev libcurl4-openssl-dev libssl-dev libunwind-dev \
        libgtest-dev libboost-all-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pdctl
RUN python3 -m venv .venv
ENV PATH=/opt/pdctl/.venv/bin:$PATH

# torch for XPU first and pinned: the XPU index serves the build whose Level Zero
# runtime matches the base image (the CPU or CUDA build would not see the GPUs).
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/xpu torch==2.13.0

# Mooncake's transfer engine only (-DWITH_STORE=OFF), with XPU memory support
# (-DUSE_XPU=ON) inside the TENT engine (-DUSE_TENT=ON), compiled by icpx so the SYCL
# parts build. `pdctl doctor` then reports the capability mooncake.tent, which the
# XPU topologies require (they skip on an image without it). The Python package is
# installed from the wheel the build leaves in mooncake-wheel/dist.
WORKDIR /tmp/mooncake
RUN git clone https://github.com/kvcache-ai/Mooncake.git . \
    && git checkout "${MOONCAKE_COMMIT}" \
    && git submodule update --init --recursive \
    && cmake -S . -B build -G Ninja \
        -DCMAKE_C_COMPILER=icx -DCMAKE_CXX_COMPILER=icpx \
        -DUSE_XPU=ON -DUSE_TENT=ON -DWITH_STORE=OFF -DBUILD_UNIT_TESTS=OFF \
    && cmake --build build \
    && cmake --install build \
    && pip install --no-cache-dir mooncake-wheel/dist/*.whl \
    && rm -rf /tmp/mooncake

# pdctl with Triton (the XPU Triton backend comes with torch's XPU build) and
# sglang-router, which the upstream PD suites launch between prefill and decode;
# NIXL without its dependency list (it would replace the XPU torch). SGLang itself
# for XPU is installed from its own XPU instructions on top of this image when the
# `engine: sglang` topologies should run; without it they skip with that reason.
WORKDIR /opt/pdctl
COPY . .
RUN pip install --no-cache-dir -e ".[dev,triton,router]" \
    && pip install --no-cache-dir --no-deps nixl-cu12==1.5.1 nixl==1.5.1 \
    && touch .venv/.pdctl-setup

ENTRYPOINT ["pdctl"]
CMD ["doctor"]
