"""Which decode ranks one prefill rank writes a room to, and their endpoints.

Each decode rank receives head slices from some prefill ranks (`layout.head_slices`,
which handles TP differing on the two sides, GQA replication included); this rank
writes to each decode rank one of whose slices is its own, as that slice's writer.
Each decode transport is connected once and kept.

What this does not know: rooms, or how the KV is written.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import protocol as proto
from pdctl.staging.layout import StagingLayout, head_slices
from pdctl.staging.transport import Peer, Transport


class Targets:
    def __init__(
        self, rank: int, tp: int, num_kv_heads: int, kv: KVPool, transport: Transport
    ) -> None:
        self.rank, self.tp, self.heads, self.kv = rank, tp, num_kv_heads, kv
        self.transport = transport
        self._peers: dict[str, Peer] = {}  # decode transport (its description) -> peer
        self._lock = threading.Lock()

    def of(self, decode_tp: int) -> Iterator[tuple[int, StagingLayout, int]]:
        """(decode rank, its layout, this rank's writer index) for each decode rank this
        prefill rank writes heads to."""
        first = self.kv.k_buffers[0]
        head_dim, elem_bytes = first.shape[2], first.element_size()
        for decode_rank in range(decode_tp):
            slices = head_slices(self.heads, self.tp, decode_tp, decode_rank)
            mine = [i for i, s in enumerate(slices) if s.prefill_rank == self.rank]
            if mine:
                layout = StagingLayout(len(self.kv.k_buffers), head_dim, elem_bytes, slices)
                yield decode_rank, layout, mine[0]

    def connected(self, transport: str) -> Peer | None:
        """The peer of a decode transport connected before (None: not yet)."""
        with self._lock:
            return self._peers.get(transport)

    def peer(self, registration: proto.Registration) -> Peer:
        """The registering decode rank's peer, connected on first use."""
        with self._lock:
            if registration.transport not in self._peers:
                self._peers[registration.transport] = self.transport.connect(
                    base64.b64decode(registration.transport)
                )
            return self._peers[registration.transport]
