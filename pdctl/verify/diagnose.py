"""Compare two runs of the same prompts token by token, and say what a difference means.

Token ids are compared, never text. A mismatch is diagnosed at its first divergent
position with the tokens around it and both runs' top-5 logprobs there:
- **near-tie**: the two best candidates were closer than the margin threshold, so
  numerical noise may pick either. The threshold is read in the compute dtype: a
  few units in the last place of bf16 or fp16 at the logit's magnitude are
  numerics, whatever `--near-tie-margin` says;
- **unconfirmed**: a clear margin, not (yet) reproduced without KV transfer. The
  control before blame (`control.py`) turns it into **engine-numerics** (the
  colocated engine, moving no KV, diverges too in the same cache state) or
  **divergence** (it does not: the KV or its transfer is wrong); it stays
  unconfirmed only when no control could run, and blames nothing then;
- **nondeterministic**: the same serial run, repeated, differs: the engine, not PD;
- **kv-corruption**: a digest of the KV differs between prefill and decode (named
  layer, decode rank);
- **embedding-corruption**: EPD: the embeddings prefill received differ from what
  the encoder sent (digest of the slot in prefill's embedding pool);
- **request-failed**: the request errored or timed out (named role);
- **cache-miss**: the prefix-hit pass reused no cached token.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, TypedDict

from pdctl.verify.client import Result

CONTEXT = 3
KV_CORRUPTION = re.compile(
    r"KV corruption in room (?P<room>\d+): layer (?P<layer>\d+) (?P<kv>[KV]) from prefill rank "
    r"(?P<prefill>\d+) to decode rank (?P<decode>\d+)(?: \((?P<where>[^)]*)\))?"
)
EMBEDDING_CORRUPTION = re.compile(
    r"embedding corruption in room (?P<room>\d+): the encoder sent digest (?P<sent>0x[0-9a-f]+), "
    r"prefill received (?P<received>0x[0-9a-f]+)"
)
ROLES = ("prefill", "decode", "router", "encoder")
NUMERIC_ULPS = 4  # a margin within this many units in the last place is numerics
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}
NUMERICS = ("near-tie", "engine-numerics")  # fail only where deterministic serving was asked


# `pass` is a keyword: the functional form
FindingJson = TypedDict(
    "FindingJson",
    {
        "pass": str,
        "request": str,
        "classification": str,
        "message": str,
        "position": int | None,
        "evidence": dict[str, Any],
    },
)


@dataclass
class Finding:
    pass_name: str
    request: str
    classification: str
    message: str
    position: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> FindingJson:
        return {
            "pass": self.pass_name,
            "request": self.request,
            "classification": self.classification,
            "message": self.message,
            "position": self.position,
            "evidence": self.evidence,
        }


def failed_role(error: str) -> str:
    """The role an error message blames: the first role word in it, else the router."""
    found = [(error.find(role), role) for role in ROLES if role in error]
    return min(found)[1] if found else "router"


def request_failure(pass_name: str, result: Result) -> Finding:
    error = result.error or "unknown error"
    corruption = KV_CORRUPTION.search(error)
    if corruption:
        return Finding(
            pass_name,
            result.prompt.id,
            "kv-corruption",
            f"KV corruption: layer {corruption['layer']} {corruption['kv']}, prefill rank "
            f"{corruption['prefill']} -> decode rank {corruption['decode']}, "
            f"{corruption['where'] or 'where unknown'} (room {corruption['room']})",
            evidence={
                "layer": int(corruption["layer"]),
                "kv": corruption["kv"],
                "prefill_rank": int(corruption["prefill"]),
                "decode_rank": int(corruption["decode"]),
                "where": corruption["where"] or "where unknown",
                "error": error,
            },
        )
    embedding = EMBEDDING_CORRUPTION.search(error)
    if embedding:
        return Finding(
            pass_name,
            result.prompt.id,
            "embedding-corruption",
            f"embedding corruption between the encoder and prefill (embedding room "
            f"{embedding['room']}): sent digest {embedding['sent']}, "
            f"received {embedding['received']}",
            evidence={
                "room": int(embedding["room"]),
                "sent": embedding["sent"],
                "received": embedding["received"],
                "where": "encoder -> prefill embedding pool",
                "error": error,
            },
        )
    role = failed_role(error)
    return Finding(
        pass_name,
        result.prompt.id,
        "request-failed",
        f"{role} failed: {error}",
        evidence={"role": role, "status": result.status, "error": error},
    )


def _top(result: Result, position: int) -> list[list[float | int]]:
    if position < len(result.top):
        return [[token, round(lp, 6)] for token, lp in result.top[position]]
    return []


def _margin(result: Result, position: int) -> float | None:
    if position < len(result.top) and len(result.top[position]) >= 2:
        return result.top[position][0][1] - result.top[position][1][1]
    return None


def ulp(value: float, dtype: str | None) -> float | None:
    """One unit in the last place of `dtype` at |value| (None: dtype or value unknown)."""
    bits = MANTISSA_BITS.get(dtype or "")
    if bits is None or not math.isfinite(value) or value == 0:
        return None
    return 2.0 ** (math.floor(math.log2(abs(value))) - bits)


def tie_threshold(flat: float, dtype: str | None, results: list[Result], position: int) -> float:
    """The near-tie margin at `position`: the flat one, or NUMERIC_ULPS units in the last
    place of the compute dtype at the largest logit either run chose there."""
    logits = [
        abs(v)
        for r in results
        if position < len(r.logits) and (v := r.logits[position]) is not None
    ]
    unit = ulp(max(logits), dtype) if logits else None
    return max(flat, NUMERIC_ULPS * unit) if unit is not None else flat


def compare(
    pass_name: str,
    baseline: Result,
    other: Result,
    near_tie: float,
    repeat: bool = False,
    dtype: str | None = None,
) -> Finding | None:
    """None when `other` has the baseline's tokens, else the diagnosis before any control."""
    a, b = baseline.output_ids, other.output_ids
    if a == b:
        return None
    position = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if position is None:  # one is a prefix of the other
        position = min(len(a), len(b))
    margins = [m for m in (_margin(baseline, position), _margin(other, position)) if m is not None]
    margin = min(margins) if margins else None
    threshold = tie_threshold(near_tie, dtype, [baseline, other], position)
    if repeat:
        classification = "nondeterministic"
    elif margin is not None and margin < threshold:
        classification = "near-tie"
    else:
        classification = "unconfirmed"
    lo, hi = max(0, position - CONTEXT), position + CONTEXT + 1
    expected = a[position] if position < len(a) else None
    got = b[position] if position < len(b) else None
    if classification == "nondeterministic":
        what = "the engine is not deterministic (a serial run repeated differs)"
    elif classification == "near-tie":
        what = f"near-tie (margin {margin:.4g} < {threshold:.4g}): numerical noise, not PD"
    else:
        clear = (
            f"with a clear margin ({margin:.4g} >= {threshold:.4g})"
            if margin is not None
            else "(the answers carry no logprobs to read a margin from)"
        )
        what = f"divergence {clear}, not reproduced without KV transfer"
    return Finding(
        pass_name,
        other.prompt.id,
        classification,
        f"token {position}: expected {expected}, got {got}; {what}",
        position=position,
        evidence={
            "expected": a[lo:hi],
            "got": b[lo:hi],
            "window_start": lo,
            "baseline_top5": _top(baseline, position),
            "run_top5": _top(other, position),
            "margin": None if margin is None else round(margin, 6),
            "near_tie_threshold": round(threshold, 6),
            "compute_dtype": dtype,
            "baseline_cached_tokens": baseline.cached_tokens,
            "run_cached_tokens": other.cached_tokens,
        },
    )


def blocks(finding: Finding, deterministic: bool) -> bool:
    """Numerics (near-ties, engine numerics) fail only where deterministic serving was
    asked for, since that mode promises them away; every other finding fails."""
    return finding.classification not in NUMERICS or deterministic


def digest_problems(pass_name: str, result: Result) -> Finding | None:
    transfer = result.kv_transfer
    if result.ok and transfer is not None and transfer.digest_ok is False:
        return Finding(
            pass_name,
            result.prompt.id,
            "kv-corruption",
            "a KV digest differs between prefill and decode",
            evidence={"kv_transfer": transfer.to_json()},
        )
    return None
