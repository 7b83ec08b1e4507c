"""Continuous batching: which requests run in the next forward, and how much of each.

Each step batches every decoding request (one token each) with prefill chunks of
waiting requests, up to a prefill token budget (chunked prefill) and the running
limit. A request is admitted only when every page it can ever need (prompt plus
`max_new_tokens`) is reserved, evicting unlocked prefix-cache pages if needed, so
a running request never runs out of KV. A prefix-cache hit reuses whole pages and
computes only the rest, but always at least the last prompt token (its logits).

A PD request that ends while its KV may still be moving (aborted mid-transfer, a
failed receive) is fenced instead of released (`fence`): its pages, prefix locks and
slot stay held, out of the running set, until `unfence(room)`, called once no writer
(decode) or reader (prefill) of those pages can still touch them. A fenced page is
neither free nor handed out, so a late write lands in memory nobody else holds.

Plain state and decisions; the engine runs the forward and delivers results.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from pdctl.serve.engine.kv_pool import KVPool, ReqToToken
from pdctl.serve.engine.radix import RadixCache
from pdctl.serve.engine.request import Phase, Request
from pdctl.serve.model.batch import Piece


@dataclass
class Budget:
    max_running: int
    prefill_tokens: int  # chunked prefill: prompt tokens per step


class Scheduler:
    def __init__(self, kv: KVPool, slots: ReqToToken, radix: RadixCache, budget: Budget) -> None:
        self.kv, self.slots, self.radix, self.budget = kv, slots, radix, budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.receives_kv = False  # decode role: PD requests get their KV from prefill
        self.admitted_transfers: list[Request] = []  # admitted since the engine last looked
        self.fenced: dict[int, Request] = {}  # room -> a request whose pages stay held

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admission_problem(self, request: Request) -> str | None:
        """Why `request` can never run here (too long for the pool or the context)."""
        if request.max_tokens > self.slots.max_context:
            return (
                f"prompt ({request.prompt_len}) + max_new_tokens ({request.params.max_new_tokens}) "
                f"exceeds the context of {self.slots.max_context} tokens"
            )
        if request.pages_needed(self.page_size) > self.kv.pages.num_pages:
            return f"the request needs more KV than the pool holds ({self.kv.pool_tokens} tokens)"
        return None

    def _admit(self, request: Request) -> bool:
        receiving = request.room is not None and self.receives_kv
        nodes = [] if receiving else self.radix.match(request.input_ids)
        if len(nodes) * self.page_size >= request.prompt_len:
            nodes = nodes[:-1]  # recompute the last prompt page: its logits are needed
        need = request.pages_needed(self.page_size) - len(nodes)
        if need > self.kv.pages.num_free:
            self.radix.lock(nodes)  # do not evict what this request is about to use
            self.radix.evict(need - self.kv.pages.num_free)
            self.radix.unlock(nodes)
        pages = self.kv.pages.allocate(need)
        slot = self.slots.allocate() if pages is not None else None
        if pages is None or slot is None:
            if pages is not None:
                self.kv.pages.free(pages)
            return False
        self.radix.lock(nodes)
        request.cached_nodes = nodes
        request.cached_tokens = request.computed = len(nodes) * self.page_size
        request.pages = pages
        request.slot = slot
        all_pages = [n.page for n in nodes] + pages
        rows = self.kv.rows(all_pages, request.max_tokens)
        self.slots.table[slot, : rows.numel()] = rows
        request.phase = Phase.TRANSFER if receiving else Phase.PREFILL
        self.running.append(request)
        if receiving:
            self.admitted_transfers.append(request)
        return True

    def next_batch(self) -> list[tuple[Request, Piece]]:
        """The pieces of the next forward, in a stable order (running first)."""
        batch: list[tuple[Request, Piece]] = []
        budget = self.budget.prefill_tokens
        for request in self.running:
            if request.phase is Phase.DECODE:
                batch.append((request, self._decode_piece(request)))
        for request in self.running:
            if request.phase is Phase.PREFILL and budget > 0:
                piece = self._prefill_piece(request, budget)
                budget -= piece.tokens.numel()
                batch.append((request, piece))
        while self.waiting and budget > 0 and len(self.running) < self.budget.max_running:
            request = self.waiting[0]
            if request.aborted:
                self.waiting.popleft()
                continue
            if not self._admit(request):
                break
            self.waiting.popleft()
            if request.phase is Phase.TRANSFER:
                continue  # its KV comes from prefill: no compute until it has arrived
            piece = self._prefill_piece(request, budget)
            budget -= piece.tokens.numel()
            batch.append((request, piece))
        return batch

    def _rows(self, request: Request, end: int) -> torch.Tensor:
        assert request.slot is not None
        return self.slots.table[request.slot, :end].clone()

    def _prefill_piece(self, request: Request, budget: int) -> Piece:
        start = request.computed
        end = min(request.prompt_len, start + budget)
        if end < request.prompt_len:  # chunk boundaries on pages keep KV rows page-aligned
            end = max(start + 1, end - end % self.page_size)
        tokens = torch.tensor(request.input_ids[start:end], dtype=torch.int64)
        embeds = tuple(
            (max(at, start) - start, rows[max(start - at, 0) : end - at])
            for at, rows in request.embeds
            if at < end and at + rows.shape[0] > start  # the part inside this chunk
        )
        rows = self._rows(request, end)
        return Piece(tokens, start, rows, want_logits=end == request.prompt_len, embeds=embeds)

    def _decode_piece(self, request: Request) -> Piece:
        position = request.prompt_len + len(request.output_ids) - 1
        tokens = torch.tensor([request.output_ids[-1]], dtype=torch.int64)
        return Piece(tokens, position, self._rows(request, position + 1))

    def release(self, request: Request, cache: bool = True) -> None:
        """Give back the request's slot and pages; its computed full pages go to the cache."""
        if request in self.running:
            self.running.remove(request)
        if request.slot is None:
            return
        own_pages = list(request.pages)
        if cache and request.computed > 0:
            all_pages = [n.page for n in request.cached_nodes] + own_pages
            full = request.computed // self.page_size
            tokens = request.all_ids[: full * self.page_size]
            leftover = self.radix.insert(tokens, all_pages[:full])
            taken = set(all_pages[:full]) - set(leftover)
            own_pages = [p for p in own_pages if p not in taken]
        self.radix.unlock(request.cached_nodes)
        request.cached_nodes = []
        self.kv.pages.free(own_pages)
        request.pages = []
        self.slots.free(request.slot)
        request.slot = None

    def fence(self, request: Request) -> None:
        """Take the request out of the running set, keeping its pages, locks and slot
        until `unfence` (its room's KV may still be moving)."""
        assert request.room is not None, "only a PD request's pages are fenced"
        if request in self.running:
            self.running.remove(request)
        self.fenced[request.room] = request

    def unfence(self, room: int) -> bool:
        """No one can touch `room`'s pages any more: release them (never cached: their
        KV is not known to be whole). False when the room was not fenced."""
        request = self.fenced.pop(room, None)
        if request is None:
            return False
        self.release(request, cache=False)
        return True

    @property
    def num_fenced_pages(self) -> int:
        return sum(len(request.pages) for request in list(self.fenced.values()))

    def prompt_pages(self, request: Request) -> list[int]:
        """Pages holding the request's prompt, in token order."""
        pages = [n.page for n in request.cached_nodes] + request.pages
        return pages[: -(-request.prompt_len // self.page_size)]
