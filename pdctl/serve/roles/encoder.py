"""The encoder role of an EPD topology: images in, embeddings into prefill's pool.

`POST /encode` takes a request's prompt (text with `<image>` markers, or input_ids
with -1 markers) and its images, plus the prefill bootstrap endpoint and an
`embedding_room` the router chose. It runs the encoder model, builds the expanded
prompt (multimodal.py), copies the embeddings into its registered send buffer,
synchronizes the device (every accelerator, not only CUDA: transports do not order
against device streams), asks prefill for a slot, writes the rows there with the
topology's transport, and reports their digest; prefill checks it. The answer is
the prompt the router sends on to prefill and decode: `input_ids`, `mm_items`.

With TP > 1 the encoder model is sharded over the ranks (model/encoder.py): rank 0
serves HTTP, checks each image and announces it to the other ranks (`Op.ENCODE`, the
image's float32 bits as int64, never pickled), then every rank computes its heads
and its share of the MLP, exchanging row-parallel partials; rank 0 sends the result.
The embeddings are bitwise those of a TP 1 encoder.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from pdctl.serve.api.errors import error_body
from pdctl.serve.api.guards import MAX_BODY_BYTES, guard_json_depth, refuse_oversized
from pdctl.serve.api.schemas import GenerateBody
from pdctl.serve.faults import faults
from pdctl.serve.http import run_servers
from pdctl.serve.model.encoder import EncoderModel
from pdctl.serve.multimodal import PromptError, digest_of, encode_prompt, images_of
from pdctl.serve.pd.client import Client, PeerCallError, warn_if_no_secret
from pdctl.serve.pd.endpoint import make_transport
from pdctl.serve.roles.common import server_info
from pdctl.serve.runtime import DTYPES, Rank, stop_ranks
from pdctl.serve.runtime import run_worker as run_tp_worker
from pdctl.serve.tp import float_bits, from_float_bits
from pdctl.serve.tp_ops import Op
from pdctl.staging.buffer import StagingBuffer
from pdctl.staging.embedding_pool import synchronize_before_send
from pdctl.staging.transport import Peer

log = logging.getLogger("pdctl.serve")
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def image_payload(image: torch.Tensor) -> torch.Tensor:
    """[3, H, W] float32 -> int64 [3, H, W, bits...] for the TP broadcast (exact)."""
    return torch.cat([torch.tensor(image.shape, dtype=torch.int64), float_bits(image)])


def image_from_payload(payload: torch.Tensor) -> torch.Tensor:
    return from_float_bits(payload[3:], *(int(d) for d in payload[:3]))


def encoder_model(rank: Rank) -> EncoderModel:
    """This rank's shard of the encoder model (the whole model at TP 1)."""
    args, group = rank.args, rank.group
    log.info("encoder model on %s (tp rank %d of %d)", rank.device, args.tp_rank, args.tp)
    return EncoderModel(
        rank.config.shape.hidden_size,
        dtype=DTYPES[args.dtype],
        device=rank.device,
        seed=args.seed,
        tp=args.tp,
        tp_rank=args.tp_rank,
        gather=group.gather if group is not None else None,
    )


@dataclass(frozen=True)
class Target:
    """Where a request's embeddings go: prefill's bootstrap endpoint and the room."""

    bootstrap: str  # http://host:port
    room: int


@dataclass(frozen=True)
class EmbeddingSlot:
    """The slot prefill's pool gave a request's embeddings (`/bootstrap/embedding/alloc`)."""

    bytes: int
    ptr: int  # where in prefill's registered pool
    transport: str  # prefill's transport description (base64)


class EncodeFailed(Exception):
    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class Encoder:
    def __init__(self, rank: Rank) -> None:
        args = rank.args
        self.rank, self.args = rank, args
        self.vocab = rank.config.shape.vocab_size
        self.model = encoder_model(rank)
        group = rank.group
        if group is not None:
            self.model.announce = lambda image: group.send(Op.ENCODE, image_payload(image))
        self.transport = make_transport(args)
        self.buffer = StagingBuffer(int(args.embedding_pool_mb * (1 << 20)), rank.device)
        self.transport.register(
            self.buffer.ptr,
            self.buffer.nbytes,
            device_type=rank.device.type,
            device_index=rank.device.index,
        )
        self.peers: dict[str, Peer] = {}
        self.clients: dict[str, Client] = {}
        self.lock = threading.Lock()  # one request at a time uses the model and the buffer
        self.counters = {"requests": 0, "images": 0, "failed": 0, "bytes": 0}

    def encode(self, body: GenerateBody, images: list[Any], target: Target) -> Any:
        with self.lock:
            started = time.perf_counter()
            ids, items, rows = encode_prompt(
                self.model, self.rank.tokenizer, self.vocab, body, images
            )
            encode_ms = (time.perf_counter() - started) * 1e3
            started = time.perf_counter()
            digest = self._send(rows, target)
            transfer_ms = (time.perf_counter() - started) * 1e3
            self.counters["requests"] += 1
            self.counters["images"] += len(images)
            self.counters["bytes"] += rows.numel() * rows.element_size()
        return {
            "input_ids": ids,
            "mm_items": items,
            "embedding_room": target.room,
            "embedding_transfer": {
                "num_image_tokens": int(rows.shape[0]),
                "bytes": rows.numel() * rows.element_size(),
                "transport": self.args.transfer_backend,
                "digest": f"{digest:#018x}",
                "digest_ok": True,  # prefill compared it with what it received, or refused
                "encode_ms": round(encode_ms, 3),
                "transfer_ms": round(transfer_ms, 3),
            },
        }

    def _send(self, rows: torch.Tensor, target: Target) -> int:
        """Write `rows` into prefill's pool; the digest prefill checked them against."""
        nbytes = rows.numel() * rows.element_size()
        if nbytes > self.buffer.nbytes:
            raise EncodeFailed(
                f"{nbytes} bytes of embeddings exceed the encoder's send buffer "
                f"({self.buffer.nbytes}); raise --embedding-pool-mb",
                status=413,
            )
        staged = self.buffer.view(0, nbytes)
        staged.copy_(rows.contiguous().reshape(-1).view(torch.uint8))
        digest = digest_of(staged)
        if faults().hit("corrupt-embedding") is not None:  # after the digest: prefill must notice
            staged[nbytes // 2] ^= 0xFF
        src, length = synchronize_before_send(staged)
        self._transfer(self._client(target.bootstrap), target.room, rows, src, length, digest)
        return digest

    def _transfer(
        self, client: Client, room: int, rows: torch.Tensor, src: int, length: int, digest: int
    ) -> None:
        slot = self._slot(client, room, rows)
        if slot.bytes != length:
            raise EncodeFailed(f"prefill offered {slot.bytes} bytes for {length}")
        peer = self._peer(slot.transport)
        try:
            self.transport.write(peer, [src], [slot.ptr], [length])
        except Exception as exc:  # the transport names the peer and the failure
            raise EncodeFailed(f"writing embeddings to prefill failed: {exc}") from None
        try:
            client.call("POST", "/bootstrap/embedding/sent", json={"room": room, "digest": digest})
        except PeerCallError as exc:
            raise EncodeFailed(str(exc), status=exc.status or 502) from None

    def _slot(self, client: Client, room: int, rows: torch.Tensor) -> EmbeddingSlot:
        body = {
            "room": room,
            "num_tokens": int(rows.shape[0]),
            "hidden_size": int(rows.shape[1]),
            "dtype": DTYPE_NAMES[rows.dtype],
        }
        deadline = time.monotonic() + self.args.bootstrap_timeout
        while True:
            try:
                slot = client.call("POST", "/bootstrap/embedding/alloc", json=body)
                return EmbeddingSlot(int(slot["bytes"]), int(slot["ptr"]), slot["transport"])
            except PeerCallError as exc:
                if exc.status != 503 or time.monotonic() > deadline:
                    raise EncodeFailed(str(exc), status=exc.status or 502) from None
            time.sleep(0.05)  # prefill's pool is full: its requests free slots as they start

    def _client(self, bootstrap: str) -> Client:
        """One kept-alive client per prefill bootstrap endpoint (requests are serialized)."""
        if bootstrap not in self.clients:
            self.clients[bootstrap] = Client(
                bootstrap, "prefill bootstrap", self.args.bootstrap_timeout
            )
        return self.clients[bootstrap]

    def _peer(self, description: str) -> Peer:
        if description not in self.peers:
            self.peers[description] = self.transport.connect(base64.b64decode(description))
        return self.peers[description]


def encoder_app(encoder: Encoder, rank: Rank) -> FastAPI:
    app = FastAPI(title="pdctl encoder", docs_url=None, redoc_url=None)
    guard_json_depth(app)
    info = server_info(rank)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, object]:
        return {**info, "encoder": dict(encoder.counters)}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, str | int | bool]:
        return {"model_path": rank.model_name, "vocab_size": encoder.vocab, "is_encoder": True}

    @app.post("/encode")
    async def encode(request: HttpRequest) -> Any:
        import asyncio

        refused = refuse_oversized(request, MAX_BODY_BYTES)
        if refused is not None:
            return JSONResponse(error_body(refused[1]), status_code=refused[0])
        try:
            raw = await request.json()
            body = GenerateBody.model_validate(raw)
            host, port, room = raw["bootstrap_host"], raw["bootstrap_port"], raw["embedding_room"]
            if not (isinstance(host, str) and isinstance(port, int) and isinstance(room, int)):
                raise ValueError("bootstrap_host, bootstrap_port and embedding_room are required")
            images = images_of(body)
            if not images:
                raise PromptError("no image in the request", "images")
        except PromptError as exc:
            return JSONResponse(error_body(f"encoder: {exc}", exc.field), status_code=400)
        except (ValueError, KeyError, TypeError, RecursionError, UnicodeDecodeError) as exc:
            return JSONResponse(error_body(f"encoder: bad request: {exc}"), status_code=400)
        target = Target(f"http://{host}:{port}", room)
        faults().request_arrived()  # kill-role (role=encoder); off unless asked for
        try:
            return await asyncio.to_thread(encoder.encode, body, images, target)
        except PromptError as exc:
            return JSONResponse(error_body(f"encoder: {exc}", exc.field), status_code=400)
        except EncodeFailed as exc:
            encoder.counters["failed"] += 1
            status = exc.status if 400 <= exc.status < 600 else 502
            return JSONResponse(error_body(f"encoder: {exc}", status=status), status_code=status)

    return app


def run_worker(rank: Rank) -> None:
    """Ranks > 0: encode whatever image rank 0 announces, until it says stop."""
    assert rank.group is not None
    model = encoder_model(rank)

    def encode(payload: torch.Tensor) -> None:
        model.encode(image_from_payload(payload))  # rank 0 sends the result

    rank.group.handlers[Op.ENCODE] = encode
    run_tp_worker(rank)


def run(rank: Rank) -> None:
    args = rank.args
    warn_if_no_secret("encoder", args.host)
    encoder = Encoder(rank)
    try:
        run_servers([(encoder_app(encoder, rank), args.host, args.port)])
    finally:
        stop_ranks(rank)
