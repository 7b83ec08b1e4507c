"""`pdctl bench pd`: PD serving against colocated, per transport, measured in one run.

For each transport the topology is brought up (the launcher, real processes) with
`transfer.backend` set to it. Each request of a fixed workload is sent serially,
streaming, through the router: time to first token, the KV transfer's bytes and
time (from `meta_info.kv_transfer`), end-to-end tokens/s; then the same workload
with `concurrency` requests in flight gives throughput. A colocated server of the
same model (TP 1) runs the same workload last; the report gives PD / colocated.

Every configuration is warmed up first with WARMUP requests as long as the workload's
(a steady server's state: connections open, kernels compiled, write graphs captured).
Two transfer times: `transfer_ms` is decode's (from the request's admission until
its KV is scattered and checked: it includes waiting for prefill to compute the
prompt); `write_ms_mean` is prefill's own time gathering, digesting and writing
the KV of one request (from /get_server_info `kv_sent`), the transport's share.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import httpx
import yaml

from pdctl.engines import get_engine
from pdctl.errors import UsageError
from pdctl.launch.launcher import make_run
from pdctl.launch.plan import load_checked, make_plan
from pdctl.records import KVSent, KVTransfer, ServerInfo
from pdctl.topology import TopologyError, load_file
from pdctl.topology.model import Topology

BACKENDS = ("tcp", "mooncake", "nixl")
WARMUP = 4  # full-length warm-up requests before the measured ones
MODULES = {"mooncake": ("mooncake",), "nixl": ("nixl", "nixl_cu12", "nixl_cu13")}


class Measured(TypedDict):
    """One configuration's serving figures (the transfer's where it has one)."""

    ttft_ms_p50: float
    ttft_ms_p95: float
    serial_tokens_per_s: float
    concurrent_tokens_per_s: float


class Transferred(TypedDict, total=False):
    """The KV transfer's figures, where the configuration has one (PD)."""

    kv_bytes_per_request: int
    kv_segments: int
    staging: bool
    transfer_ms_p50: float  # decode's: admission until its KV is scattered and checked
    transfer_ms_p95: float
    digests_ok: bool
    write_ms_mean: float  # prefill's: gathering, digesting and writing one request's KV
    write_gbps: float
    gather_ms_mean: float
    digest_ms_mean: float


class Compared(TypedDict, total=False):
    """A PD row against its bounds: the device's copy rate, the colocated server."""

    write_bound_ms: float  # the KV's bytes at the device's copy rate
    write_vs_bound: float
    ttft_vs_colocated: float
    concurrent_tokens_per_s_vs_colocated: float


class Measurement(Measured, Transferred):
    """What `measure` finds of one configuration."""


class BenchRow(Measurement, Compared):
    """A row of `pdctl bench pd`: PD over one transport, or the colocated server."""

    config: str
    transport: str | None  # None: colocated


class PdReport(TypedDict):
    """`pdctl bench pd`'s report: the workload, a row per transport, the colocated last."""

    topology: str
    file: str
    prompts: int
    prompt_len: int
    new_tokens: int
    concurrency: int
    copy_gbps: float | None  # the device's copy rate, measured in the run
    rows: list[BenchRow]
    skipped: dict[str, str]  # transport -> why it was not measured


@dataclass(frozen=True)
class Streamed:
    """One streamed request: time to its first token, in all, tokens, its transfer."""

    ttft_ms: float
    seconds: float
    tokens: int
    kv_transfer: KVTransfer | None


def refuse_other_engines(topology: Topology, command: str, instead: str) -> None:
    """pdctl's benchmarks read what pdctl's own servers report (`/generate`, the KV
    sent): another engine's topology is a usage error, never a half-measured run."""
    if not get_engine(topology.engine).own_servers:
        raise UsageError(
            f"pdctl {command} measures pdctl's own servers; {topology.name} runs engine "
            f"{topology.engine}",
            hint=instead,
        )


def workload(prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Fixed prompts of token ids (distinct, so no request hits another's cache)."""
    return [
        [(seed * 31 + i * 131 + j * 17 + (i * j) % 7) % 500 + 1 for j in range(prompt_len)]
        for i in range(prompts)
    ]


def _stream_one(url: str, prompt: list[int], new_tokens: int) -> Streamed:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
        "stream": True,
    }
    started = time.perf_counter()
    first = None
    tokens, transfer = 0, None  # as the last event says
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=300) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            if first is None and event.get("output_ids"):
                first = time.perf_counter()
            tokens = len(event.get("output_ids", []))
            transfer = event.get("meta_info", {}).get("kv_transfer")
    done = time.perf_counter()
    kv = KVTransfer.from_json(transfer) if transfer else None
    return Streamed(((first or done) - started) * 1e3, done - started, tokens, kv)


def _concurrent(url: str, prompts: list[list[int]], new_tokens: int, concurrency: int) -> float:
    def one(prompt: list[int]) -> int:
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
        }
        response = httpx.post(f"{url}/generate", json=body, timeout=300)
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
        return len(response.json()["output_ids"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - started)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _kv_sent(prefill_url: str | None) -> KVSent:
    if prefill_url is None:
        return KVSent()
    response = httpx.get(f"{prefill_url}/get_server_info", timeout=30)
    return ServerInfo.from_json(response.json()).kv_sent or KVSent()


def measure(
    url: str,
    prompts: list[list[int]],
    new_tokens: int,
    concurrency: int,
    prefill_url: str | None = None,
) -> Measurement:
    # Warm-up: connections and first-call costs, then WARMUP prompts as long as the
    # workload's (not among them: no cache hit), so that the graphs a steady server
    # has for writes of this size exist (they are captured on a size's fourth write).
    _stream_one(url, prompts[0][:8], 2)
    for prompt in workload(WARMUP, len(prompts[0]), seed=1):
        _stream_one(url, prompt, 2)
    before = _kv_sent(prefill_url)
    serial = [_stream_one(url, prompt, new_tokens) for prompt in prompts]
    after = _kv_sent(prefill_url)
    ttft = [r.ttft_ms for r in serial]
    transfers = [r.kv_transfer for r in serial if r.kv_transfer is not None]
    serial_rate = sum(r.tokens for r in serial) / sum(r.seconds for r in serial)
    row: Measurement = {
        "ttft_ms_p50": round(statistics.median(ttft), 2),
        "ttft_ms_p95": round(_percentile(ttft, 0.95), 2),
        "serial_tokens_per_s": round(serial_rate, 1),
        "concurrent_tokens_per_s": round(_concurrent(url, prompts, new_tokens, concurrency), 1),
    }
    if transfers:
        ms = [float(t.transfer_ms or 0) for t in transfers]
        row.update(
            {
                "kv_bytes_per_request": int(statistics.median(t.bytes or 0 for t in transfers)),
                "kv_segments": max(t.segments or 0 for t in transfers),
                "staging": bool(transfers[0].staging),
                "transfer_ms_p50": round(statistics.median(ms), 2),
                "transfer_ms_p95": round(_percentile(ms, 0.95), 2),
                "digests_ok": all(t.digest_ok for t in transfers),
            }
        )
    rooms = after.rooms - before.rooms
    if rooms > 0:  # prefill's side: time spent gathering and writing, per request
        write_ms = after.write_ms - before.write_ms
        row["write_ms_mean"] = round(write_ms / rooms, 2)
        row["write_gbps"] = round((after.bytes - before.bytes) / (write_ms * 1e6), 3)
        # the parts of write_ms that are not writes
        row["gather_ms_mean"] = round((after.gather_ms - before.gather_ms) / rooms, 3)
        row["digest_ms_mean"] = round((after.digest_ms - before.digest_ms) / rooms, 3)
    return row


def copy_ceiling_gbps(device: str, nbytes: int = 256 << 20) -> float | None:
    """GB/s of the device's own copy of `nbytes`, in this process (median of 9): the
    bound a request's KV write is compared with. None on the CPU (no device copy)."""
    if device == "cpu":
        return None
    import torch

    where = torch.device(device if ":" in device else f"{device}:0")
    module = getattr(torch, where.type)  # torch.cuda, torch.xpu, torch.npu: synchronize()
    source = torch.ones(nbytes, dtype=torch.uint8, device=where)
    target = torch.empty_like(source)
    times = []
    for _ in range(11):
        started = time.perf_counter()
        target.copy_(source)
        module.synchronize(where)
        times.append(time.perf_counter() - started)
    del source, target
    return round(nbytes / statistics.median(times[2:]) / 1e9, 1)


def variant(
    path: Path,
    backend: str,
    directory: Path,
    staging: dict[str, float] | None = None,
    changes: Mapping[str, object] | None = None,
) -> Path:
    """The topology file with another transport (and staging sizes, and `changes`
    merged in: mappings key by key, lists appended), written to `directory`."""
    data = yaml.safe_load(path.read_text())
    transfer = data.setdefault("transfer", {})
    transfer["backend"] = backend
    if staging:
        transfer.setdefault("staging", {}).update(staging)
    _merge(data, changes or {})
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("path"), str):
        local = path.parent / Path(model["path"]).expanduser()  # the copy lives elsewhere
        if local.exists():
            model["path"] = str(local.resolve())
    target = directory / f"{path.stem}-{backend}.yaml"
    target.write_text(yaml.safe_dump(data, sort_keys=False))
    return target


def _merge(data: dict[str, Any], changes: Mapping[str, object]) -> None:
    """`changes` into a YAML mapping: mappings key by key, lists appended."""
    for key, value in changes.items():
        current = data.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            _merge(current, value)
        elif isinstance(value, list) and isinstance(current, list):
            data[key] = [*current, *value]
        else:
            data[key] = value


def bench_pd(
    topology: Path,
    *,
    backends: tuple[str, ...] = BACKENDS,
    prompts: int = 12,
    prompt_len: int = 256,
    new_tokens: int = 32,
    concurrency: int = 6,
    progress: Callable[[str], None] = lambda _: None,
) -> PdReport:
    base = load_file(topology).topology
    refuse_other_engines(
        base, "bench pd", "benchmarks/vllm_pd.py measures real vLLM PD against colocated"
    )  # before anything starts
    work = workload(prompts, prompt_len)
    rows: list[BenchRow] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pdctl-bench-") as scratch:
        for backend in backends:
            modules = MODULES.get(backend, ())
            if modules and not any(importlib.util.find_spec(m) for m in modules):
                skipped[backend] = f"none of {', '.join(modules)} is importable"
                continue
            try:
                plan = make_plan(load_checked(variant(topology, backend, Path(scratch))))
            except TopologyError as exc:
                skipped[backend] = str(exc).splitlines()[0]
                continue
            progress(f"{backend}: starting {plan.topology.name}")
            with make_run(plan).serving() as run:
                progress(f"{backend}: measuring {prompts} requests")
                prefill = run.state("prefill-0").url
                measured = measure(run.router_url, work, new_tokens, concurrency, prefill)
                rows.append({"config": f"PD {backend}", "transport": backend, **measured})
        progress("colocated reference: starting")
        plan = make_plan(load_checked(topology))
        run = make_run(plan)
        try:
            url = run.start_reference(tp=1)
            progress("colocated reference: measuring")
            measured = measure(url, work, new_tokens, concurrency)
            reference_row: BenchRow = {"config": "colocated TP1", "transport": None, **measured}
        finally:
            run.stop()
    ceiling = copy_ceiling_gbps(base.device)
    for row in rows:
        if ceiling and row.get("kv_bytes_per_request") and row.get("write_ms_mean"):
            bound_ms = row["kv_bytes_per_request"] / (ceiling * 1e6)
            row["write_bound_ms"] = round(bound_ms, 4)  # the KV's bytes at the copy rate
            row["write_vs_bound"] = round(row["write_ms_mean"] / bound_ms, 2)  # target <= 2
        row["ttft_vs_colocated"] = round(row["ttft_ms_p50"] / reference_row["ttft_ms_p50"], 3)
        row["concurrent_tokens_per_s_vs_colocated"] = round(
            row["concurrent_tokens_per_s"] / reference_row["concurrent_tokens_per_s"], 3
        )
    return {
        "topology": base.name,
        "file": str(topology),
        "prompts": prompts,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "concurrency": concurrency,
        "copy_gbps": ceiling,
        "rows": [*rows, reference_row],
        "skipped": skipped,
    }
