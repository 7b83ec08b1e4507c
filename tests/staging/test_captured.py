"""Staging calls replayed from graphs (`kernels.captured`): the cache's rules on the CPU
with a stand-in capture (which runs the captured call on the ids its slot holds), and
real CUDA graphs on a GPU, each replay bitwise the eager call it replaces."""

from __future__ import annotations

import functools
import gc
import logging
import weakref
from typing import Any

import numpy as np
import pytest
import torch

from pdctl.staging import kernels
from pdctl.staging.kernels import KVSlice, captured, native
from pdctl.staging.kernels.base import BufferCache, keeping
from pdctl.staging.kernels.captured import CapturedCalls, Eager
from pdctl.staging.kernels.pages import host_ids
from pdctl.staging.settings import StagingSettings
from tests.staging.kv_factory import as_bits, naive_gather, random_kv, random_pages

PAGE, POOL_PAGES, COUNT = 4, 32, 6
HEADS = KVSlice(1, 1, PAGE)  # the second of two heads


class FakeSlot:
    """Replays run the captured call on the slot's ids; `log` records the order of
    waits, writes (seen as replays) and replays."""

    def __init__(self, index: int, num_ids: int, eager: Eager, log: list[Any]) -> None:
        self.index, self.eager, self.log = index, eager, log
        self.ids = torch.zeros(num_ids, dtype=torch.int64)
        self.armed = False

    def replay(self, given: Any = None) -> Any:
        self.log.append(("replay", self.index, self.ids.clone()))
        value = self.eager(self.ids.clone())
        return value if given is None else (value, given)

    def wait(self) -> None:
        self.log.append(("wait", self.index))

    def replay_checked(self, address: int, num_pages: int) -> bool:
        """As a CUDA slot's one C call does it: waited for, the ids checked and written
        to the slot (by the same C check), replayed; refused ids launch nothing."""
        self.wait()
        found = native.check_at(address, len(self.ids), num_pages, self.ids.data_ptr())
        if found is None or found[0] >= 0:
            return False
        self.value = self.replay()
        return True


def fake_capture(log: list[Any], fail: bool = False):  # type: ignore[no-untyped-def]
    def capture(
        device: torch.device, num_ids: int, eager: Eager, first: Any, settings: StagingSettings
    ) -> list[Any]:
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        log.append(("capture", num_ids))
        return [FakeSlot(i, num_ids, eager, log) for i in range(captured.SLOTS)]

    return capture


def setup(seed: int = 0):  # type: ignore[no-untyped-def]
    k, v = random_kv(3, POOL_PAGES * PAGE, 2, 16, torch.bfloat16, seed)
    staging = torch.empty(2 * 3 * COUNT * PAGE * 16 * 2, dtype=torch.uint8)
    return k, v, staging


def gather_via(calls: CapturedCalls, k, v, staging, pages, counter: list[int]) -> int:  # type: ignore[no-untyped-def]
    def eager(ids: Any) -> int:
        counter[0] += 1
        return kernels.gather_slice(k, v, ids, staging, HEADS, "torch")  # eager: staging on the CPU

    def host(into: torch.Tensor | None) -> torch.Tensor:
        return host_ids(k, v, pages, PAGE, into)

    key = ("gather", id(k), id(v), staging.data_ptr(), staging.numel(), len(pages))
    return calls.arm(key, (k, v), staging.device, host, eager, pages)()


def test_a_shape_is_captured_on_its_sights_then_replayed_with_each_calls_ids() -> None:
    log: list[Any] = []
    calls = CapturedCalls(capture=fake_capture(log), sights=2)
    k, v, staging = setup()
    counter = [0]
    for step in range(10):
        pages = random_pages(POOL_PAGES, COUNT, seed=step).tolist()
        nbytes = gather_via(calls, k, v, staging, pages, counter)
        expected = naive_gather(k, v, torch.tensor(pages), PAGE, 1, 1)
        got = staging[:nbytes].view(expected.dtype).view(expected.shape)
        assert torch.equal(got, expected), step
    # sights 1 and 2 eager, the third eagerly then captured, seven replays
    assert [entry[0] for entry in log].count("capture") == 1
    assert calls.captures == 1 and calls.replays == 7
    replays = [entry for entry in log if entry[0] == "replay"]
    assert [entry[1] for entry in replays] == [0, 1, 2, 3, 0, 1, 2]  # the ring in turn
    for position, entry in enumerate(log):  # each slot waited for before its ids change
        if entry[0] == "replay":
            assert log[position - 1] == ("wait", entry[1])


def test_other_kv_lists_or_staging_or_a_failed_capture_go_the_eager_way(caplog) -> None:  # type: ignore[no-untyped-def]
    log: list[Any] = []
    calls = CapturedCalls(capture=fake_capture(log, fail=True), sights=1)
    k, v, staging = setup()
    counter = [0]
    pages = random_pages(POOL_PAGES, COUNT, seed=3).tolist()
    with caplog.at_level(logging.WARNING, logger="pdctl.staging"):
        for _ in range(4):
            gather_via(calls, k, v, staging, pages, counter)
    assert counter[0] == 4 and calls.replays == 0  # the capture failed once, then eager
    assert "could not be captured" in caplog.text
    # the same list object with another tensor in it is another shape (checked again)
    good = CapturedCalls(capture=fake_capture(log), sights=1)
    counter = [0]
    for _ in range(3):
        gather_via(good, k, v, staging, pages, counter)
    assert good.replays == 1
    k[0] = k[0].clone()
    gather_via(good, k, v, staging, pages, counter)
    assert good.replays == 1 and counter[0] == 4  # eager (replays run it too): other buffers


def replaying(calls: CapturedCalls, seed: int):  # type: ignore[no-untyped-def]
    """A gather seen, captured and replayed once: (k, v, staging, pages, counter)."""
    k, v, staging = setup()
    counter = [0]
    pages = random_pages(POOL_PAGES, COUNT, seed=seed).tolist()
    for _ in range(3):
        gather_via(calls, k, v, staging, pages, counter)
    assert calls.replays == 1
    return k, v, staging, pages, counter


def test_a_replay_checks_the_ids_as_the_eager_call_does() -> None:
    calls = CapturedCalls(capture=fake_capture([]), sights=1)
    k, v, staging, pages, counter = replaying(calls, seed=5)
    with pytest.raises(ValueError, match="appears more than once"):
        gather_via(calls, k, v, staging, [pages[0]] * COUNT, counter)
    with pytest.raises(ValueError, match="outside the pool"):
        gather_via(calls, k, v, staging, [POOL_PAGES + 1, *pages[1:]], counter)
    # ids as a replay's usual tensor (int64, contiguous) take the short way to the C
    # check; what it refuses still gets the eager call's words
    bad_ids = ([pages[0]] * COUNT, [-1, *pages[1:]], [*pages[:-1], POOL_PAGES])
    for bad, message in zip(bad_ids, ("more than once", "outside", "outside"), strict=True):
        with pytest.raises(ValueError, match=message):
            gather_via(calls, k, v, staging, torch.tensor(bad, dtype=torch.int64), counter)
    assert calls.replays == 1
    good = torch.tensor(list(reversed(pages)), dtype=torch.int64)
    nbytes = gather_via(calls, k, v, staging, good, counter)
    assert calls.replays == 2
    expected = naive_gather(k, v, good, PAGE, 1, 1)
    assert torch.equal(staging[:nbytes].view(expected.dtype).view(expected.shape), expected)


def test_usual_ids_replay_in_one_go_and_what_cannot_goes_the_armed_way() -> None:
    """`replay_usual`: a captured shape's next slot checks, writes and replays a
    replay's usual ids (int64, contiguous, on the host) in one go; a shape not yet
    captured, other tensors, an armed slot or an id refused give MISSED (nothing
    launched), and the armed way then names what is wrong."""
    if not native.available()[0]:
        pytest.skip(f"the C check is not built here: {native.available()[1]}")
    log: list[Any] = []
    calls = CapturedCalls(capture=fake_capture(log), sights=1)
    k, v, staging = setup()
    counter = [0]
    key = ("gather", id(k), id(v), staging.data_ptr(), staging.numel(), COUNT)
    first = torch.tensor(random_pages(POOL_PAGES, COUNT, seed=1).tolist(), dtype=torch.int64)
    assert calls.replay_usual(key, (k, v), first.data_ptr(), POOL_PAGES) is captured.MISSED
    for _ in range(2):  # seen, then captured (sights=1)
        gather_via(calls, k, v, staging, first.tolist(), counter)
    replayed = calls.replays
    for step in range(2 * captured.SLOTS):  # around the ring twice
        ids = torch.tensor(random_pages(POOL_PAGES, COUNT, seed=20 + step).tolist())
        nbytes = calls.replay_usual(key, (k, v), ids.data_ptr(), POOL_PAGES)
        expected = naive_gather(k, v, ids, PAGE, 1, 1)
        got = staging[:nbytes].view(expected.dtype).view(expected.shape)
        assert torch.equal(got, expected), step
    assert calls.replays - replayed == 2 * captured.SLOTS
    waits = [entry[1] for entry in log if entry[0] == "wait"]
    assert waits[-2 * captured.SLOTS :] == [*range(captured.SLOTS)] * 2  # the ring in turn
    log.clear()
    pages = random_pages(POOL_PAGES, COUNT, seed=3).tolist()
    for bad, message in (([pages[0]] * COUNT, "more than once"), ([-1, *pages[1:]], "outside")):
        ids = torch.tensor(bad, dtype=torch.int64)
        assert calls.replay_usual(key, (k, v), ids.data_ptr(), POOL_PAGES) is captured.MISSED
        with pytest.raises(ValueError, match=message):
            gather_via(calls, k, v, staging, ids, counter)
    assert not [entry for entry in log if entry[0] == "replay"]  # nothing launched
    good = torch.tensor(pages, dtype=torch.int64)
    others = [t.clone() for t in k]  # other tensors under the same key
    assert calls.replay_usual(key, (others, v), good.data_ptr(), POOL_PAGES) is captured.MISSED
    usual = lambda: calls.replay_usual(key, (k, v), good.data_ptr(), POOL_PAGES)  # noqa: E731
    host = lambda into: host_ids(k, v, pages, PAGE, into)  # noqa: E731
    armed = calls.arm(key, (k, v), staging.device, host, lambda ids: 0, pages)
    for _ in range(captured.SLOTS - 1):  # the other slots of the ring
        assert usual() is not captured.MISSED
    assert usual() is captured.MISSED  # the armed slot's turn: not launched yet
    armed()
    assert usual() is not captured.MISSED


def test_armed_calls_launch_later_each_with_its_own_ids() -> None:
    """`arm` does the host work now, the launch later (on another thread in a server):
    a slot armed and not yet launched is never armed again, that call goes eager."""
    log: list[Any] = []
    calls = CapturedCalls(capture=fake_capture(log), sights=1)
    k, v = random_kv(3, POOL_PAGES * PAGE, 2, 16, torch.bfloat16, 0)
    stagings = [torch.empty(2 * 3 * COUNT * PAGE * 16 * 2, dtype=torch.uint8) for _ in range(2)]
    counter = [0]
    key = ("gather", id(k), id(v), COUNT)

    def arm(pages: list[int], staging: torch.Tensor):  # type: ignore[no-untyped-def]
        def eager(ids: Any) -> torch.Tensor:
            counter[0] += 1
            kernels.gather_slice(k, v, ids, staging, HEADS, "torch")  # eager: staging on the CPU
            return staging.clone()

        host = lambda into: host_ids(k, v, pages, PAGE, into)  # noqa: E731
        return calls.arm(key, (k, v), staging.device, host, eager, pages)

    for seed in range(2):  # the shape seen, then captured
        arm(random_pages(POOL_PAGES, COUNT, seed=seed).tolist(), stagings[0])()
    lists = [
        random_pages(POOL_PAGES, COUNT, seed=10 + i).tolist() for i in range(captured.SLOTS + 2)
    ]
    armed = [arm(pages, stagings[0]) for pages in lists]  # more than the ring holds
    eager_before = counter[0]
    results = [launch() for launch in armed]
    assert calls.replays == captured.SLOTS  # the rest went eager: their slot was armed
    assert counter[0] - eager_before == 2 + captured.SLOTS  # replays run the eager call too
    for pages, got in zip(lists, results, strict=True):
        expected = naive_gather(k, v, torch.tensor(pages), PAGE, 1, 1)
        assert torch.equal(
            got[: expected.numel() * 2].view(expected.dtype).view(expected.shape), expected
        )


def test_a_dropped_shape_waits_for_its_replays_first(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Its graphs, ids and memory go with it: a shape evicted (least recently used) or
    replaced (its key naming other tensors) waits until the device passed every slot."""
    monkeypatch.setattr(captured, "MAX_SHAPES", 1)
    log: list[Any] = []
    calls = CapturedCalls(capture=fake_capture(log), sights=1)
    k, v, staging, pages, counter = replaying(calls, seed=3)
    log.clear()
    other = torch.empty_like(staging)  # another shape: the first is evicted
    gather_via(calls, k, v, other, pages, counter)
    assert [entry for entry in log if entry[0] == "wait"] == [
        ("wait", i) for i in range(captured.SLOTS)
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize(
    "settings",
    [
        StagingSettings(),
        StagingSettings(upload_ahead=False, upload_kernel=False),
        StagingSettings(upload_ahead=False, upload_kernel=True),
        StagingSettings(replay_in_c=False),
    ],
    ids=["upload-ahead", "copy-node", "upload-kernel", "one-by-one"],
)
def test_cuda_replays_are_bitwise_the_eager_calls(settings: StagingSettings, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # the wrappers' cache, with these switches, for this test only
    monkeypatch.setattr(kernels, "CAPTURED", CapturedCalls(settings=settings))
    device = torch.device("cuda", 0)
    k, v = random_kv(5, 256 * PAGE, 4, 64, torch.bfloat16, seed=7, device=device)
    k2, v2 = random_kv(5, 256 * PAGE, 2, 64, torch.bfloat16, seed=8, device=device)
    staging = torch.empty(2 * 5 * 40 * PAGE * 2 * 64 * 2, dtype=torch.uint8, device=device)
    replays = kernels.CAPTURED.replays
    gathered, scattered, expected = [], [], []
    for step in range(12):  # back to back: the ring's slots are rewritten while queued
        pages = random_pages(256, 40, seed=step).pin_memory()
        dst = random_pages(256, 40, seed=100 + step).tolist()
        nbytes = kernels.gather_all_layers_to_staging(
            k, v, pages, staging, src_head_start=2, num_heads=2, page_size=PAGE
        )
        gathered.append(staging[:nbytes].clone())
        kernels.scatter_staging_to_kv(
            staging, k2, v2, dst, page_size=PAGE, dst_head_start=0, num_heads=2
        )
        scattered.append([as_bits(t).clone() for pair in zip(k2, v2, strict=True) for t in pair])
        expected.append((naive_gather(k, v, pages.to(device), PAGE, 2, 2), dst))
    torch.cuda.synchronize()
    assert kernels.CAPTURED.replays - replays >= 2 * (12 - captured.SIGHTS - 1)
    repeated = random_pages(256, 40, seed=1)  # a replay's usual ids (int64, host), refused
    repeated[7] = repeated[3]
    with pytest.raises(ValueError, match=f"page index {int(repeated[3])} appears more than once"):
        kernels.gather_all_layers_to_staging(
            k, v, repeated, staging, src_head_start=2, num_heads=2, page_size=PAGE
        )
    for step, (want, dst) in enumerate(expected):
        assert torch.equal(gathered[step].view(want.dtype).view(want.shape), want), step
        rows = torch.tensor([p * PAGE + t for p in dst for t in range(PAGE)], device=device)
        for layer, landed in enumerate(scattered[step]):
            # buffer `layer` in K0, V0, K1, ... order: its [tokens, heads, dim] bits
            assert torch.equal(landed[rows], want[layer]), (step, layer)


def test_what_caches_hand_out_during_a_capture_is_kept_with_it() -> None:
    """A captured graph reads the pointer tables its kernels were given: while the
    graph lives they must, whatever the caches evict meanwhile."""
    cache = BufferCache(lambda buffers: torch.tensor([b.data_ptr() for b in buffers]), size=1)
    first, second = [torch.zeros(2)], [torch.zeros(2)]
    outside = cache.get(first)
    with keeping() as kept:
        table = cache.get(first)
        inner = cache.get(second)  # evicts `first`'s entry (size 1)
    assert table is outside and kept == [table, inner]
    assert cache.get(first) is not table  # rebuilt: only `kept` holds the old one now
    cache.get(second)
    assert kept == [table, inner]  # nothing handed out after the block is added


def test_the_upload_kernel_refuses_what_it_cannot_read() -> None:
    """Only page-locked host ids of the target's length and dtype: anything else would
    read memory the device cannot reach, or past the ids."""
    from pdctl.staging.kernels.upload import upload

    with pytest.raises(ValueError, match=r"upload of 4 torch\.int64 ids into 3"):
        upload(torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"into 4 torch\.int32"):
        upload(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="page-locked"):
        upload(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))


def test_what_an_arm_gives_reaches_its_replay_and_checked_ids_go_as_they_are() -> None:
    """`arm(given=...)`: a replay's slot makes its value from what its own arm gave (a
    write's words), the eager calls before the capture knowing it already;
    `checked_ids` hands ids checked when they were made to a slot unchanged."""
    log: list[Any] = []
    calls: CapturedCalls[Any] = CapturedCalls(capture=fake_capture(log), sights=1)
    key = ("given",)
    named = ([torch.zeros(1)],)
    values = []
    for seed in range(4):
        ids = np.arange(6, dtype=np.int64) + seed
        host = functools.partial(captured.checked_ids, ids)
        eager = lambda ids: int(torch.as_tensor(ids).sum())  # noqa: E731
        values.append(calls.arm(key, named, torch.device("cpu"), host, eager, ids, given=seed)())
    sums = [int(np.arange(6).sum()) + 6 * seed for seed in range(4)]
    assert values[:2] == sums[:2]  # seen, then captured after an eager call
    assert values[2:] == [(sums[2], 2), (sums[3], 3)]  # replays: their own ids and given
    assert calls.replays == 2
    into = torch.full((6,), -1, dtype=torch.int64)
    ids = np.arange(6, dtype=np.int64)
    assert captured.checked_ids(ids, into) is into and into.tolist() == ids.tolist()
    assert captured.checked_ids(ids, None).tolist() == ids.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_captured_slot_goes_with_its_last_reference() -> None:
    """A slot holds nothing that holds it (a bound method, a closure over it): dropped,
    it goes at once, with its graph and pinned memory, never at a later collection in
    the middle of another shape's capture. A write's slot makes each replay's digests
    from its arm's words."""
    from pdctl.staging.kernels import PendingDigests
    from pdctl.staging.kernels.write_slots import WriteSlot

    device = torch.device("cuda", 0)

    def eager(ids: torch.Tensor) -> PendingDigests:
        return PendingDigests(ids * 2, [8], 1)

    with torch.cuda.device(device):  # cuda-only: graphs are CUDA's
        pool = torch.cuda.graph_pool_handle()  # cuda-only: graphs are CUDA's
    slot = WriteSlot(device, 8, eager, pool, 8, StagingSettings())
    slot.ids.copy_(torch.arange(8))
    pending = slot.replay([3])
    torch.cuda.synchronize()
    assert pending.words == [3] and slot.last is pending
    assert pending.host is not None and pending.host.tolist() == list(range(0, 16, 2))
    gone = weakref.ref(slot)
    gc.disable()
    try:
        del slot, pending
        assert gone() is None
    finally:
        gc.enable()
