"""Paged KV storage: one allocation for every layer's K and V, pages, and req_to_token.

    kv                [layers, 2 (K, V), pool_tokens, local_kv_heads, head_dim]
    k_buffers[l]      kv[l, 0]   [pool_tokens, local_kv_heads, head_dim]
    pool row of token = page * page_size + offset in page
    req_to_token      [max_requests, max_context] pool rows of each request's tokens

    pages             0 .. num_pages - 2 for requests | num_pages - 1: scratch (no owner)

The last page is never handed out: its first row (`scratch_row`) is where the padding
pieces of a captured decode step (`model/graphs.py`) write their K and V, so padding
can never touch a request's KV. The model is given the row, never the page.

`PageAllocator` and `ReqToToken` are plain managers (no I/O, no device work beyond
owning tensors); the scheduler decides who gets what.
"""

from __future__ import annotations

from collections import deque

import torch


class PageAllocator:
    """Free pages, handed out in the order they were freed (lowest first at the start);
    freeing returns them.

    A page just freed goes out last, after every other free page. That is no fence: in a
    pool nearly full it goes out again at once, so the pages of a request whose KV may
    still be moving are not freed here until no writer can touch them (the scheduler's
    `fence`). Callers that free many pages at once give them in ascending order
    (`RadixCache.evict`), so the request that gets them next gets runs of consecutive
    pages, which a direct transfer sends as one range each
    (`staging.descriptors.page_runs`). Evicted pages used to come back one by one in
    descending order, and a 2,048-token request went as 4,096 ranges: NIXL's write of
    it took 20 ms a request against 3.7 ms as runs on an H200 (`pdctl bench pd
    topologies/cuda-1gpu-p1d1-tcp.yaml --backends nixl --prompt-len 2048`, its write
    ms)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._free_set = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(count)]
        self._free_set.difference_update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page in self._free_set or not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} is already free or does not exist")
            self._free.append(page)
            self._free_set.add(page)


class KVPool:
    def __init__(
        self,
        num_layers: int,
        pool_tokens: int,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if pool_tokens % page_size:
            raise ValueError(
                f"pool of {pool_tokens} tokens is not a whole number of {page_size}-token pages"
            )
        if pool_tokens < 2 * page_size:
            raise ValueError(
                f"a pool of {pool_tokens} tokens is less than two {page_size}-token pages "
                "(one for requests, one scratch page)"
            )
        self.page_size = page_size
        self.kv = torch.zeros(
            num_layers, 2, pool_tokens, kv_heads, head_dim, dtype=dtype, device=device
        )
        self.k_buffers = [self.kv[layer, 0] for layer in range(num_layers)]
        self.v_buffers = [self.kv[layer, 1] for layer in range(num_layers)]
        scratch_page = pool_tokens // page_size - 1
        self.pages = PageAllocator(scratch_page)  # every page but the scratch page
        self.scratch_row = scratch_page * page_size  # padding rows' K and V land here

    @property
    def pool_tokens(self) -> int:
        return self.kv.shape[2]

    def rows(self, pages: list[int], num_tokens: int) -> torch.Tensor:
        """Pool rows of the first `num_tokens` tokens stored in `pages`."""
        page_tensor = torch.tensor(pages, dtype=torch.int64)
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (page_tensor[:, None] * self.page_size + offsets).reshape(-1)[:num_tokens]


class ReqToToken:
    """Slots of running requests; each slot maps token positions to pool rows."""

    def __init__(self, max_requests: int, max_context: int) -> None:
        self.table = torch.zeros(max_requests, max_context, dtype=torch.int64)
        self._free = deque(range(max_requests))

    @property
    def max_context(self) -> int:
        return self.table.shape[1]

    def allocate(self) -> int | None:
        return self._free.popleft() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)
