"""A decode rank's registration of a room for direct page writes, as the tests of
prefill's writes make it: decode rank 0 of TP 1, its pool's shape and addresses."""

from __future__ import annotations

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import protocol as proto


def direct_registration(
    decode: KVPool,
    room: int,
    pages: list[int],
    num_tokens: int,
    *,
    transport: str = "",
    segment_bytes: int = 1 << 20,
    bell: proto.BellOffer | None = None,
) -> proto.Registration:
    """`room` registered for writes straight into `decode`'s `pages`."""
    num_layers, _, _, kv_heads, head_dim = decode.kv.shape
    pairs = zip(decode.k_buffers, decode.v_buffers, strict=True)
    return proto.Registration(
        room=room,
        decode_rank=0,
        decode_tp=1,
        decode_name="decode",
        transport=transport,
        num_tokens=num_tokens,
        page_size=decode.page_size,
        mode="direct",
        kv_heads=kv_heads,
        head_dim=head_dim,
        num_layers=num_layers,
        elem_bytes=decode.kv.element_size(),
        segment_bytes=segment_bytes,
        pages=list(pages),
        kv_bases=[[k.data_ptr(), v.data_ptr()] for k, v in pairs],
        bell=bell,
    )
