"""Where a same-host device write's time goes (a GPU probe for the builtin transport).

    python benchmarks/device_write_profile.py [--device cuda] [--size-mib 16]

Two processes on one device, as `pdctl bench transport --device` runs them. For one
write size it times (median of 50, microseconds): the whole `write`, the transport's
checks and route, and then, on the peer's memory as mapped here, the bare copy
variants the write could use: `copy_` on the transport's stream with a stream
synchronize, on the current stream, with an event instead of a stream synchronize,
and the ranges kernel; a profile of 200 writes follows (cumulative time per call).
"""

from __future__ import annotations

import argparse
import cProfile
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
    args = parser.parse_args()
    size = int(args.size_mib * (1 << 20))
    device = dev.resolve_device(args.device)
    source = torch.randint(0, 256, (size,), dtype=torch.uint8).to(device)
    with PeerProcess("tcp", size, device=args.device, secret=SECRET) as peer:
        writer = create_transport("tcp", TransportConfig("profile", secret=SECRET))
        try:
            writer.register_tensor(source)
            connection = writer.connect(peer.description)
            src = np.array([source.data_ptr()], dtype=np.uint64)
            dst = np.array([peer.base], dtype=np.uint64)
            lengths = np.array([size], dtype=np.uint64)
            mapped = next(iter(connection.state["device"].values()))[:size]
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

                with dev.device_stream_context(stream):
                    copy_ranges(device, src, np.array([mapped.data_ptr()], np.uint64), lengths)
                dev.synchronize_stream(stream)

            def empty() -> None:
                with dev.device_stream_context(stream):
                    pass
                dev.synchronize_stream(stream)

            rows = {
                "write (whole)": lambda: writer.write(connection, src, dst, lengths),
                "checks (_checked)": lambda: writer._checked(connection, src, dst, lengths, None),
                "route": lambda: writer._route(connection, (src, dst, lengths)),
                "copy_ on the transport stream + stream sync": on_stream,
                "copy_ on the current stream + sync": current,
                "copy_ + event sync": with_event,
                "ranges kernel, one range": ranges,
                "local copy (fresh target) + device sync": local,
                "empty stream context + sync": empty,
            }
            print(f"{size / (1 << 20):g} MiB, {device}")
            for name, function in rows.items():
                print(f"  {name:<48} {median_us(function):9.1f} us", flush=True)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(200):
                writer.write(connection, src, dst, lengths)
            profile.disable()
            pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
        finally:
            writer.close()


if __name__ == "__main__":
    main()
