"""How an engine proves, from its own accounting, that a request's KV was transferred.

Equal tokens prove nothing about the transfer: a decode server that recomputes the
prompt (vLLM with `kv_load_failure_policy=recompute`, a failed handshake) answers
with the colocated tokens. So verify reads the engines' own counters on their
Prometheus `/metrics` around each request (a serial pass) or each pass (a
concurrent one) and judges the difference:

    vllm    decode's vllm:prompt_tokens_by_source_total: no prompt token computed
            locally, some received over the connector (external_kv_transfer), the rest
            hits of decode's own prefix cache; settled once request_success_total
            counted the requests
    sglang  prefill's sglang:kv_transfer_total_mb (one observation per request sent)
            and no sglang:num_transfer_failed_reqs_total on either side

pdctl's own servers need none of this: their answers carry the KV digests. Nothing
here talks HTTP: verify fetches the text and hands it in.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Counter:
    """A sum of samples on one role's servers: `metric` whose labels include `labels`."""

    key: str  # how the judge names it
    role: str  # prefill | decode
    metric: str
    labels: tuple[tuple[str, str], ...] = ()


def read_counters(text: str, wanted: Iterable[Counter]) -> dict[str, float]:
    """Each counter's sum over the exposition `text` (0 where no sample matched)."""
    wanted = list(wanted)
    found = dict.fromkeys((c.key for c in wanted), 0.0)
    by_metric: dict[str, list[Counter]] = {}
    for counter in wanted:
        by_metric.setdefault(counter.metric, []).append(counter)
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None or match.group(1) not in by_metric:
            continue
        labels = dict(LABEL.findall(match.group(2) or ""))
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        for counter in by_metric[match.group(1)]:
            if all(labels.get(k) == v for k, v in counter.labels):
                found[counter.key] += value
    return found


@dataclass(frozen=True)
class Verdict:
    settled: bool  # the engine has counted every request of the window yet
    problem: str | None = None  # what says the KV was not transferred, in the engine's terms


class TransferProof:
    """An engine's counters and how their differences are judged."""

    def __init__(self, source: str, counters: tuple[Counter, ...]) -> None:
        self.source = source  # named in findings: where the evidence comes from
        self.counters = counters

    def roles(self) -> set[str]:
        return {c.role for c in self.counters}

    def judge(self, delta: Mapping[str, float], requests: int, prompt_tokens: int) -> Verdict:
        raise NotImplementedError


def _by_source(key: str, source: str) -> Counter:
    return Counter(key, "decode", "vllm:prompt_tokens_by_source_total", (("source", source),))


class VLLMProof(TransferProof):
    def __init__(self) -> None:
        super().__init__(
            "decode's vllm:prompt_tokens_by_source_total",
            (
                _by_source("local_compute", "local_compute"),
                _by_source("external", "external_kv_transfer"),
                _by_source("local_hit", "local_cache_hit"),
                Counter("finished", "decode", "vllm:request_success_total"),
            ),
        )

    def judge(self, delta: Mapping[str, float], requests: int, prompt_tokens: int) -> Verdict:
        if delta["finished"] < requests:
            return Verdict(False)
        computed, received = int(delta["local_compute"]), int(delta["external"])
        hit = int(delta["local_hit"])
        counts = (
            f"local_compute +{computed}, external_kv_transfer +{received}, local_cache_hit +{hit}"
        )
        if computed > 0:
            computed_itself = f"decode computed {computed} of {prompt_tokens} prompt tokens itself"
            return Verdict(True, f"{computed_itself} instead of receiving them ({counts})")
        if received <= 0 and hit < prompt_tokens:
            return Verdict(True, f"no prompt token arrived over the connector ({counts})")
        return Verdict(True)


class SGLangProof(TransferProof):
    def __init__(self) -> None:
        super().__init__(
            "prefill's sglang:kv_transfer_total_mb and both sides' "
            "sglang:num_transfer_failed_reqs_total",
            (
                Counter("sent", "prefill", "sglang:kv_transfer_total_mb_count"),
                Counter("failed_prefill", "prefill", "sglang:num_transfer_failed_reqs_total"),
                Counter("failed_decode", "decode", "sglang:num_transfer_failed_reqs_total"),
            ),
        )

    def judge(self, delta: Mapping[str, float], requests: int, prompt_tokens: int) -> Verdict:
        failed = int(delta["failed_prefill"] + delta["failed_decode"])
        if failed:
            return Verdict(True, f"{failed} KV transfer(s) failed (num_transfer_failed_reqs)")
        if delta["sent"] < requests:
            return Verdict(False)  # prefill records a transfer once it completed
        return Verdict(True)


PROOFS: dict[str, TransferProof] = {"vllm": VLLMProof(), "sglang": SGLangProof()}
