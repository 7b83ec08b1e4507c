# pdctl on NVIDIA GPUs: the embedded servers on CUDA, staging through Triton, Mooncake's
# CUDA transfer engine and NIXL (UCX) moving GPU memory. Build from the repository root:
#   docker build -f docker/cuda.Dockerfile -t pdctl:cuda .
#   docker run --gpus all --ipc=host pdctl:cuda nightly --suite gpu
# (The development machine has no Docker engine; the file is linted in the tests.)
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

# python3.12 and venv: Ubuntu 24.04's interpreter; make: the README's commands;
# libibverbs1/librdmacm1: Mooncake links them (also over TCP); NIXL's UCX needs
# libnuma1. Versions follow the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev make git libibverbs1 librdmacm1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pdctl
COPY . .

# torch first and pinned, from PyPI's default index, which serves the CUDA 12 build
# on Linux. Then pdctl with the CUDA Mooncake wheel (not -non-cuda: it moves VRAM),
# Triton and sglang-router; NIXL without its dependency list, which would replace
# the pinned torch.
RUN python3 -m venv .venv \
    && .venv/bin/pip install --no-cache-dir torch==2.13.0 \
    && .venv/bin/pip install --no-cache-dir -e ".[dev,triton,mooncake,router]" \
    && .venv/bin/pip install --no-cache-dir --no-deps nixl-cu12==1.5.1 nixl==1.5.1 \
    && touch .venv/.pdctl-setup

ENV PATH=/opt/pdctl/.venv/bin:$PATH
ENTRYPOINT ["pdctl"]
CMD ["doctor"]
