"""Two runners over equal KV pools, the tiny preset's prompts already in both (CPU).

`eager` runs the normal `ForwardBatch` path, `fixed` the fixed decode layout; the
tests compare their logits and pools bitwise (`test_decode_batch.py`,
`test_decode_graphs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.model.batch import Piece
from pdctl.serve.model.decode_batch import DecodeLayout
from pdctl.serve.model.runner import ModelRunner
from pdctl.serve.model.weights import (
    ModelConfig,
    build_rank_weights,
    preset_config,
    preset_source,
)

CPU = torch.device("cpu")
CONFIG = preset_config("tiny")
POOL, PAGE, CAPACITY = 2048, 16, 320
LENGTHS = [40, 77, 5, 130, 64, 16, 1, 99, 200]  # prompts already in the pool


@dataclass
class Twins:
    """Two runners over equal pools: `eager` takes ForwardBatch, `fixed` the fixed layout."""

    eager: ModelRunner
    fixed: ModelRunner
    pools: tuple[KVPool, KVPool]
    rows: list[torch.Tensor]  # each sequence's pool rows, room for its next token

    def pieces(self, sequences: list[int], step: int = 0) -> list[Piece]:
        """One new token for each sequence, `step` tokens after its prompt."""
        out = []
        for s in sequences:
            start = LENGTHS[s] + step
            token = torch.tensor([(13 * s + 7 * step) % CONFIG.shape.vocab_size + 1])
            out.append(Piece(token, start, self.rows[s][: start + 1]))
        return out

    def assert_same_kv(self) -> None:
        """The pools equal everywhere but the scratch row (padding writes land there)."""
        a, b = (pool.kv.clone() for pool in self.pools)
        scratch = self.pools[0].scratch_row
        a[:, :, scratch] = 0
        b[:, :, scratch] = 0
        assert torch.equal(a, b)


def make_twins(dtype: torch.dtype = torch.float32, config: ModelConfig = CONFIG) -> Twins:
    """`config`: the tiny preset's shape, perhaps with a sliding window."""
    weights = build_rank_weights(config, preset_source(0), 1, 0, dtype, CPU)
    shape = config.shape

    def pool() -> KVPool:
        return KVPool(shape.num_layers, POOL, weights.kv_heads, shape.head_dim, PAGE, dtype, CPU)

    pools = (pool(), pool())
    order = torch.randperm(POOL - PAGE, generator=torch.Generator().manual_seed(0))  # scattered
    rows, at = [], 0
    for length in LENGTHS:
        rows.append(order[at : at + length + 4])
        at += length + 4
    eager, fixed = (ModelRunner(weights, pool, CPU) for pool in pools)
    for s, length in enumerate(LENGTHS):  # the prompts, eagerly, into the first pool
        prompt = torch.tensor([(5 * s + 3 * i) % shape.vocab_size for i in range(length)])
        eager.forward([Piece(prompt, 0, rows[s][:length])])
    pools[1].kv.copy_(pools[0].kv)
    return Twins(eager, fixed, pools, rows)


def fixed_logits(twins: Twins, layout: DecodeLayout, pieces: list[Piece]) -> torch.Tensor:
    layout.fill(pieces)
    logits = twins.fixed.run(layout.batch)
    assert logits is not None and logits.shape[0] == layout.size
    return logits[: len(pieces)]
