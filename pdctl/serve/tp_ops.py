"""The operation codes of the TP step protocol (`tp.py`), one table for every role.

Rank 0 announces each operation in the header's first int64; the other ranks look up
the handler of that code. One enum keeps two roles' codes from colliding, and a
code's meaning findable. No torch here: the roles import it before they need torch.
"""

from __future__ import annotations

from enum import IntEnum


class Op(IntEnum):
    FORWARD = 1  # a batch: every rank runs the same forward (`tp.encode_pieces`)
    STOP = 2  # the worker loop ends
    SEND = 10  # prefill: send a room's KV (JSON: room, pages, num_tokens)
    RECEIVE = 20  # decode: receive a room's KV (JSON: room, pages, num_tokens, bootstrap)
    ABORT = 21  # decode: stop receiving a room
    ENCODE = 30  # encoder: encode an image rank 0 checked
