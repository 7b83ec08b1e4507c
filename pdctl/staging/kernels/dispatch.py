"""Which kernel backend a checked call takes: the caller's, else the device's default
(`base.default_backend`), refused where it cannot run. What it does not know: the
backends themselves (`base`'s registry imports them)."""

from __future__ import annotations

import os

from pdctl.staging.kernels.base import backend_names, default_backend
from pdctl.staging.kernels.kvset import KVInfo


def backend_for(info: KVInfo, backend: str | None) -> str:
    """The backend's name for a KV set on `info.device` (`backend`: the caller's choice)."""
    name = backend or default_backend(info.device)
    if name not in backend_names():
        raise ValueError(f"unknown kernel backend {name!r}; known: {', '.join(backend_names())}")
    if (
        name == "triton"
        and info.device.type not in ("cuda", "xpu")
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        raise ValueError(
            f"the triton backend runs on cuda and xpu, not {info.device.type} "
            "(set TRITON_INTERPRET=1 to interpret it on the CPU)"
        )
    return name
