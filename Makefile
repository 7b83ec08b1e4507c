SHELL := /bin/bash
# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use (scripts/setup.sh) and skip that step afterwards.

VENV   ?= .venv
PY     := $(VENV)/bin/python
PDCTL  := $(VENV)/bin/pdctl
STAMP  := $(VENV)/.pdctl-setup
# real vLLM in an environment of its own, as users keep it (the cpu-vllm-* topologies)
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.pdctl-setup
DEFAULT_TOPOLOGY := topologies/cpu-p1d2-tcp.yaml

.PHONY: setup setup-vllm demo test nightly-cpu lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	@VENV=$(VENV) scripts/setup.sh 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
	@touch $@

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): scripts/setup_vllm.sh
	@VLLM_VENV=$(VLLM_VENV) scripts/setup_vllm.sh 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
	@touch $@

# The main job on the default CPU topology: bring it up, verify it token for token
# (serial, repeated, concurrent, prefix hit, against a colocated reference), tear down.
demo: setup
	$(PDCTL) validate -q topologies/*.yaml
	$(PDCTL) verify $(DEFAULT_TOPOLOGY) --serial-compare --reference --json runs/demo-verify.json --junit runs/demo-verify.xml

# Two workers, a test file each at a time: the servers the tests start spend much of
# their time waiting, so two files overlap well on two cores (16 min -> 11 min). The two
# environments build side by side (mostly downloads and unpacking); the slowest tests
# are listed at the end, so a run that grows says where. The order of the files is
# tests/conftest.py's (the real-vLLM file first).
test:
	@$(MAKE) --no-print-directory -j2 setup setup-vllm
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# The CPU suite as a CI nightly runs it: every topology tagged `cpu`, reports in runs/.
nightly-cpu: setup
	$(PDCTL) nightly topologies --suite cpu --junit runs/nightly-cpu.xml --json runs/nightly-cpu.json

lint: setup
	$(VENV)/bin/ruff format --check pdctl tests benchmarks
	$(VENV)/bin/ruff check pdctl tests benchmarks
	$(VENV)/bin/mypy
	$(PY) -m pytest -q tests/test_architecture.py  # the structure rules (file sizes, seams)

format: setup
	$(VENV)/bin/ruff format pdctl tests benchmarks
	$(VENV)/bin/ruff check --fix pdctl tests benchmarks

bench: setup
	$(PY) benchmarks/cli_startup.py
	$(PDCTL) bench staging
	$(PDCTL) bench transport
	$(PDCTL) bench engine
	$(PY) benchmarks/launch_times.py
	$(PDCTL) bench pd

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
