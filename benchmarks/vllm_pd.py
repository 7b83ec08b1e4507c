"""Real vLLM PD against colocated vLLM, on this machine, measured in one run.

Brings a vLLM topology up with pdctl's launcher (each server on its own cores), and
its colocated reference beside it, then sends the same greedy workload through the
router (PD) and to the reference (colocated): one request after another, then all at
once. Prints each server's start-up (spawn to /v1/models answering), the run's time
to a served canary, and tokens/s serial and concurrent, PD / colocated, as JSON.

    python benchmarks/vllm_pd.py [TOPOLOGY] [--prompts N] [--prompt-len L] [--new-tokens T]

Defaults: topologies/cpu-vllm-p1d1-nixl.yaml, 8 prompts of 256 tokens, 64 new tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.run import Run

REPO = Path(__file__).resolve().parent.parent


def prompts(count: int, length: int) -> list[list[int]]:
    """Distinct token-id prompts (no request hits another's prefix cache)."""
    return [
        [(i * 131 + j * 17 + (i * j) % 7) % 500 + 1 for j in range(length)] for i in range(count)
    ]


def complete(url: str, prompt: list[int], new_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    answer.raise_for_status()
    return len(answer.json()["choices"][0]["token_ids"])


def tokens_per_s(url: str, work: list[list[int]], new_tokens: int, concurrent: bool) -> float:
    complete(url, work[0][:32], 4)  # warm: connections open, first-request work done
    started = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(work)) as pool:
            made = sum(pool.map(lambda p: complete(url, p, new_tokens), work))
    else:
        made = sum(complete(url, p, new_tokens) for p in work)
    return made / (time.perf_counter() - started)


def wait_served(run: Run, started: float, timeout: float = 300) -> dict[str, float]:
    """Each server's seconds from spawn until its /v1/models answers."""
    ready: dict[str, float] = {}
    servers = [s for s in run.states if s.plan.role in ("prefill", "decode", "colocated")]
    deadline = time.monotonic() + timeout
    while len(ready) < len(servers) and time.monotonic() < deadline:
        run.check_exits()
        for state in servers:
            if state.plan.name in ready:
                continue
            try:
                if httpx.get(f"{state.url}/v1/models", timeout=2).status_code == 200:
                    ready[state.plan.name] = round(time.monotonic() - started, 1)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    return ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "topology", nargs="?", default=str(REPO / "topologies/cpu-vllm-p1d1-nixl.yaml")
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    plan = make_plan(load_checked(args.topology))
    work = prompts(args.prompts, args.prompt_len)
    with tempfile.TemporaryDirectory(prefix="vllm-pd-") as folder:
        run = Run(plan, Path(folder) / "run")
        started = time.monotonic()
        run.start()
        try:
            reference = run.spawn_reference(tp=1)
            servers = wait_served(run, started)
            run.wait_ready()
            up_s = round(time.monotonic() - started, 1)
            reference_url = reference.wait(timeout=300)
            rows: dict[str, Any] = {}
            for name, url in (("pd", run.router_url), ("colocated", reference_url)):
                rows[name] = {
                    "serial_tokens_per_s": round(
                        tokens_per_s(url, work, args.new_tokens, False), 1
                    ),
                    "concurrent_tokens_per_s": round(
                        tokens_per_s(url, work, args.new_tokens, True), 1
                    ),
                }
        finally:
            run.stop()
    ratio = {k: round(rows["pd"][k] / rows["colocated"][k], 3) for k in rows["pd"]}
    load = {"prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    result = {
        "topology": plan.topology.name,
        "machine": platform.node(),
        "cores": plan.requirements.cpu_cores,
        "workload": load,
        "server_ready_s": servers,
        "run_serving_s": up_s,
        **rows,
        "pd_vs_colocated": ratio,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
