"""The transfer proven from the engine's own accounting, around each PD request.

An engine with a `TransferProof` (vLLM, SGLang: `engines.proof`) counts where a
decode server's prompt tokens came from. Around a serial request, and around a whole
concurrent pass, verify reads those counters on the target's prefill and decode
servers (`/metrics`), waits until the engine counted the requests (bounded), and
judges the difference: a request whose prompt decode recomputed, or for which no KV
arrived, is a blocking `kv-not-transferred` finding naming it ("requested is not
effective"); one the accounting does not settle on is `kv-unproven`. Nothing is
proven by absence: a target whose servers cannot be read proves nothing either.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx

from pdctl.engines.proof import TransferProof, Verdict, read_counters
from pdctl.verify.client import Result
from pdctl.verify.diagnose import Finding

SETTLE_S = 10.0  # how long the engine's counters may lag the answers
Counters = dict[str, float] | str  # a snapshot, or why it could not be taken


class Unreadable(Exception):
    """A server's /metrics could not be read (the message says which and why)."""


class ProofReader:
    """Reads one engine's counters on the servers of a target."""

    def __init__(
        self, proof: TransferProof, urls: dict[str, list[str]], client: httpx.Client
    ) -> None:
        self.proof, self.urls, self.client = proof, urls, client

    def missing(self) -> str | None:
        """Why nothing can be proven here (no servers of a role to read), else None."""
        for role in sorted(self.proof.roles()):
            if not self.urls.get(role):
                return (
                    f"the target's {role} servers are not known, so their accounting cannot be read"
                )
        return None

    def snapshot(self) -> dict[str, float]:
        totals = dict.fromkeys((c.key for c in self.proof.counters), 0.0)
        for role in self.proof.roles():
            counters = [c for c in self.proof.counters if c.role == role]
            for url in self.urls.get(role, []):
                try:
                    response = self.client.get(f"{url}/metrics", timeout=10)
                except httpx.HTTPError as exc:
                    raise Unreadable(f"{role} {url}/metrics: {type(exc).__name__}") from None
                if response.status_code != 200:
                    raise Unreadable(f"{role} {url}/metrics answered {response.status_code}")
                for key, value in read_counters(response.text, counters).items():
                    totals[key] += value
        return totals

    def settle(self, before: dict[str, float], requests: int, prompt_tokens: int) -> Verdict:
        """The verdict once the engine counted `requests` since `before` (or the bound)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            after = self.snapshot()
            delta = {key: after[key] - before[key] for key in after}
            verdict = self.proof.judge(delta, requests, prompt_tokens)
            if verdict.settled or time.monotonic() > deadline:
                return verdict
            time.sleep(0.05)


def prompt_tokens(results: Sequence[Result]) -> int:
    return sum(len(r.prompt.input_ids or []) for r in results)


def judge(
    reader: ProofReader, pass_name: str, results: Sequence[Result], before: Counters
) -> Finding | None:
    """Mark `results` (answered since `before`) proven, or the finding that says why not."""
    answered = [r for r in results if r.ok]
    if not answered:
        return None  # failed requests are findings of their own
    who = answered[0].prompt.id if len(results) == 1 else "-"
    source = reader.proof.source
    try:
        if isinstance(before, str):
            raise Unreadable(before)
        verdict = reader.settle(before, len(answered), prompt_tokens(answered))
    except Unreadable as exc:
        return Finding(pass_name, who, "kv-unproven", f"the transfer cannot be proven: {exc}")
    if not verdict.settled:
        uncounted = f"{source} did not count {len(answered)} finished request(s) within "
        message = f"{uncounted}{SETTLE_S:g} s: the transfer is not proven"
        return Finding(pass_name, who, "kv-unproven", message)
    if verdict.problem is not None:
        many = "" if who != "-" else f" (over the pass's {len(answered)} requests)"
        message = f"requested is not effective: {verdict.problem}{many}, per {source}"
        return Finding(pass_name, who, "kv-not-transferred", message, evidence={"source": source})
    for result in answered:
        result.transfer_proven = source
    return None
