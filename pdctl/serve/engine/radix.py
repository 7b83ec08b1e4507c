"""Prefix cache over page-aligned token prefixes (a radix tree with one page per edge).

A node stands for one full page of KV: the tokens of that page are its key under
its parent. Requests lock the nodes they read (a reference count); unlocked leaves
are evicted least recently used first; `flush` evicts everything unlocked. The
cache owns the pages of its nodes and gives them back to the allocator on eviction.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pdctl.serve.engine.kv_pool import PageAllocator


@dataclass(eq=False)
class Node:
    page: int
    parent: Node | None
    key: tuple[int, ...]
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    locks: int = 0
    last_use: int = 0


class RadixCache:
    def __init__(self, pages: PageAllocator, page_size: int, enabled: bool = True) -> None:
        self.pages = pages
        self.page_size = page_size
        self.enabled = enabled
        self.root = Node(-1, None, ())
        self.clock = itertools.count(1)
        self.num_cached_pages = 0

    def _keys(self, tokens: list[int]) -> list[tuple[int, ...]]:
        full = len(tokens) // self.page_size
        return [tuple(tokens[i * self.page_size : (i + 1) * self.page_size]) for i in range(full)]

    def match(self, tokens: list[int]) -> list[Node]:
        """Nodes of the longest cached page-aligned prefix of `tokens` (not locked)."""
        if not self.enabled:
            return []
        found = []
        node = self.root
        now = next(self.clock)
        for key in self._keys(tokens):
            child = node.children.get(key)
            if child is None:
                break
            child.last_use = now
            found.append(child)
            node = child
        return found

    def lock(self, nodes: list[Node]) -> None:
        for node in nodes:
            node.locks += 1

    def unlock(self, nodes: list[Node]) -> None:
        for node in nodes:
            if node.locks <= 0:
                raise ValueError("unlocking a radix node that is not locked")
            node.locks -= 1

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Cache the full pages of `tokens` (stored in `pages`).

        Returns the pages the cache did not take (their prefix was already cached),
        which the caller must free.
        """
        keys = self._keys(tokens)
        if not self.enabled:
            return list(pages)
        leftover: list[int] = []
        node = self.root
        now = next(self.clock)
        for key, page in zip(keys, pages, strict=False):
            child = node.children.get(key)
            if child is None:
                child = Node(page, node, key, last_use=now)
                node.children[key] = child
                self.num_cached_pages += 1
            elif child.page != page:
                leftover.append(page)
            child.last_use = now
            node = child
        return leftover

    def evictable(self) -> int:
        return sum(1 for node in self._nodes() if node.locks == 0)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages from unlocked leaves, least recently used first;
        a parent whose last child went is a leaf from then on. The pages go back to the
        allocator together, in ascending order (`PageAllocator`: the next request gets
        them as runs).

        One walk of the tree, then a heap of the leaves: a long cached chain has one
        leaf at a time, and finding each anew cost a walk per page, on the scheduler's
        thread at a request's admission (128 pages evicted from a chain of 8,192 took
        190-220 ms that way, 2-3 ms this way, timing `evict` alone on the CPU)."""
        order = itertools.count()  # ties by age of entry, never by comparing nodes
        leaves = [
            (node.last_use, next(order), node)
            for node in self._nodes()
            if not node.children and node.locks == 0
        ]
        heapq.heapify(leaves)
        freed: list[int] = []
        while len(freed) < num_pages and leaves:
            leaf = heapq.heappop(leaves)[2]
            parent = leaf.parent
            freed.append(self._remove(leaf))
            if parent not in (None, self.root) and not parent.children and not parent.locks:
                heapq.heappush(leaves, (parent.last_use, next(order), parent))
        self.pages.free(sorted(freed))
        return len(freed)

    def flush(self) -> int:
        """Evict every unlocked page; returns how many were freed."""
        return self.evict(self.num_cached_pages)

    def _remove(self, node: Node) -> int:
        """Take a leaf out of the tree; its page is the caller's to free."""
        assert node.parent is not None and not node.children
        del node.parent.children[node.key]
        self.num_cached_pages -= 1
        return node.page

    def _nodes(self) -> list[Node]:
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found
