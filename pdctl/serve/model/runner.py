"""The Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over paged KV.

One decoder for every architecture `weights.py` loads: Qwen2's q/k/v biases, Qwen3's
per-head q/k norms before RoPE, Llama 3's scaled RoPE (`rope.py`: only the tables
change) and Mistral's sliding window (attention masks keys older than the window).

`ModelRunner.forward` computes a batch of sequence pieces (`batch.py`): each piece
appends `tokens` at positions `start..start+n-1` of one sequence whose earlier tokens
are already in the KV pool. The batch is laid out on the device once per forward
(`run` computes a batch already laid out: a decode step's CUDA graph captures it);
each layer writes the new tokens' K and V into the pool and attends over every piece
at once (`attention.py`). Every primitive is batch-invariant (see `ops.py`), so a
token's hidden states, and the logits of a sequence, do not depend on the other
pieces in the batch, on how a prompt was chunked, or on a prefix-cache hit.

Tensor parallelism: each rank holds its heads and its share of the MLP; the two
row-parallel products gather partials through `gather` (None at TP 1). The runner
knows nothing about scheduling, pages or HTTP: it reads and writes the KV buffers
(`KVBuffers`, the engine's pool) at the rows each piece names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pdctl.serve.model import attention, ops, rope
from pdctl.serve.model.batch import ForwardBatch, Piece
from pdctl.serve.model.weights import LayerWeights, RankWeights


class KVBuffers(Protocol):
    """Where the model keeps K and V: the engine's `KVPool` is one."""

    k_buffers: list[torch.Tensor]  # per layer [pool_tokens, kv_heads, head_dim]
    v_buffers: list[torch.Tensor]  # per layer [pool_tokens, kv_heads, head_dim]


class ModelRunner:
    def __init__(
        self,
        weights: RankWeights,
        kv: KVBuffers,
        device: torch.device,
        gather: ops.AllGather | None = None,
        compute_logits: bool = True,
    ) -> None:
        self.w = weights
        self.kv = kv
        self.device = device
        self.gather = gather
        self.compute_logits = compute_logits
        shape = weights.config.shape
        self.scale = shape.head_dim**-0.5
        cos, sin = rope.rope_tables(shape.head_dim, shape.max_position, weights.config.rope)
        self.window = weights.config.sliding_window
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.q_width = weights.q_heads * shape.head_dim

    @torch.inference_mode()
    def forward(self, pieces: Sequence[Piece]) -> torch.Tensor | None:
        """Logits [pieces wanting them, vocab] in float32 (None on ranks that skip them)."""
        batch = ForwardBatch.build(pieces, self.device)
        return self.run(batch, _embeds(pieces))

    @torch.inference_mode()
    def run(
        self, batch: ForwardBatch, embeds: Sequence[tuple[int, torch.Tensor]] = ()
    ) -> torch.Tensor | None:
        """The forward of a batch already on the device: what a CUDA graph captures.

        Reads only shapes on the host. `embeds` are (token index, [m, hidden] rows) that
        replace token embeddings (multimodal prompts); logits as `forward`'s.
        """
        # What attention derives from the key table holds for this forward only: a fixed
        # decode layout (`decode_batch`) rewrites the same tables in place between steps.
        batch.keys.derived.clear()
        x = ops.pad_rows(self.w.embed[batch.tokens])  # [T padded, hidden]
        for at, rows in embeds:  # multimodal positions take the encoder's embeddings
            x[at : at + rows.shape[0]] = rows.to(device=x.device, dtype=x.dtype)
        cos = ops.pad_rows(self.cos[batch.positions])
        sin = ops.pad_rows(self.sin[batch.positions])
        for layer, lw in enumerate(self.w.layers):
            x = self._attention_block(layer, lw, x, batch, cos, sin)
            x = self._mlp_block(lw, x)
        if not self.compute_logits or not batch.logit_rows.numel():
            return None
        last = ops.pad_rows(x[batch.logit_rows])
        last = ops.rms_norm(last, self.w.final_norm, self.w.config.rms_eps, self.w.lm_head_t.dtype)
        wanted, vocab = batch.logit_rows.numel(), self.w.config.shape.vocab_size
        return ops.matmul(last, self.w.lm_head_t)[:wanted, :vocab].float()

    def _attention_block(
        self,
        layer: int,
        lw: LayerWeights,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """x [T padded, hidden] plus the attention sublayer's update."""
        h = ops.rms_norm(x, lw.input_norm, self.w.config.rms_eps, lw.qkv_t.dtype)
        qkv = ops.matmul(h, lw.qkv_t)  # [T padded, q | k | v (| column padding)]
        if lw.qkv_bias is not None:
            qkv = qkv[:, : lw.qkv_bias.numel()] + lw.qkv_bias
        if lw.q_norm is not None and lw.k_norm is not None:
            eps, kv_heads = self.w.config.rms_eps, self.w.kv_heads
            qkv = ops.head_norms(qkv, lw.q_norm, lw.k_norm, self.w.q_heads, kv_heads, eps)
        k_buffer, v_buffer = self.kv.k_buffers[layer], self.kv.v_buffers[layer]
        q = ops.rope_and_cache(qkv, cos, sin, self.w.q_heads, k_buffer, v_buffer, batch.new_rows)
        attn = attention.paged_attention(
            q, k_buffer, v_buffer, batch.keys, self.scale, window=self.window
        )
        attn_rows = attn.view(-1, self.q_width)
        return ops.row_parallel_matmul(attn_rows, lw.o_chunks, self.gather, residual=x)

    def _mlp_block(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """x [T padded, hidden] plus the MLP sublayer's update."""
        h = ops.rms_norm(x, lw.post_norm, self.w.config.rms_eps, lw.gate_up_t.dtype)
        gate_up = ops.matmul(h, lw.gate_up_t)
        inter = gate_up.shape[1] // 2
        act = ops.silu_mul(gate_up[:, :inter], gate_up[:, inter:])
        return ops.row_parallel_matmul(act, lw.down_chunks, self.gather, residual=x)


def _embeds(pieces: Sequence[Piece]) -> list[tuple[int, torch.Tensor]]:
    """Every piece's multimodal rows, at their token's index in the batch."""
    found, offset = [], 0
    for piece in pieces:
        found += [(offset + index, rows) for index, rows in piece.embeds]
        offset += piece.tokens.numel()
    return found
