# pdctl on CPU: the image CI-like jobs run in. Build from the repository root:
#   docker build -f docker/cpu.Dockerfile -t pdctl:cpu .
# (The development machine has no Docker engine; the file is linted in the tests.)
FROM python:3.11.7-slim-bookworm

# make: the README's two commands; libibverbs1: Mooncake's engine links it even over TCP.
# Debian versions are not pinned: bookworm's security updates replace them, and the
# base image tag already pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends make libibverbs1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pdctl
COPY . .
# The same set-up as `make test` / `make demo` (torch==2.13.0 first, nixl --no-deps);
# PyPI's default torch wheel for Linux is the CUDA build, so point at the CPU index.
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN make setup

ENV PATH=/opt/pdctl/.venv/bin:$PATH
ENTRYPOINT ["pdctl"]
CMD ["--help"]
