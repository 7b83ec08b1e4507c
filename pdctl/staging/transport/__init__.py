"""KV transports behind one contract (`base.Transport`) and a lazy name registry.

`create_transport("tcp" | "mooncake" | "nixl", config)` imports an implementation
only when it is asked for, so a missing NIXL fails only when NIXL is chosen.
"""

from __future__ import annotations

import importlib

from pdctl.staging.transport.base import (
    BadDescriptor,
    MemoryRegion,
    Notification,
    Peer,
    PeerUnreachable,
    RegistrationError,
    TransferHandle,
    TransferTimeout,
    Transport,
    TransportConfig,
    TransportError,
)

_REGISTRY = {
    "tcp": "pdctl.staging.transport.tcp:TcpTransport",
    "mooncake": "pdctl.staging.transport.mooncake:MooncakeTransport",
    "nixl": "pdctl.staging.transport.nixl:NixlTransport",
}


def transport_names() -> list[str]:
    return list(_REGISTRY)


def transport_class(name: str) -> type[Transport]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(_REGISTRY)}")
    module, _, attr = _REGISTRY[name].partition(":")
    cls: type[Transport] = getattr(importlib.import_module(module), attr)
    return cls


def create_transport(name: str, config: TransportConfig) -> Transport:
    return transport_class(name)(config)


__all__ = [
    "BadDescriptor",
    "MemoryRegion",
    "Notification",
    "Peer",
    "PeerUnreachable",
    "RegistrationError",
    "TransferHandle",
    "TransferTimeout",
    "Transport",
    "TransportConfig",
    "TransportError",
    "create_transport",
    "transport_class",
    "transport_names",
]
