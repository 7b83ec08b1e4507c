"""The Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over paged KV.

`ModelRunner.forward` computes a batch of sequence pieces: each piece appends
`tokens` at positions `start..start+n-1` of one sequence whose earlier tokens are
already in the KV pool. Every primitive is batch-invariant (see `ops.py`), so a
token's hidden states, and the logits of a sequence, do not depend on the other
pieces in the batch, on how a prompt was chunked, or on a prefix-cache hit.

Tensor parallelism: each rank holds its heads and its share of the MLP; the two
row-parallel products gather partials through `gather` (None at TP 1). The runner
knows nothing about scheduling, pages or HTTP: it reads and writes the KV buffers
(`KVBuffers`, the engine's pool) at the rows each piece names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdctl.serve.model import ops
from pdctl.serve.model.weights import RankWeights


class KVBuffers(Protocol):
    """Where the model keeps K and V: the engine's `KVPool` is one."""

    k_buffers: list[torch.Tensor]  # per layer [pool_tokens, kv_heads, head_dim]
    v_buffers: list[torch.Tensor]  # per layer [pool_tokens, kv_heads, head_dim]


@dataclass
class Piece:
    """New tokens of one sequence in a forward batch."""

    tokens: torch.Tensor  # [n] int64
    start: int  # position of tokens[0]
    rows: torch.Tensor  # [start + n] pool rows of positions 0..start+n-1
    want_logits: bool = True
    # multimodal: (index into tokens, [m, hidden] rows) that replace token embeddings
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()


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
        self.head_dim = shape.head_dim
        self.scale = shape.head_dim**-0.5
        cos, sin = ops.rope_tables(shape.head_dim, shape.max_position, weights.config.rope_theta)
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.q_width = weights.q_heads * shape.head_dim
        self.kv_width = weights.kv_heads * shape.head_dim

    @torch.inference_mode()
    def forward(self, pieces: Sequence[Piece]) -> torch.Tensor | None:
        """Logits [pieces wanting them, vocab] in float32 (None on ranks that skip them)."""
        tokens = torch.cat([p.tokens for p in pieces]).to(self.device)
        positions = torch.cat(
            [torch.arange(p.start, p.start + p.tokens.numel(), dtype=torch.int64) for p in pieces]
        ).to(self.device)
        new_rows = torch.cat([p.rows[p.start :] for p in pieces]).to(self.device)
        total = tokens.numel()
        x = ops.pad_rows(self.w.embed[tokens])  # [T padded, hidden]
        offset = 0
        for piece in pieces:  # multimodal positions take the encoder's embeddings
            for index, rows in piece.embeds:
                at = offset + index
                x[at : at + rows.shape[0]] = rows.to(device=x.device, dtype=x.dtype)
            offset += piece.tokens.numel()
        cos = ops.pad_rows(self.cos[positions])
        sin = ops.pad_rows(self.sin[positions])
        for layer, lw in enumerate(self.w.layers):
            h = ops.rms_norm(x, lw.input_norm, self.w.config.rms_eps)
            qkv = ops.matmul(h, lw.qkv_t)
            if lw.qkv_bias is not None:
                qkv = qkv[:, : lw.qkv_bias.numel()] + lw.qkv_bias
            q = qkv[:, : self.q_width].view(-1, self.w.q_heads, self.head_dim)
            k = qkv[:, self.q_width : self.q_width + self.kv_width].view(
                -1, self.w.kv_heads, self.head_dim
            )
            v = qkv[:, self.q_width + self.kv_width : self.q_width + 2 * self.kv_width]
            q = ops.apply_rope(q, cos, sin)
            k = ops.apply_rope(k, cos, sin)
            k_buffer, v_buffer = self.kv.k_buffers[layer], self.kv.v_buffers[layer]
            k_buffer[new_rows] = k[:total].to(k_buffer.dtype)
            v_buffer[new_rows] = (
                v[:total].view(-1, self.w.kv_heads, self.head_dim).to(v_buffer.dtype)
            )
            attn = self._attention(pieces, q, positions, k_buffer, v_buffer)
            x = x + ops.row_parallel_matmul(attn, lw.o_chunks, self.gather)
            h = ops.rms_norm(x, lw.post_norm, self.w.config.rms_eps)
            gate_up = ops.matmul(h, lw.gate_up_t)
            inter = gate_up.shape[1] // 2
            act = ops.silu_mul(gate_up[:, :inter], gate_up[:, inter:])
            x = x + ops.row_parallel_matmul(act, lw.down_chunks, self.gather)
        if not self.compute_logits:
            return None
        ends, offset = [], 0
        for piece in pieces:
            offset += piece.tokens.numel()
            if piece.want_logits:
                ends.append(offset - 1)
        if not ends:
            return None
        last = ops.pad_rows(x[torch.tensor(ends, device=self.device)])
        last = ops.rms_norm(last, self.w.final_norm, self.w.config.rms_eps)
        logits = ops.matmul(last, self.w.lm_head_t)[: len(ends), : self.w.config.shape.vocab_size]
        return logits.float()

    def _attention(
        self,
        pieces: Sequence[Piece],
        q: torch.Tensor,
        positions: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
    ) -> torch.Tensor:
        out = q.new_zeros((q.shape[0], self.q_width))  # [T padded, q heads * dim]
        offset = 0
        for piece in pieces:
            n = piece.tokens.numel()
            rows = piece.rows.to(self.device)
            result = ops.attention(
                q[offset : offset + n],
                k_buffer[rows].to(q.dtype),
                v_buffer[rows].to(q.dtype),
                positions[offset : offset + n],
                self.scale,
            )
            out[offset : offset + n] = result.reshape(n, -1)
            offset += n
        return out
