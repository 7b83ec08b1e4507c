"""Sampling and log-probabilities from a batch of logits.

Temperature 0 is argmax (the first maximum on ties), deterministic everywhere.
Otherwise each request draws from its own generator, seeded by its `seed` (or its
id), so a sampled request also reproduces run to run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_new_tokens: int = 128
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class TokenChoice:
    token: int
    logprob: float
    top: list[tuple[int, float]]
    logit: float | None = None  # the chosen token's logit: its magnitude sets the ulp verify reads


def generator_for(params: SamplingParams, rid: str) -> torch.Generator:
    seed = params.seed
    if seed is None:
        seed = int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "little") >> 1
    return torch.Generator().manual_seed(seed)


def choose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, top_n: int
) -> TokenChoice:
    """One token from one row of logits [vocab] (float32)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.temperature <= 0:
        token = int(torch.argmax(logits))
    else:
        # shifted by the maximum and scaled in float64: any temperature the API takes (down
        # to 5e-324) gives scores <= 0, never inf - inf = nan (which killed the engine)
        scores = (logits.double() - logits.max()) / params.temperature
        if 0 < params.top_k < scores.numel():
            threshold = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < threshold, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if params.top_p < 1.0:
            ordered, index = torch.sort(probs, descending=True)
            keep = torch.cumsum(ordered, dim=-1) - ordered < params.top_p
            mask = torch.zeros_like(probs, dtype=torch.bool).scatter(0, index, keep)
            probs = torch.where(mask, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        token = int(torch.multinomial(probs, 1, generator=generator))
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = torch.topk(logprobs, min(top_n, logprobs.numel()))
        top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
    return TokenChoice(token, float(logprobs[token]), top, float(logits[token]))
