"""What every server rank sets up: identity, logging, threads, TP group, model, KV pool.

Rank 0 of a server starts the other ranks (same arguments plus `--tp-rank`; spawned,
or on the CPU forked once the modules are imported: `ranks`), so a server is one
process group that pdctl's launcher owns. Every rank loads the same
weights (sliced for itself) and an identical KV pool layout; rank 0 then runs the
role (HTTP API, scheduler) and the others follow its broadcasts. Encoder ranks load
no language model (only its shape and tokenizer): they run the encoder model.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pdctl.core import DIST_BACKENDS
from pdctl.serve import tp as tensor_parallel
from pdctl.serve.args import ServerArgs
from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.http import set_identity
from pdctl.serve.model import native_attention, ops
from pdctl.serve.model.graphs import DecodeGraphs
from pdctl.serve.model.runner import ModelRunner
from pdctl.serve.model.weights import (
    DTYPES,
    CheckpointError,
    ModelConfig,
    RankWeights,
    build_rank_weights,
    checkpoint_config,
    checkpoint_source,
    preset_config,
    preset_source,
)
from pdctl.serve.ranks import RankProcess, first_of_many, spawn_ranks
from pdctl.serve.settings import Handoff
from pdctl.serve.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from pdctl.serve.tp_ops import Op
from pdctl.staging import device as dev

log = logging.getLogger("pdctl.serve")


@dataclass
class LanguageModel:
    """A rank's share of the language model: weights, KV pool, runner, decode graphs."""

    weights: RankWeights
    kv: KVPool
    runner: ModelRunner
    graphs: DecodeGraphs  # decode steps as CUDA graphs where they can be (else off, and why)


@dataclass
class Rank:
    args: ServerArgs
    device: torch.device
    config: ModelConfig
    model: LanguageModel | None  # None on encoder ranks
    group: tensor_parallel.TPGroup | None
    tokenizer: Tokenizer
    children: list[RankProcess]

    @property
    def model_name(self) -> str:
        return self.args.model_path or f"preset:{self.args.model_preset}"

    def _model(self) -> LanguageModel:
        if self.model is None:
            raise RuntimeError(f"a {self.args.role} rank holds no language model")
        return self.model

    @property
    def kv(self) -> KVPool:
        return self._model().kv

    @property
    def runner(self) -> ModelRunner:
        return self._model().runner

    @property
    def graphs(self) -> DecodeGraphs:
        return self._model().graphs

    @property
    def max_context(self) -> int:
        return context_limit(self.config, self.kv.pool_tokens, self.kv.page_size)


def context_limit(config: ModelConfig, pool_tokens: int, page_size: int) -> int:
    """The longest sequence a rank takes: its positions and its KV pool both bound it
    (the pool less its scratch page, which no request is given: kv_pool.py)."""
    return min(config.shape.max_position, pool_tokens - page_size)


def device_for(args: ServerArgs) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    if args.rank_devices:  # ranks sharing a device: the mask lists each device once
        return torch.device(args.device, args.rank_devices[args.tp_rank])
    return torch.device(args.device, args.tp_rank)  # visibility masks make ranks 0..tp-1


def load_config(args: ServerArgs) -> tuple[ModelConfig, Tokenizer]:
    """The language model's shape and tokenizer (no weights)."""
    if args.model_path:
        path = Path(args.model_path)
        config = checkpoint_config(path)
        with checkpoint_errors(path):
            return config, HFTokenizer(path, config.shape.vocab_size)
    config = preset_config(args.model_preset or "tiny")
    return config, ByteTokenizer(config.shape.vocab_size)


@contextlib.contextmanager
def checkpoint_errors(path: Path) -> Iterator[None]:
    """What goes wrong loading a checkpoint (a tensor of another shape, a tokenizer that
    cannot be read) as one CheckpointError naming it: the server ends on that line."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, ValueError) as exc:
        said = str(exc)
        raise CheckpointError(said if str(path) in said else f"{path}: {said}") from exc


def load_model(
    args: ServerArgs, config: ModelConfig, device: torch.device, gather: ops.AllGather | None
) -> LanguageModel:
    """This rank's weights, its KV pool and the runner over them."""
    dtype = DTYPES[args.dtype]
    path = Path(args.model_path) if args.model_path else None
    with checkpoint_errors(path) if path else contextlib.nullcontext():
        source = checkpoint_source(path) if path else preset_source(args.seed, device)
        weights = build_rank_weights(config, source, args.tp, args.tp_rank, dtype, device)
    pool = args.kv_pool_tokens or 16384
    pool -= pool % args.page_size
    layers, head_dim = config.shape.num_layers, config.shape.head_dim
    kv = KVPool(layers, pool, weights.kv_heads, head_dim, args.page_size, dtype, device)
    runner = ModelRunner(weights, kv, device, gather, compute_logits=args.tp_rank == 0)
    graphs = DecodeGraphs.for_runner(
        runner,
        capacity=context_limit(config, pool, args.page_size),
        scratch_row=kv.scratch_row,
        max_batch=args.max_running_requests,
        enabled=args.cuda_graphs,
    )
    log.info(
        "model %s ready on %s (tp %d, %d KV tokens, CUDA graphs %s)",
        args.model_path or args.model_preset,
        device,
        args.tp,
        pool,
        "on" if graphs.off is None else "off",
    )
    return LanguageModel(weights, kv, runner, graphs)


# glibc's malloc: blocks up to this size come from the heap (not a fresh mapping each), and
# up to this much freed heap stays with the process
HEAP_BLOCKS_BYTES = 256 << 20
HEAP_KEPT_BYTES = 1 << 30


def retain_host_memory() -> bool:
    """Keep freed host memory for reuse (glibc's malloc; elsewhere nothing is done).

    A CPU forward allocates megabyte temporaries. By default glibc maps each one afresh
    and unmaps it when freed, so every page is faulted in again on the next forward. A
    1,000-token prefill of the tiny model (in process, one thread) took 100,000 page
    faults and 680 ms; with the memory kept it takes none and 450 ms.
    `tests/serve/test_host_memory.py` shows the faults (about 200,000 for 20 steps of
    72 MiB of temporaries by default, none with the memory kept); `pdctl bench engine`
    keeps the memory as the servers do. Returns whether the setting took."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    # M_MMAP_THRESHOLD (-3), M_TRIM_THRESHOLD (-1): both fixed, no longer adapted
    return bool(mallopt(-3, HEAP_BLOCKS_BYTES)) and bool(mallopt(-1, HEAP_KEPT_BYTES))


def start_rank(
    args: ServerArgs, argv: list[str], children: list[RankProcess] | None = None
) -> Rank:
    """This rank, ready to serve; rank 0's other ranks are spawned here unless the
    caller already spawned them (`children`)."""
    set_identity(args)
    device = device_for(args)
    ops.set_deterministic(args.deterministic)
    if not args.settings.native_attention:
        native_attention.switch_off()
    if args.deterministic and ops.kernel_mode(device.type) == "vendor libraries":
        log.warning(
            "deterministic serving asked for, but %s has no fixed-order kernels here (Triton "
            "missing or unsupported): products use the vendor libraries, not batch-invariant",
            device.type,
        )
    if device.type == "cpu":
        retain_host_memory()
        if args.deterministic:
            torch.set_num_threads(1)  # batch invariance: see ops.py
    else:  # the main thread's device (NCCL, Triton); worker threads guard their own
        dev.get_device_module(device).set_device(device)
    if children is None:
        handoff = Handoff.from_environ(os.environ)
        environ = dict(os.environ)
        children = spawn_ranks(args.tp, argv, environ, handoff) if first_of_many(args) else []
    group = None
    if args.tp > 1:
        if args.dist_port is None:
            raise SystemExit("--dist-port is required when --tp > 1")
        # ranks sharing a device cannot use its collective library (NCCL refuses two
        # ranks on one GPU): gloo, with the partials gathered through host memory
        backend = "gloo" if args.shares_devices else DIST_BACKENDS.get(device.type, "gloo")
        address = ("127.0.0.1", args.dist_port)  # the group's rendezvous
        via_host = args.shares_devices and device.type != "cpu"
        futex = args.settings.tp_gather == "futex"
        group = tensor_parallel.TPGroup(
            args.tp_rank, args.tp, *address, backend, 600, via_host=via_host, shared_memory=futex
        )
    config, tokenizer = load_config(args)
    model = None
    if args.role != "encoder":  # the encoder's ranks run the encoder model only
        model = load_model(args, config, device, group.gather if group else None)
    return Rank(args, device, config, model, group, tokenizer, children)


def rank_forward(rank: Rank):  # type: ignore[no-untyped-def]
    """The engine's forward: on rank 0 with TP, announce the batch first.

    At TP 1 decode batches replay CUDA graphs where they can (`model/graphs.py`); with
    TP every rank runs the same eager forward (the gather is a collective).
    """
    group = rank.group
    if group is None:
        return rank.graphs.forward

    def forward(pieces):  # type: ignore[no-untyped-def]
        payload = tensor_parallel.encode_pieces(pieces)
        return group.forward(payload, lambda: rank.runner.forward(pieces))

    return forward


def run_worker(rank: Rank) -> None:
    assert rank.group is not None
    forward = rank.model.runner.forward if rank.model is not None else _no_forward
    try:
        tensor_parallel.worker_loop(rank.group, forward)
    finally:
        rank.group.close()


def _no_forward(pieces: object) -> None:
    raise RuntimeError("an encoder rank runs no language-model forward")


def stop_ranks(rank: Rank) -> None:
    if rank.group is not None:
        with contextlib.suppress(RuntimeError):  # a rank that died hears nothing
            rank.group.send(Op.STOP, last=True)
    for child in rank.children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGKILL)
            child.wait()
    if rank.group is not None:
        rank.group.close()
