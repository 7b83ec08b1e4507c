"""Where a direct PD write's time goes: one request's KV pages into a peer's KV pool.

    python benchmarks/pd_write_profile.py [--device cuda] [--tokens 2048] [--scatter]

The shape is `pdctl bench pd`'s (the small preset: 16 layers, 8 KV heads x 128, bf16,
page 16; 2048 tokens are 128 MiB of KV). Prefill's pool is here, decode's pool is a
peer process's registered buffer on the same device, as `KVSender._direct` sees them.
Each row is a median of 30 (microseconds): building the descriptors, the page digests,
the transport's checks, the write with and without its notification, and a device
copy of the same bytes (the bound `pdctl bench pd` compares with), then the mapped
write's host time to enqueue, replayed from a CUDA graph and eager, alone and with a
thread contending for the GIL (as a server's HTTP side does). `--scatter`
shuffles the pages on both sides (no two pages adjacent: nothing merges).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from pdctl.staging import device as dev
from pdctl.staging.descriptors import KVRows, direct_descriptors, kv_bases
from pdctl.staging.kernels import PendingDigests, start_slice_digests
from pdctl.staging.kernels.page_write import PeerPages, start_slice_write
from pdctl.staging.layout import HeadSlice
from pdctl.staging.mapped import MappedPools
from pdctl.staging.transport import TransportConfig, create_transport
from pdctl.staging.transport.peer import PeerProcess

SECRET = b"profile"
LAYERS, HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16


def median_us(
    function: Callable[[], object],
    sync: Callable[[], None],
    repeats: int = 30,
    *,
    enqueue_only: bool = False,
) -> float:
    """One call's median time with the device drained (enqueue_only: the host's time to
    enqueue it, the drain outside the timing)."""
    for _ in range(3):
        function()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        if not enqueue_only:
            sync()
        times.append(time.perf_counter() - started)
        if enqueue_only:
            sync()
    return statistics.median(times) * 1e6


class Contender:
    """A thread that keeps wanting the GIL (pure Python work, as a server's HTTP side),
    so that every call releasing it pays for getting it back."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self.stop.is_set():
            sum(range(2000))

    def __enter__(self) -> Contender:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def device_us(device: torch.device, function: Callable[[], object], count: int = 10) -> float:
    """The device's own time per call: `count` calls queued behind a sleeping kernel
    (so host work never leaves the device idle), timed between two device events."""
    module = dev.get_device_module(device)
    function()
    module.synchronize()
    begin, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
    module._sleep(200_000_000)  # about 0.1 s of device cycles: the queue fills meanwhile
    begin.record()
    for _ in range(count):
        function()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--scatter", action="store_true", help="shuffle pages on both sides")
    parser.add_argument("--profile", action="store_true", help="cProfile of 50 sends")
    args = parser.parse_args()
    device = dev.resolve_device(args.device)
    num_pages = args.tokens // PAGE
    pool_pages = 2 * num_pages + 8
    pool_tokens = pool_pages * PAGE
    # [layers, 2 (K, V), pool_tokens, heads, head_dim], as KVPool
    shape = (LAYERS, 2, pool_tokens, HEADS, HEAD_DIM)
    kv = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16)
    kv = kv.view(torch.bfloat16).to(device)
    k_buffers = [kv[layer, 0] for layer in range(LAYERS)]
    v_buffers = [kv[layer, 1] for layer in range(LAYERS)]
    rng = np.random.default_rng(0)
    if args.scatter:
        src_pages = (rng.permutation(pool_pages // 2)[:num_pages] * 2).tolist()
        dst_pages = (rng.permutation(pool_pages // 2)[:num_pages] * 2 + 1).tolist()
    else:
        src_pages = list(range(3, 3 + num_pages))
        dst_pages = list(range(5, 5 + num_pages))
    buffer_bytes = pool_tokens * HEADS * HEAD_DIM * 2
    nbytes = 2 * LAYERS * args.tokens * HEADS * HEAD_DIM * 2
    piece = HeadSlice(0, 0, 0, HEADS)
    rows = KVRows(PAGE, HEAD_DIM * 2, HEADS, HEADS, piece)
    every_head, whole = piece.source(PAGE), [(0, num_pages)]  # one segment of every page
    sync = (lambda: dev.synchronize(device)) if device.type != "cpu" else (lambda: None)
    with PeerProcess("tcp", 2 * LAYERS * buffer_bytes, device=args.device, secret=SECRET) as peer:
        writer = create_transport("tcp", TransportConfig("profile", secret=SECRET))
        try:
            writer.register_tensor(kv)
            connection = writer.connect(peer.description)
            dst_bases = [peer.base + i * buffer_bytes for i in range(2 * LAYERS)]

            def descriptors() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
                return direct_descriptors(
                    kv_bases(k_buffers, v_buffers), dst_bases, src_pages, dst_pages, rows
                )

            src, dst, lengths = descriptors()

            def start_digests() -> PendingDigests:  # as the sender starts them
                return start_slice_digests(k_buffers, v_buffers, src_pages, whole, every_head)

            def digests() -> object:
                return start_digests().result()

            def digests_ten() -> object:  # ten launched back to back: the device's time
                pending = [start_digests() for _ in range(10)]
                return pending[-1].result()

            def send() -> None:  # what KVSender._direct does
                s, d, n = descriptors()
                found = digests()
                writer.write(connection, s, d, n, notify=repr(found).encode()[:60000])

            mapped = MappedPools(writer)

            def start_mapped() -> PendingDigests | None:  # what KVSender._mapped_write launches
                buffers = mapped.buffers(connection, dst_bases, HEADS, HEAD_DIM, k_buffers[0])
                if buffers is None:
                    return None
                into = PeerPages(buffers, dst_pages, 0)
                return start_slice_write(k_buffers, v_buffers, src_pages, into, whole, every_head)

            def mapped_send() -> None:  # the whole of KVSender._mapped_write
                pending = start_mapped()
                assert pending is not None
                found = [d for part in pending.result() for d in part]
                writer.notify(connection, repr(found).encode()[:60000])

            target = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
            source = torch.empty_like(target)
            table = {
                "descriptors (direct_descriptors)": descriptors,
                "page digests": digests,
                "page digests x10, one wait (/10 below)": digests_ten,
                "checks (_checked)": lambda: writer._checked(connection, src, dst, lengths, None),
                "write, no notification": lambda: writer.write(connection, src, dst, lengths),
                "write + notification": lambda: writer.write(
                    connection, src, dst, lengths, notify=b"x" * 2048
                ),
                "send (descriptors + digests + write + notify)": send,
                "device copy of the same bytes (the bound)": lambda: target.copy_(source),
            }
            probe = start_mapped()
            if probe is not None:  # the transport maps the peer's pool: one launch does it all
                assert probe.result() == start_digests().result(), "mapped write digests differ"
                table["mapped write: pages + digests, one launch, waited"] = lambda: (
                    start_mapped().result()  # type: ignore[union-attr]
                )
                table["mapped send (KVSender._mapped_write, notify included)"] = mapped_send
            print(
                f"{nbytes / (1 << 20):g} MiB of KV, {num_pages} pages of {PAGE} tokens, "
                f"{len(src)} descriptors, {'scattered' if args.scatter else 'contiguous'} pages, "
                f"{device}"
            )
            for name, function in table.items():
                each = median_us(function, sync) / (10 if "x10" in name else 1)
                print(f"  {name:<48} {each:9.1f} us", flush=True)
            if device.type == "cuda":
                from pdctl.staging.kernels.ranges import copy_ranges

                local = torch.empty(2 * LAYERS * buffer_bytes, dtype=torch.uint8, device=device)
                local_dst = dst - np.uint64(peer.base) + np.uint64(local.data_ptr())
                kernels = {
                    "page digest kernel": start_digests,
                    "ranges kernel (local target)": lambda: copy_ranges(
                        device, src, local_dst, lengths
                    ),
                    "device copy": lambda: target.copy_(source),
                }
                if probe is not None:
                    kernels["page write kernel (store + digests)"] = start_mapped
                print("  device time (queued behind a sleeping kernel):")
                for name, function in kernels.items():
                    print(f"    {name:<46} {device_us(device, function):9.1f} us", flush=True)
            if probe is not None:  # the enqueue alone: replayed from a graph, eager, contended
                from pdctl.staging.kernels import page_write
                from pdctl.staging.settings import StagingSettings

                sys.setswitchinterval(0.0005)  # as the PD servers run
                print("  mapped write, host time to enqueue (the device drained between calls):")
                for contended in (False, True):
                    for graphs in (True, False):
                        page_write.WRITES = page_write.WRITES.configured(
                            StagingSettings(graphs=graphs)
                        )
                        with Contender() if contended else contextlib.nullcontext():
                            each = median_us(start_mapped, sync, enqueue_only=True)
                        print(
                            f"    {'graphs' if graphs else 'eager':<7}"
                            f"{', a thread contending for the GIL' if contended else '':<36}"
                            f" {each:9.1f} us",
                            flush=True,
                        )
                page_write.WRITES = page_write.WRITES.configured(StagingSettings())
            if args.profile:
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(50):
                    mapped_send() if probe is not None else send()
                profile.disable()
                pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
        finally:
            writer.close()


if __name__ == "__main__":
    main()
