"""Gather and scatter: both backends bitwise identical to a plain reference over a grid."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.staging.kernels import (
    KVSlice,
    gather_all_layers_to_staging,
    gather_slice,
    native,
    reference,
    scatter_slice,
    scatter_staging_to_kv,
)
from pdctl.staging.layout import head_slices
from tests.staging.kv_factory import as_bits, naive_gather, random_kv, random_pages

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
# (heads, src_head_start, num_heads): every TP split of 8 KV heads, and a GQA pick.
SPLITS = [(8, 0, 8), (8, 4, 4), (8, 2, 2), (8, 7, 1), (4, 1, 1), (2, 1, 1)]


def run_case(backend, layers, page_size, split, dtype, seed, head_dim=16, device="cpu") -> None:
    heads, start, count = split
    pool_pages = 12
    k, v = random_kv(layers, pool_pages * page_size, heads, head_dim, dtype, seed, device)
    pages = random_pages(pool_pages, 5, seed)
    staging = torch.empty(
        2 * layers * 5 * page_size * count * head_dim * 8 + 64, dtype=torch.uint8, device=device
    )
    nbytes = gather_slice(k, v, pages, staging, KVSlice(start, count, page_size), backend)
    expected = naive_gather(k, v, pages, page_size, start, count)
    got = staging[:nbytes].view(expected.dtype).view(expected.shape)
    assert torch.equal(got, expected)
    # Scatter into fresh pools at other pages and heads; the rest stays untouched.
    k2, v2 = random_kv(layers, pool_pages * page_size, heads, head_dim, dtype, seed + 1, device)
    before = [as_bits(t).clone() for t in k2 + v2]
    dst_pages = random_pages(pool_pages, 5, seed + 2)
    dst_start = heads - count
    into = KVSlice(dst_start, count, page_size)
    used = scatter_slice(staging, k2, v2, dst_pages.tolist(), into, backend)
    assert used == nbytes
    rows = torch.tensor(
        [int(p) * page_size + i for p in dst_pages for i in range(page_size)], device=device
    )
    for index, (tensor, old) in enumerate(zip(k2 + v2, before, strict=True)):
        layer, kv = index % layers, index // layers
        expect = old.clone()
        expect[rows, dst_start : dst_start + count] = expected[2 * layer + kv]
        assert torch.equal(as_bits(tensor), expect)


TORCH_GRID = list(itertools.product([1, 16, 64], [1, 3], SPLITS, DTYPES))


def index_ops_only(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The torch backend's own index ops on the CPU (the C copy declines every call)."""
    monkeypatch.setattr(native, "copy_rows", lambda *args, **kwargs: False)


@pytest.mark.parametrize("c_copy", [True, False], ids=["c-copy", "index-ops"])
@pytest.mark.parametrize(("page_size", "layers", "split", "dtype"), TORCH_GRID)
def test_torch_backend_is_bitwise(monkeypatch, page_size, layers, split, dtype, c_copy) -> None:
    if not c_copy:
        index_ops_only(monkeypatch)
    run_case("torch", layers, page_size, split, dtype, seed=page_size * 7 + layers)


TRITON_GRID = [
    (page_size, layers, split, dtype)
    for page_size, layers, split, dtype in itertools.product(
        [1, 16, 64], [1, 3], SPLITS[:4], DTYPES
    )
    if (page_size + layers + SPLITS.index(split) + DTYPES.index(dtype)) % 2 == 0
]


@pytest.mark.parametrize(("page_size", "layers", "split", "dtype"), TRITON_GRID)
def test_triton_backend_is_bitwise(page_size, layers, split, dtype) -> None:
    run_case("triton", layers, page_size, split, dtype, seed=page_size * 11 + layers)


@pytest.mark.parametrize("parallel_bytes", [0, 1 << 40])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_torch_scatter_paths_are_bitwise(monkeypatch, page_size, split, dtype, parallel_bytes):
    """The CPU's numpy scatter split over threads (every part a thread's) and in one
    part, and index_copy_ over words (other devices' path), each against the reference
    (where the C copy is not built, these are the CPU's paths)."""
    index_ops_only(monkeypatch)
    monkeypatch.setattr(reference, "PARALLEL_BYTES", parallel_bytes)
    run_case("torch", 3, page_size, split, dtype, seed=7)
    monkeypatch.setattr(reference, "NUMPY_SCATTER", False)
    run_case("torch", 3, page_size, split, dtype, seed=8)


def test_words_are_the_widest_that_every_tensor_allows() -> None:
    rows = torch.zeros(6, 8, dtype=torch.bfloat16)  # 16-byte rows
    assert [t.dtype for t in reference._as_words(rows, rows[:, :4])] == [torch.int64] * 2
    assert [t.dtype for t in reference._as_words(rows, rows[:, 2:4])] == [torch.int32] * 2
    odd = rows[:, 1:4]  # 6 bytes, at an odd offset: no word fits, nothing is widened
    assert [t.dtype for t in reference._as_words(rows, odd)] == [torch.bfloat16] * 2
    assert reference._as_words(torch.zeros(4, 2, dtype=torch.float64))[0].dtype == torch.float64


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sixty_one_layers(backend) -> None:
    run_case(backend, 61, 16, (8, 4, 4), torch.bfloat16, seed=61, head_dim=8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_segments_concatenate_to_the_whole(backend) -> None:
    k, v = random_kv(2, 16 * 16, 4, 8, torch.float16, seed=3)
    pages = random_pages(16, 10, seed=4)
    whole = torch.empty(1 << 16, dtype=torch.uint8)
    n = gather_all_layers_to_staging(
        k, v, pages, whole, src_head_start=2, num_heads=2, page_size=16, backend=backend
    )
    parts = []
    for chunk in (pages[:3], pages[3:7], pages[7:]):
        part = torch.empty(1 << 15, dtype=torch.uint8)
        m = gather_all_layers_to_staging(
            k, v, chunk, part, src_head_start=2, num_heads=2, page_size=16, backend=backend
        )
        parts.append(part[:m].view(4, -1))  # [2L, tokens*heads*dim bytes]
    assert torch.equal(torch.cat(parts, dim=1).reshape(-1), whole[:n])


def test_multi_writer_region_scatters_each_block_to_its_heads() -> None:
    # prefill TP2 -> decode TP1: two writers, each holding 2 of the 4 heads.
    layers, page_size, dim = 2, 4, 8
    k_full, v_full = random_kv(layers, 64, 4, dim, torch.bfloat16, seed=9)

    def part(start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [t[:, start : start + 2].contiguous() for t in k_full], [
            t[:, start : start + 2].contiguous() for t in v_full
        ]

    prefill = [part(0), part(2)]
    pages = random_pages(16, 6, seed=1)
    slices = head_slices(4, 2, 1, 0)
    region = torch.empty(1 << 16, dtype=torch.uint8)
    offset = 0
    for piece in slices:
        pk, pv = prefill[piece.prefill_rank]
        offset += gather_slice(pk, pv, pages, region[offset:], piece.source(page_size))
    k_dec = [torch.zeros_like(t) for t in k_full]
    v_dec = [torch.zeros_like(t) for t in v_full]
    used = scatter_staging_to_kv(region, k_dec, v_dec, pages, page_size=page_size, writers=slices)
    assert used == offset
    rows = torch.tensor([int(p) * page_size + i for p in pages for i in range(page_size)])
    for layer in range(layers):
        assert torch.equal(as_bits(k_dec[layer])[rows], as_bits(k_full[layer])[rows])
        assert torch.equal(as_bits(v_dec[layer])[rows], as_bits(v_full[layer])[rows])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda a: {**a, "src_head_start": 3, "num_heads": 2},
            r"source heads \[3, 5\) are outside the 4 KV heads",
        ),
        (lambda a: {**a, "page_indices": [0, 99]}, "page index 99 is outside the pool's 16 pages"),
        (lambda a: {**a, "page_indices": [-1]}, "page index -1 is outside"),
        (lambda a: {**a, "page_indices": [3, 1, 3]}, "page index 3 appears more than once"),
        (lambda a: {**a, "page_indices": np.array([[1]])}, "1-D integer sequence"),
        (
            lambda a: {**a, "staging": torch.empty(10, dtype=torch.uint8)},
            "staging holds 10 bytes but",
        ),
        (lambda a: {**a, "v_buffers": a["v_buffers"][:1]}, "one K and one V buffer per layer"),
        (
            lambda a: {**a, "staging": torch.empty(4096, dtype=torch.uint8, device="meta")},
            "KV buffers are on cpu but staging is on meta",
        ),
        (lambda a: {**a, "backend": "cuda-magic"}, "unknown kernel backend 'cuda-magic'"),
    ],
)
def test_bad_arguments_are_clear_errors(change, message) -> None:
    k, v = random_kv(2, 64, 4, 8, torch.float32, seed=0)
    args = {
        "k_buffers": k,
        "v_buffers": v,
        "page_indices": [1, 2],
        "staging": torch.empty(1 << 14, dtype=torch.uint8),
        "src_head_start": 0,
        "num_heads": 2,
        "page_size": 4,
    }
    args = change(args)
    k, v, pages, staging = (
        args[key] for key in ("k_buffers", "v_buffers", "page_indices", "staging")
    )
    heads = KVSlice(args["src_head_start"], args["num_heads"], args["page_size"])
    with pytest.raises(ValueError, match=message):
        gather_slice(k, v, pages, staging, heads, args.get("backend"))


def test_the_keyword_forms_are_the_slice_forms() -> None:
    """`gather_all_layers_to_staging` and `scatter_staging_to_kv`'s one block (the forms
    callers outside staging use) copy what `gather_slice` and `scatter_slice` copy."""
    k, v = random_kv(2, 32, 4, 8, torch.bfloat16, seed=5)
    pages, heads = random_pages(8, 3, seed=5), KVSlice(1, 2, 4)
    by_slice, by_keywords = (torch.full((4096,), fill, dtype=torch.uint8) for fill in (0, 1))
    n = gather_slice(k, v, pages, by_slice, heads)
    keywords = {"num_heads": 2, "page_size": 4}
    assert gather_all_layers_to_staging(k, v, pages, by_keywords, src_head_start=1, **keywords) == n
    assert torch.equal(by_slice[:n], by_keywords[:n])
    k1, v1, k2, v2 = ([torch.zeros_like(t) for t in k] for _ in range(4))
    assert scatter_slice(by_slice, k1, v1, pages, heads) == n
    assert scatter_staging_to_kv(by_slice, k2, v2, pages, dst_head_start=1, **keywords) == n
    assert all(torch.equal(as_bits(a), as_bits(b)) for a, b in zip(k1 + v1, k2 + v2, strict=True))


def test_gather_takes_no_gpu_id() -> None:
    k, v = random_kv(1, 16, 2, 4, torch.float32, seed=0)
    with pytest.raises(TypeError):
        gather_all_layers_to_staging(  # type: ignore[call-arg]
            k,
            v,
            [0],
            torch.empty(1024, dtype=torch.uint8),
            src_head_start=0,
            num_heads=1,
            page_size=4,
            gpu_id=0,
        )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("start", "count"), [(0, 4), (2, 2), (1, 2)])
def test_buffers_sharing_one_storage_take_the_fused_path(
    monkeypatch, page_size, start, count
) -> None:
    index_ops_only(monkeypatch)
    layers, heads, dim = 3, 4, 8
    kv = torch.randn(layers, 2, 10 * page_size, heads, dim)  # [layers, K/V, pool, heads, dim]
    k = [kv[layer, 0] for layer in range(layers)]
    v = [kv[layer, 1] for layer in range(layers)]
    pages = random_pages(10, 4, seed=page_size + start)
    staging = torch.empty(1 << 16, dtype=torch.uint8)
    heads = KVSlice(start, count, page_size)
    n = gather_slice(k, v, pages, staging, heads, "torch")
    expected = naive_gather(k, v, pages, page_size, start, count)
    assert torch.equal(staging[:n].view(expected.dtype).view(expected.shape), expected)
    target = torch.zeros_like(kv)
    tk = [target[layer, 0] for layer in range(layers)]
    tv = [target[layer, 1] for layer in range(layers)]
    scatter_slice(staging, tk, tv, pages, heads, "torch")
    rows = torch.tensor([int(p) * page_size + i for p in pages for i in range(page_size)])
    mask = torch.zeros_like(kv, dtype=torch.bool)
    mask[:, :, rows, start : start + count] = True
    assert torch.equal(target[mask], kv[mask]) and not target[~mask].any()


# (BLOCK_T cap, BLOCK_B, steps per program): buffer walks, uneven last walks (masked
# buffers), several buffers per step and token blocks that end mid-block.
WALKS = [(4, 1, 3), (8, 2, 2), (2, 4, 1), (16, 1, 7), (1, 2, 5)]


@pytest.mark.parametrize(("block_t", "block_b", "steps"), WALKS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_buffer_walks_are_bitwise(monkeypatch, block_t, block_b, steps, page_size) -> None:
    from pdctl.staging.kernels import triton as triton_kernels

    original = triton_kernels.tile

    def forced(num_cols, word, num_tokens, num_buffers, num_sms):
        _, block_c, _, _, _, warps = original(num_cols, word, num_tokens, num_buffers, num_sms)
        buffer_steps = -(-num_buffers // block_b)
        return block_t, block_c, block_b, steps, -(-buffer_steps // steps), warps

    monkeypatch.setattr(triton_kernels, "tile", forced)
    run_case("triton", 3, page_size, (8, 4, 4), torch.bfloat16, seed=block_t + steps)


@pytest.mark.parametrize("in_c", [True, False], ids=["c", "numpy"])
def test_host_page_checks_catch_every_bad_list(in_c: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every strategy of the page check (one pass in C; numpy's pool-sized marks or
    per-thread stamps) agrees with the definition: every id in range, none twice; an
    id outside is named before a repeat anywhere."""
    from pdctl.staging.kernels import native
    from pdctl.staging.kernels.pages import check_host_pages

    if in_c and not native.available()[0]:
        pytest.skip(f"the C library is not built here: {native.available()[1]}")
    if not in_c:
        monkeypatch.setattr(native, "check_ids", lambda ids, num_pages, out=None: None)
    with pytest.raises(ValueError, match="page index -1 is outside"):
        check_host_pages(np.array([1, 1, -1], dtype=np.int64), 8)
    with pytest.raises(ValueError, match="page index 3 appears more than once"):
        check_host_pages(np.array([5, 3, 0, 3, 5], dtype=np.int64), 8)

    @settings(max_examples=200, deadline=None)
    @given(
        pages=st.lists(st.integers(-3, 5000), min_size=1, max_size=64),
        num_pages=st.sampled_from([40, 64, 5000, 1 << 16]),  # small pools and large ones
    )
    def check(pages: list[int], num_pages: int) -> None:
        _check_pages_against_the_definition(check_host_pages, pages, num_pages)

    check()


def _check_pages_against_the_definition(check_host_pages, pages, num_pages) -> None:  # type: ignore[no-untyped-def]
    array = np.array(pages, dtype=np.int64)
    outside = any(p < 0 or p >= num_pages for p in pages)
    repeated = len(set(pages)) != len(pages)
    if outside:
        with pytest.raises(ValueError, match="outside the pool"):
            check_host_pages(array, num_pages)
    elif repeated:
        with pytest.raises(ValueError, match="appears more than once"):
            check_host_pages(array, num_pages)
    else:
        check_host_pages(array, num_pages)
        for given in (array, torch.from_numpy(array)):  # numpy, or a tensor (its address)
            into = torch.full((len(pages),), -7, dtype=torch.int64)  # a replay's slot
            check_host_pages(given, num_pages, into)
            assert into.tolist() == pages
