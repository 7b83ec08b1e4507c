"""Transport fixtures: a local writer and a peer in another process, for each backend."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import numpy as np
import pytest

from pdctl.staging.transport import Transport, TransportConfig, create_transport
from pdctl.staging.transport.peer import PeerProcess

SECRET = b"test-secret"
PEER_BYTES = (256 << 20) + 4096


def _importable(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{module} cannot be imported here: {exc}"
    return None


def _nixl_missing() -> str | None:
    for name in ("nixl._api", "nixl_cu12._api"):
        if _importable(name) is None:
            return None
    return "nixl cannot be imported here (pip install --no-deps nixl-cu12 nixl)"


# (id, backend, fast path, marks)
BACKENDS = [
    pytest.param(("tcp", True), id="tcp"),
    pytest.param(("tcp", False), id="tcp-socket"),
    pytest.param(
        ("mooncake", True),
        id="mooncake",
        marks=[
            pytest.mark.mooncake,
            pytest.mark.skipif(
                bool(_importable("mooncake.engine")), reason=str(_importable("mooncake.engine"))
            ),
        ],
    ),
    pytest.param(
        ("nixl", True),
        id="nixl",
        marks=[
            pytest.mark.nixl,
            pytest.mark.skipif(bool(_nixl_missing()), reason=str(_nixl_missing())),
        ],
    ),
]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> tuple[str, bool]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def peer(backend: tuple[str, bool]) -> Iterator[PeerProcess]:
    name, fast = backend
    with PeerProcess(
        name, PEER_BYTES, name="decode-0", fast_path=fast, secret=SECRET, timeout=5
    ) as process:
        yield process


def make_writer(backend: tuple[str, bool], **overrides: object) -> Transport:
    name, fast = backend
    settings: dict[str, object] = {
        "name": "prefill-0",
        "secret": SECRET,
        "connect_timeout_s": 3.0,
        "transfer_timeout_s": 5.0,
        "same_host_fast_path": fast,
    }
    settings.update(overrides)
    return create_transport(name, TransportConfig(**settings))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def writer(backend: tuple[str, bool]) -> Iterator[Transport]:
    transport = make_writer(backend)
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def source(writer: Transport) -> np.ndarray:
    data = np.random.default_rng(0).integers(0, 256, PEER_BYTES, dtype=np.uint8)
    writer.register(data.ctypes.data, data.nbytes)
    return data
