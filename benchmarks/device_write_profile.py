"""Where a same-host device write's time goes (a GPU probe for the builtin transport).

    python benchmarks/device_write_profile.py [--device cuda] [--size-mib 16]

Two processes on one device, as `pdctl bench transport --device` runs them. For one
write size it times (median of 50, microseconds): the whole `write`, the transport's
checks and route, and then, on the peer's memory as mapped here, the bare copy
variants the write could use: `copy_` on the transport's stream with a stream
synchronize, on the current stream, with an event instead of a stream synchronize,
and the ranges kernel (over the same ranges); a profile of 200 writes follows.
`--pieces 4096` cuts the write into scattered equal ranges, as a request's KV pages.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from pdctl.staging import device as dev
from pdctl.staging.transport import TransportConfig, create_transport
from pdctl.staging.transport.peer import PeerProcess

SECRET = b"profile"


def median_us(function: Callable[[], object], repeats: int = 50) -> float:
    for _ in range(5):
        function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size-mib", type=float, default=16)
    parser.add_argument(
        "--pieces", type=int, default=1,
        help="cut the write into this many equal ranges, scattered (KV pages: 4096)",
    )  # fmt: skip
    parser.add_argument("--sort", default="cumulative", help="profile order: cumulative, tottime")
    args = parser.parse_args()
    size = int(args.size_mib * (1 << 20))
    device = dev.resolve_device(args.device)
    source = torch.randint(0, 256, (size,), dtype=torch.uint8).to(device)
    with PeerProcess("tcp", size, device=args.device, secret=SECRET) as peer:
        writer = create_transport("tcp", TransportConfig("profile", secret=SECRET))
        try:
            writer.register_tensor(source)
            connection = writer.connect(peer.description)
            each = size // args.pieces
            order = np.random.default_rng(0).permutation(args.pieces).astype(np.uint64)
            offsets = np.arange(args.pieces, dtype=np.uint64) * np.uint64(each)
            src = np.uint64(source.data_ptr()) + offsets
            dst = np.uint64(peer.base) + order * np.uint64(each)
            lengths = np.full(args.pieces, each, dtype=np.uint64)
            mapped_regions = connection.state["device"]
            if not mapped_regions:  # host memory (or no IPC): the transport's rows only
                mapped_regions = {0: torch.empty(size, dtype=torch.uint8, device=device)}
            mapped = next(iter(mapped_regions.values()))[:size]
            stream = writer._copy_stream(device)
            module = dev.get_device_module(device)
            event = module.Event()

            def on_stream() -> None:
                with dev.device_stream_context(stream):
                    mapped.copy_(source, non_blocking=True)
                dev.synchronize_stream(stream)

            def current() -> None:
                mapped.copy_(source, non_blocking=True)
                module.current_stream(device).synchronize()

            def with_event() -> None:
                with dev.device_stream_context(stream):
                    mapped.copy_(source, non_blocking=True)
                    event.record(stream)
                event.synchronize()

            def local() -> None:
                other = torch.empty_like(source)
                other.copy_(source)
                module.synchronize(device)

            def ranges() -> None:
                from pdctl.staging.kernels.ranges import copy_ranges

                local = np.uint64(mapped.data_ptr()) + order * np.uint64(each)
                with dev.device_stream_context(stream):
                    copy_ranges(device, src, local, lengths)
                dev.synchronize_stream(stream)

            def empty() -> None:
                with dev.device_stream_context(stream):
                    pass
                dev.synchronize_stream(stream)

            rows = {
                "write (whole)": lambda: writer.write(connection, src, dst, lengths),
                "checks (_checked)": lambda: writer._checked(connection, src, dst, lengths, None),
                "route": lambda: writer._route(connection, (src, dst, lengths)),
                "notify round trip (write + notification)": lambda: writer.write(
                    connection, src, dst, lengths, notify=b"profile"
                ),
                "copy_ on the transport stream + stream sync": on_stream,
                "copy_ on the current stream + sync": current,
                "copy_ + event sync": with_event,
                "ranges kernel, one range": ranges,
                "local copy (fresh target) + device sync": local,
                "empty stream context + sync": empty,
            }
            if device.type == "cpu":  # a dry run: the transport's own rows
                rows = dict(list(rows.items())[:4])
            print(f"{size / (1 << 20):g} MiB in {args.pieces} range(s), {device}")
            for name, function in rows.items():
                print(f"  {name:<48} {median_us(function):9.1f} us", flush=True)
            peer.command(cmd="fill", value=0)
            writer.write(connection, src, dst, lengths)
            host = source.cpu().numpy()
            expected = np.zeros(size, dtype=np.uint8)
            for i, slot in enumerate(order.tolist()):
                expected[slot * each : (slot + 1) * each] = host[i * each : (i + 1) * each]
            landed = peer.sha256(0, each * args.pieces)
            ok = landed == hashlib.sha256(expected[: each * args.pieces].tobytes()).hexdigest()
            print(f"  bytes in the peer after one write: {'ok' if ok else 'MISMATCH'}", flush=True)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(200):
                writer.write(connection, src, dst, lengths)
            profile.disable()
            pstats.Stats(profile).sort_stats(args.sort).print_stats(25)
        finally:
            writer.close()


if __name__ == "__main__":
    main()
