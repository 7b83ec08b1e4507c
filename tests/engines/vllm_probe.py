"""Run by test_vllm_contract.py in vLLM's own environment (.venv-vllm): vLLM's server
parser, its environment table, its completion request model and vllm-router's parser.

vLLM is not installed beside pdctl (it pins its own torch), so the contract tests ask
this child, started with .venv-vllm's interpreter, one child for the module (importing
vLLM takes seconds). stdin: one request a line, a JSON object with any of

    "serve":       [[flag, ...], ...]   argvs after `python -m <server module>`
    "env":         [[name, value], ...]  variables a server is started with
    "router":      [[flag, ...], ...]   argvs after `python -m vllm_router.launch_router`
    "modules":     [name, ...]           modules that must be importable (not imported)
    "completions": [{...}, ...]          request bodies for POST /v1/completions

stdout: one answer a line, what vLLM made of each, in the same order. Everything else
the packages write (their loggers write to stdout) goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import importlib.util
import io
import json
import os
import sys
from typing import Any, TextIO

# AsyncEngineArgs fields; host, port and enable_prompt_tokens_details are the server's own
SERVE_FIELDS = (
    "model", "served_model_name", "tensor_parallel_size", "dtype", "seed", "block_size",
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_gpu_blocks_override",
    "async_scheduling", "enable_prefix_caching", "enforce_eager",
)  # fmt: skip
KV_FIELDS = (
    "kv_connector", "kv_role", "kv_buffer_device", "kv_load_failure_policy",
    "kv_connector_extra_config",
)  # fmt: skip
ROUTER_FIELDS = (
    "host", "port", "vllm_pd_disaggregation", "prefill_urls", "decode_urls", "kv_connector",
    "prometheus_host", "prometheus_port", "request_timeout_secs",
    "worker_startup_check_interval", "worker_startup_timeout_secs",
)  # fmt: skip


def refusal(exc: BaseException, printed: io.StringIO) -> dict[str, object]:
    """An argparse refusal exits after printing usage: its last line says why."""
    lines = printed.getvalue().strip().splitlines()
    return {"error": f"{type(exc).__name__}: {exc} {lines[-1] if lines else ''}".strip()}


@functools.cache
def serve_parser() -> argparse.ArgumentParser:
    """vLLM's server parser, built once (250 ms; parsing with it takes under 1 ms, and
    `parse_args` starts every argv from a fresh namespace of the defaults)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def parse_serve(argv: list[str]) -> dict[str, object]:
    """As `python -m vllm.entrypoints.openai.api_server` does (its entry.main), then
    the engine arguments the server builds from the namespace."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            args = serve_parser().parse_args(argv)
            validate_parsed_serve_args(args)
            engine = AsyncEngineArgs.from_cli_args(args)
    except (SystemExit, Exception) as exc:
        return refusal(exc, printed)
    parsed: dict[str, object] = {field: getattr(engine, field) for field in SERVE_FIELDS}
    parsed |= {"host": args.host, "port": args.port}
    parsed["enable_prompt_tokens_details"] = args.enable_prompt_tokens_details
    kv = engine.kv_transfer_config
    parsed["kv_transfer_config"] = None if kv is None else {f: getattr(kv, f) for f in KV_FIELDS}
    return parsed


def check_env(name: str, value: str) -> dict[str, object]:
    """vLLM reads a variable through its table's getter: set it, read it, put it back."""
    from vllm.envs import environment_variables

    getter = environment_variables.get(name)
    if getter is None:
        return {"name": name, "known": False, "error": None}
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        getter()
    except Exception as exc:
        return {"name": name, "known": True, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
    return {"name": name, "known": True, "error": None}


def parse_router(argv: list[str]) -> dict[str, object]:
    """As `python -m vllm_router.launch_router` does (its main), with the check its
    launch_router makes before the Rust router starts."""
    from vllm_router.launch_router import parse_router_args

    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            args = parse_router_args(argv)
            args._validate_router_args()
    except (SystemExit, Exception) as exc:
        return refusal(exc, printed)
    return {field: getattr(args, field) for field in ROUTER_FIELDS}


def check_completion(body: dict[str, Any]) -> dict[str, object]:
    """Validated by vLLM's request model; `unknown` are the keys it would ignore (its
    OpenAI models allow extra fields and only log them)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    fields = set(CompletionRequest.model_fields)
    fields |= {f.alias for f in CompletionRequest.model_fields.values() if f.alias}
    try:
        CompletionRequest.model_validate(body)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "unknown": sorted(set(body) - fields)}
    return {"error": None, "unknown": sorted(set(body) - fields)}


def answer(request: dict[str, Any]) -> dict[str, object]:
    import vllm

    return {
        "version": vllm.__version__,
        "router_version": importlib.metadata.version("vllm-router"),
        "serve": [parse_serve(argv) for argv in request.get("serve", [])],
        "env": [check_env(name, value) for name, value in request.get("env", [])],
        "router": [parse_router(argv) for argv in request.get("router", [])],
        "modules": [importlib.util.find_spec(m) is not None for m in request.get("modules", [])],
        "completions": [check_completion(body) for body in request.get("completions", [])],
    }


def answers_channel() -> TextIO:
    """stdout for the answers alone: vLLM's logger holds sys.stdout from its import on,
    so file descriptor 1 itself is pointed at stderr and the answers get a copy of it."""
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def main() -> None:
    channel = answers_channel()
    for line in sys.stdin:
        if line.strip():
            channel.write(json.dumps(answer(json.loads(line))) + "\n")
            channel.flush()
    channel.close()
    sys.stderr.flush()
    os._exit(0)  # at end of input: no interpreter teardown (torch's takes seconds)


if __name__ == "__main__":
    main()
