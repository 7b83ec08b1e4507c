"""Run in its own process by test_sglang_contract.py: SGLang's parser and env table.

Importing sglang changes process-wide state (it imports Triton and registers its own
kernels, which breaks the Triton interpreter for the tests that run after it in the
same worker), so the contract tests ask this child instead, one child for the module
(importing SGLang takes seconds). stdin: one request a line, {"argvs": [[...]], "env":
[[name, value], ...]}; stdout: one answer a line, what SGLang made of each, as JSON
(anything SGLang prints meanwhile goes to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import io
import json
import sys
from typing import Any

FIELDS = (
    "model_path", "host", "port", "disaggregation_mode", "disaggregation_transfer_backend",
    "disaggregation_bootstrap_port", "disaggregation_ib_device", "tp_size", "base_gpu_id",
    "device", "nccl_port", "dist_init_addr", "page_size", "max_running_requests",
    "chunked_prefill_size", "max_total_tokens", "disable_overlap_schedule",
    "enable_deterministic_inference", "dtype", "random_seed", "enable_metrics", "context_length",
)  # fmt: skip


@functools.cache
def parser() -> argparse.ArgumentParser:
    """SGLang's own parser, built once: building it takes 40 ms (its dataclass fields'
    annotations are evaluated anew each time), parsing with it a fraction of that, and
    `parse_args` starts every argv from a fresh namespace of the defaults."""
    from sglang.srt.server_args import ServerArgs

    built = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(built)
    return built


def parse(argv: list[str]) -> dict[str, object]:
    from sglang.srt.server_args import ServerArgs

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = ServerArgs.from_cli_args(parser().parse_args(argv))
    except (SystemExit, argparse.ArgumentError, Exception) as exc:
        return {"error": f"{type(exc).__name__}: {exc} {errors.getvalue().strip()[-300:]}"}
    return {field: getattr(args, field, None) for field in FIELDS}


def check_env(name: str, value: str) -> dict[str, object]:
    from sglang.srt.environ import envs

    variable = getattr(envs, name, None)
    if variable is None:
        return {"name": name, "known": False, "error": None}
    try:
        variable.parse(value)
    except Exception as exc:
        return {"name": name, "known": True, "error": f"{type(exc).__name__}: {exc}"}
    return {"name": name, "known": True, "error": None}


def answer(request: dict[str, Any]) -> dict[str, object]:
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the answers alone
        return {
            "version": importlib.metadata.version("sglang"),
            "parsed": [parse(argv) for argv in request.get("argvs", [])],
            "env": [check_env(name, value) for name, value in request.get("env", [])],
        }


def main() -> None:
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(answer(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
