"""Page accounting and the prefix cache: a state machine that must always balance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdctl.serve.engine.kv_pool import PageAllocator
from pdctl.serve.engine.radix import RadixCache

PAGE = 4


def test_page_allocator_refuses_double_free_and_overdraw() -> None:
    pages = PageAllocator(4)
    got = pages.allocate(3)
    assert got == [0, 1, 2] and pages.allocate(2) is None
    pages.free(got)
    with pytest.raises(ValueError, match="already free"):
        pages.free([1])


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.booleans(), st.integers(0, 9), st.randoms(use_true_random=False)),
        max_size=40,
    )
)
def test_page_allocator_hands_out_pages_in_the_order_they_were_freed(steps) -> None:  # type: ignore[no-untyped-def]
    """Lowest first at the start, then the least recently freed first (a page just
    freed goes out after every other free page), and no page held twice."""
    pages = PageAllocator(32)
    queue = list(range(32))  # the free pages, in the order they go out
    for allocating, count, order in steps:
        if allocating:
            got = pages.allocate(count)
            if count > len(queue):
                assert got is None
                continue
            assert got == queue[:count]
            queue = queue[count:]
        else:  # give back `count` held pages in an arbitrary order
            held = sorted(set(range(32)) - set(queue))
            back = order.sample(held, min(count, len(held)))
            pages.free(back)
            queue += back
        assert pages.num_free == len(queue)


def test_pages_a_prefix_cache_evicts_come_back_as_runs() -> None:
    """The cache evicts a chain's last page first, but gives the pages back together in
    ascending order: the next request gets runs of consecutive pages (one transfer
    range per run, not per page)."""
    pages = PageAllocator(8)
    cache = RadixCache(pages, PAGE)
    first = pages.allocate(8) or []
    cache.insert(list(range(8 * PAGE)), first)
    assert cache.evict(8) == 8
    assert pages.allocate(8) == list(range(8))  # not 7, 6, ..., 0


def test_eviction_takes_the_least_recently_used_leaf_each_time() -> None:
    """Two cached chains, A used before B: A goes first, deepest page first, and a page
    becomes a leaf (and goes) once its child went; B's pages wait for A's."""
    pages = PageAllocator(16)
    cache = RadixCache(pages, PAGE)
    chain_a, chain_b = pages.allocate(3) or [], pages.allocate(3) or []
    cache.insert(list(range(3 * PAGE)), chain_a)
    cache.insert(list(range(100, 100 + 3 * PAGE)), chain_b)

    def cached() -> set[int]:
        return {node.page for node in cache._nodes()}

    assert cache.evict(1) == 1 and cached() == {*chain_a[:2], *chain_b}
    assert cache.evict(2) == 2 and cached() == set(chain_b)  # A's first page before B's last
    assert cache.evict(10) == 3 and cached() == set()


def test_match_insert_and_leftovers() -> None:
    pages = PageAllocator(16)
    cache = RadixCache(pages, PAGE)
    first = pages.allocate(3) or []
    tokens = list(range(12))
    assert cache.insert(tokens, first) == []
    assert [n.page for n in cache.match([*tokens, 99])] == first
    duplicate = pages.allocate(2) or []
    assert cache.insert(tokens[:8], duplicate) == duplicate  # already cached: caller frees
    assert cache.match([0, 1, 2]) == []  # shorter than a page


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pages = PageAllocator(24)
        self.cache = RadixCache(self.pages, PAGE)
        self.held: list[list[int]] = []  # pages requests own
        self.locks: list[list] = []

    @rule(tokens=st.lists(st.integers(0, 2), min_size=PAGE, max_size=4 * PAGE))
    def run_request(self, tokens: list[int]) -> None:
        nodes = self.cache.match(tokens)
        self.cache.lock(nodes)
        need = len(tokens) // PAGE - len(nodes)
        if need > self.pages.num_free:
            self.cache.evict(need - self.pages.num_free)
        own = self.pages.allocate(need)
        if own is None:
            self.cache.unlock(nodes)
            return
        all_pages = [n.page for n in nodes] + own
        leftover = self.cache.insert(tokens, all_pages)
        self.pages.free([p for p in own if p in leftover])
        self.locks.append(nodes)

    @precondition(lambda self: self.locks)
    @rule(pick=st.integers(0, 100))
    def finish_request(self, pick: int) -> None:
        self.cache.unlock(self.locks.pop(pick % len(self.locks)))

    @rule(count=st.integers(1, 8))
    def evict(self, count: int) -> None:
        """Every unlocked page can go (a locked node's ancestors are locked), so exactly
        as many as asked or as are unlocked go, and no locked page."""
        locked = {node.page for nodes in self.locks for node in nodes}
        unlocked = self.cache.evictable()
        assert self.cache.evict(count) == min(count, unlocked)
        assert locked <= {node.page for node in self.cache._nodes()}

    @invariant()
    def pages_balance(self) -> None:
        assert self.pages.num_free + self.cache.num_cached_pages == self.pages.num_pages

    def teardown(self) -> None:
        for nodes in self.locks:
            self.cache.unlock(nodes)
        self.cache.flush()
        assert self.pages.num_free == self.pages.num_pages and self.cache.num_cached_pages == 0


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
