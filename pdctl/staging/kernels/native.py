"""The CPU staging copy in C (`native_rows.c`): memcpy per chunk, rows prefetched
ahead, split over threads; torch's index ops stay the path where it cannot be built.

torch's CPU index ops move a page-1 layout's rows (a few hundred bytes each, at
random places in the pool) at 0.3-0.5 of a plain copy's rate; a memcpy per row with
the next rows prefetched moves them at 0.6-0.9 (`pdctl bench staging --device cpu`,
docs/benchmarks.md). The library is compiled once per source version with the
host's C compiler (`CC`, else cc or gcc) into the settings' `native_dir`
(`staging/settings.py`), written to a temporary name and renamed, so concurrent
processes never load half a file. `available()` says why it is not there when it
is not (`pdctl doctor` shows it).
`benchmarks/native_rows_ab.py` times builds of the C source side by side.

The C code trusts its arguments, so `copy_rows` checks them first: buffers of
[pool_tokens, row_words] rows, a contiguous staging block, page ids inside the pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdctl.staging.kernels.base import KVColumns
from pdctl.staging.settings import process_settings

SOURCE = Path(__file__).with_name("native_rows.c")
THREAD_BYTES = 1 << 20  # below this many bytes a thread more costs more than it saves


def library_dir() -> Path:
    """Where this process's compiled helpers go (its settings' `native_dir`)."""
    return process_settings().library_dir()


def build(
    source: Path = SOURCE,
    stem: str = "staging-rows",
    flags: Sequence[str] = (),
    *,
    directory: Path | None = None,
) -> Path:
    """The compiled library of `source` (built on first use, with `flags` besides -O3 and
    the threading ones) in `directory` (default `library_dir()`); raises OSError saying
    why it cannot be."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    target = (directory or library_dir()) / f"{stem}-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError(f"no C compiler (cc or gcc) to build {source.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        for threading_flag in ("-fopenmp", "-pthread"):  # torch's OpenMP threads, else its own
            options = ["-O3", "-shared", "-fPIC", "-pthread", threading_flag, *flags]
            command = [compiler, *options, "-o", str(built), str(source), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if result.returncode == 0:
                break
        if result.returncode != 0:
            raise OSError(f"building {source.name} failed: {result.stderr.strip()}")
        os.replace(built, target)
    return target


@functools.cache
def _library() -> tuple[Any, str]:  # (the library or None, why)
    try:
        library = ctypes.CDLL(str(build()))
    except OSError as exc:
        return None, str(exc)
    copy = library.pdctl_copy_rows
    copy.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6 + [ctypes.c_int] * 2
    copy.restype = ctypes.c_int
    check = library.pdctl_check_stamped
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    check.argtypes = [vp, i64, i64, vp, vp]  # ids, count, pages, stamps, where to copy them
    check.restype = ctypes.c_int64
    shared = library.pdctl_threading() == 1
    return library, "built, on torch's OpenMP threads" if shared else "built, on threads of its own"


def _function() -> tuple[Any, str]:  # (the C copy or None, why)
    library, why = _library()
    return (None if library is None else library.pdctl_copy_rows), why


class StampWords(ctypes.Structure):
    """`pdctl_stamps_t` of native_rows.c: a thread's stamp words for the page check."""

    _fields_ = [
        ("words", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("stamp", ctypes.c_uint32),
        ("repeated", ctypes.c_int),
    ]


class Stamps(threading.local):
    """Per thread: the page check's stamp words, as the C check reads them (`ref`, its
    address), made once; the C side takes each call's generation."""

    def __init__(self) -> None:
        self.words = np.zeros(0, dtype=np.uint32)
        self.struct = StampWords(0, 0, 0, 0)
        self.ref = ctypes.addressof(self.struct)

    def grow(self, num_pages: int) -> None:
        """Fresh words for at least `num_pages` (all zero, so any stamp from 1 is new):
        twice as many where too few, as many where the generations ran out."""
        size = self.struct.size
        self.words = np.zeros(max(num_pages, 2 * size) if size < num_pages else size, np.uint32)
        self.struct.words, self.struct.size = self.words.ctypes.data, len(self.words)
        self.struct.stamp = 0


STAMPS = Stamps()  # this thread's: `STAMPS.ref` for the C check


def check_ids(
    ids: np.ndarray | torch.Tensor, num_pages: int, out: torch.Tensor | None = None
) -> tuple[int, bool] | None:
    """The first bad page id of a contiguous int64 array (numpy, or a CPU tensor), in C:
    (its position, whether it repeats an earlier one; else it lies outside
    [0, num_pages)); (-1, False) when every id is good; None where the C library is not
    built or the ids are of another layout (the caller checks). `out` (a contiguous
    int64 CPU tensor as long as `ids`: a replay's pinned slot): the ids are copied there
    in the same pass (where the result is not -1, its contents are undefined)."""
    library, _ = _library()
    if library is None:
        return None
    if isinstance(ids, torch.Tensor):  # addresses read from tensors: the fast way
        if ids.dtype != torch.int64 or ids.device.type != "cpu" or not ids.is_contiguous():
            return None
        address, count = ids.data_ptr(), ids.numel()
    else:
        if ids.dtype != np.int64 or not ids.flags.c_contiguous:
            return None
        address, count = ids.ctypes.data, len(ids)
    target = None
    if out is not None:
        if out.dtype != torch.int64 or out.device.type != "cpu" or out.numel() != count:
            return None
        if not out.is_contiguous():  # the C code writes `count` words from its start
            return None
        target = out.data_ptr()
    return check_at(address, count, num_pages, target)


def check_at(address: int, count: int, num_pages: int, out: int | None) -> tuple[int, bool] | None:
    """`check_ids` on addresses the caller vouches for: `count` int64 ids at `address`,
    copied to as many words at `out` (None: not copied). A replayed staging call's
    host path: on a slow host each tensor property read `check_ids` makes costs about a
    microsecond. None where the C library is not built."""
    library, _ = _library()
    if library is None:
        return None
    stamps = STAMPS
    position = library.pdctl_check_stamped(address, count, num_pages, stamps.ref, out)
    if position == -2:  # too few words for this pool, or the generations ran out
        stamps.grow(num_pages)
        position = library.pdctl_check_stamped(address, count, num_pages, stamps.ref, out)
    return int(position), bool(stamps.struct.repeated)


def check_function() -> int | None:
    """The C check's entry point as an address (`pdctl_check_stamped`: ids, count,
    pages, a thread's `Stamps.ref`, where to copy them), for C callers
    (`staging.held_replay`); None where the library is not built."""
    library, _ = _library()
    if library is None:
        return None
    return int(ctypes.cast(library.pdctl_check_stamped, ctypes.c_void_p).value or 0) or None


def available() -> tuple[bool, str]:
    """(whether the C copy serves CPU staging, and why not when it does not)."""
    function, why = _function()
    return function is not None, why


@functools.lru_cache(maxsize=256)
def _table(addresses: tuple[int, ...]) -> np.ndarray:
    return np.asarray(addresses, dtype=np.int64)


def copy_rows(kv: KVColumns, staging: torch.Tensor, to_staging: bool) -> bool:
    """The backend contract's gather (to_staging) or scatter on CPU tensors, in C.

    Returns False, having done nothing, where the C copy is not available or the
    layout is not the one it copies (the caller's index ops then do it)."""
    function, _ = _function()
    if function is None or staging.device.type != "cpu" or not staging.is_contiguous():
        return False
    buffers, pages, page_size, col_start = kv.buffers, kv.pages, kv.page_size, kv.col_start
    num_buffers, num_tokens, num_cols = staging.shape
    first = buffers[0]
    pool_tokens, row_words = first.shape
    if any(b.stride() != (row_words, 1) or b.shape != first.shape for b in buffers):
        return False
    if pages.dtype != torch.int64 or not pages.is_contiguous() or pages.device.type != "cpu":
        return False
    word = staging.element_size()
    if first.element_size() != word or col_start < 0 or col_start + num_cols > row_words:
        return False
    if num_tokens == 0:
        return True
    if len(pages) * page_size < num_tokens:
        raise ValueError(f"{len(pages)} pages of {page_size} hold fewer than {num_tokens} tokens")
    ids = pages.numpy()
    if int(ids.min()) < 0 or (int(ids.max()) + 1) * page_size > pool_tokens:
        raise ValueError(f"a page id is outside the pool's {pool_tokens // page_size} pages")
    table = _table(tuple(b.data_ptr() for b in buffers))
    nbytes = staging.numel() * word
    threads = max(1, min(torch.get_num_threads(), nbytes // THREAD_BYTES))
    addresses = (table.ctypes.data, pages.data_ptr(), staging.data_ptr())
    counts = (num_buffers, num_tokens, page_size)
    # in bytes: a buffer's row, the slice's start in it, the slice's length
    row_bytes = (row_words * word, col_start * word, num_cols * word)
    function(*addresses, *counts, *row_bytes, int(to_staging), threads)
    return True
