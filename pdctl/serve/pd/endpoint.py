"""Each server rank's transport endpoint, configured from the server's arguments."""

from __future__ import annotations

from pdctl.serve.args import ServerArgs
from pdctl.serve.pd.client import run_secret
from pdctl.staging.transport import Transport, TransportConfig, create_transport


def endpoint_name(args: ServerArgs) -> str:
    return f"{args.role}-{args.replica} rank {args.tp_rank}"


def make_transport(args: ServerArgs) -> Transport:
    ports = args.transport_ports
    port = (
        ports[args.tp_rank] if args.transfer_backend == "tcp" and args.tp_rank < len(ports) else 0
    )
    config = TransportConfig(
        name=endpoint_name(args),
        host=args.host,
        port=port,
        connect_timeout_s=args.connect_timeout,
        transfer_timeout_s=args.transfer_timeout,
        protocol=args.mooncake_protocol,
        ib_devices=args.ib_devices,
        nixl_backend=args.nixl_backend,
        secret=run_secret(),
    )
    return create_transport(args.transfer_backend, config)
