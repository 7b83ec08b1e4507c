"""The EPD image encoder: image parsing is total and strict, encoding is deterministic.

`parse_image` must answer any JSON value with a tensor or an ImageError (hypothesis
over arbitrary and near-valid values); both wire forms of one image parse to the
same bits. `EncoderModel.encode` must give bitwise equal embeddings for the same
image and seed, whatever ran before, and embeddings that depend on the image.
"""

from __future__ import annotations

import base64
import concurrent.futures
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl.core import MODEL_PRESETS
from pdctl.serve.model.encoder import (
    CHANNELS,
    IMAGE_DTYPES,
    MAX_SIDE,
    PATCH,
    EncoderModel,
    ImageError,
    num_image_tokens,
    parse_image,
)
from pdctl.serve.model.weights import preset_source

torch.set_num_threads(1)
HIDDEN = MODEL_PRESETS["tiny"].hidden_size
MODEL = EncoderModel(HIDDEN, seed=0)
TORCH_DTYPES = {"uint8": torch.uint8, "float32": torch.float32, "float16": torch.float16}
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def raw_form(tensor: torch.Tensor) -> dict[str, Any]:
    """The base64 wire form of a [3, H, W] tensor in its own dtype."""
    data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    return {
        "data": base64.b64encode(data).decode(),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
    }


def random_image(
    height: int, width: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (CHANNELS, height, width), generator=generator).to(dtype)
    return torch.rand((CHANNELS, height, width), generator=generator).to(dtype)


sides = st.integers(1, 4).map(lambda n: n * PATCH)


# ---------------------------------------------------------------- parse_image


@FAST
@given(sides, sides, st.sampled_from(IMAGE_DTYPES), st.integers(0, 2**31))
def test_list_and_base64_forms_parse_to_the_same_bits(
    height: int, width: int, dtype: str, seed: int
) -> None:
    image = random_image(height, width, seed, TORCH_DTYPES[dtype])
    from_raw = parse_image(raw_form(image))
    expected = image.float() / 255.0 if dtype == "uint8" else image.float()
    from_lists = parse_image(expected.tolist())
    assert from_raw.dtype == from_lists.dtype == torch.float32
    assert from_raw.shape == (CHANNELS, height, width)
    assert torch.equal(from_raw, from_lists)
    assert torch.equal(from_raw, expected)


def test_uint8_is_scaled_and_list_numbers_are_kept() -> None:
    pixels = torch.tensor([0, 51, 255], dtype=torch.uint8).repeat(CHANNELS, PATCH, 1)
    pixels = torch.cat([pixels, pixels[:, :, :1]], dim=2)  # [3, 4, 4]
    parsed = parse_image(raw_form(pixels))
    assert parsed[0, 0].tolist() == pytest.approx([0.0, 0.2, 1.0, 0.0])
    ints = [[[7] * PATCH] * PATCH] * CHANNELS  # ints, not scaled
    assert torch.equal(parse_image(ints), torch.full((CHANNELS, PATCH, PATCH), 7.0))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=30,
)


@st.composite
def near_valid_lists(draw: st.DrawFn) -> Any:
    """Nested lists that are valid except, perhaps, for one spoiled place."""
    height, width = draw(sides), draw(sides)
    image: list[Any] = random_image(height, width, draw(st.integers(0, 9))).tolist()
    spoil = draw(st.sampled_from(["none", "pixel", "row", "channel", "drop-row", "extra"]))
    bad = draw(json_values | st.just(float("nan")) | st.just(10**400))
    c, h, w = draw(st.integers(0, 2)), draw(st.integers(0, height - 1)), draw(st.integers(0, 1))
    if spoil == "pixel":
        image[c][h][w] = bad
    elif spoil == "row":
        image[c][h] = bad
    elif spoil == "channel":
        image[c] = bad
    elif spoil == "drop-row":
        del image[c][h]
    elif spoil == "extra":
        image.append(bad)
    return image


@st.composite
def near_valid_raw(draw: st.DrawFn) -> Any:
    """Base64 objects with, perhaps, one field replaced or its data cut."""
    dtype = draw(st.sampled_from(IMAGE_DTYPES))
    form = raw_form(random_image(draw(sides), draw(sides), 0, TORCH_DTYPES[dtype]))
    field = draw(st.sampled_from(["none", "data", "dtype", "shape", "cut", "drop", "add"]))
    if field in ("data", "dtype", "shape"):
        form[field] = draw(json_values | st.lists(st.integers(-5, 100), max_size=4))
    elif field == "cut":
        form["data"] = form["data"][: draw(st.integers(0, len(form["data"])))]
    elif field == "drop":
        del form[draw(st.sampled_from(["data", "dtype", "shape"]))]
    elif field == "add":
        form[draw(st.text(max_size=5))] = 1
    return form


@FAST
@given(json_values | near_valid_lists() | near_valid_raw())
def test_any_json_value_gives_a_tensor_or_an_image_error(value: Any) -> None:
    try:
        image = parse_image(value, where="req.image")
    except ImageError as error:
        assert str(error).startswith("req.image"), str(error)
        return
    assert image.dtype == torch.float32 and image.dim() == 3
    channels, height, width = image.shape
    assert channels == CHANNELS and height % PATCH == 0 and width % PATCH == 0
    assert 0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE
    assert bool(torch.isfinite(image).all())


def good_raw(**changes: Any) -> dict[str, Any]:
    return {**raw_form(random_image(8, 8)), **changes}


def good_lists() -> list[Any]:
    return random_image(8, 8).tolist()


def spoiled_lists(c: int, h: int, w: int | None, value: Any) -> list[Any]:
    image = good_lists()
    if w is None:
        image[c][h] = value
    else:
        image[c][h][w] = value
    return image


ERRORS = [
    (42, "image: expected nested lists or an object with data, dtype and shape"),
    ("abc", "image: expected nested lists or an object with data, dtype and shape"),
    (None, "image: expected nested lists or an object with data, dtype and shape"),
    (good_raw(data="not base64!"), "image.data: not valid base64"),
    (good_raw(data="é"), "image.data: not valid base64"),
    (good_raw(data=5), "image.data: expected a base64 string, got an integer"),
    (good_raw(data="AAAA"), "image.data: 3 bytes, expected 768 (3 * 8 * 8 float32 values)"),
    (
        good_raw(shape=[3, 5, 8]),
        "image.shape: [3, 5, 8]: height 5 is not a multiple of the patch size 4",
    ),
    (
        good_raw(shape=[3, 8, 6]),
        "image.shape: [3, 8, 6]: width 6 is not a multiple of the patch size 4",
    ),
    (good_raw(shape=[3, 68, 8]), "image.shape: [3, 68, 8]: height 68 is not in 1..64"),
    (good_raw(shape=[3, 8, 0]), "image.shape: [3, 8, 0]: width 0 is not in 1..64"),
    (good_raw(shape=[4, 8, 8]), "image.shape: [4, 8, 8]: 4 channels, expected 3"),
    (good_raw(shape=[3, 8]), "image.shape: expected three integers [3, height, width]"),
    (good_raw(shape=[3, True, 8]), "image.shape: expected three integers [3, height, width]"),
    (good_raw(shape=[3, 10**30, 8]), "image.shape: [3, (huge), 8]: height (huge) is not in 1..64"),
    (good_raw(dtype="int32"), "image.dtype: 'int32' is not one of uint8, float32, float16"),
    (good_raw(dtype=None), "image.dtype: None is not one of uint8, float32, float16"),
    (
        good_raw(extra=1),
        "image: unknown key 'extra'; expected an object with data, dtype and shape",
    ),
    (
        {"data": "", "dtype": "uint8"},
        "image: missing shape; expected an object with data, dtype and shape",
    ),
    (raw_form(torch.full((3, 4, 4), float("nan"))), "image: NaN or infinite values"),
    ([], "image: 0 channels, expected 3"),
    (good_lists()[:2], "image: 2 channels, expected 3"),
    ([[[0.0] * 8] * 5] * 3, "image: height 5 is not a multiple of the patch size 4"),
    ([[[0.0] * 3] * 8] * 3, "image: width 3 is not a multiple of the patch size 4"),
    ([[[0.0] * 68] * 8] * 3, "image: width 68 is not in 1..64"),
    ([[]] * 3, "image: height 0 is not in 1..64"),
    ([good_lists()[0], "x", good_lists()[0]], "image[1]: expected a list of rows, got a string"),
    ([*good_lists()[:2], good_lists()[2][:4]], "image[2]: 4 rows, expected 8"),
    (spoiled_lists(0, 1, None, [0.0] * 7), "image[0][1]: row of 7 values, expected 8"),
    (spoiled_lists(0, 1, None, 3), "image[0][1]: expected a list of numbers, got an integer"),
    (spoiled_lists(1, 2, 3, True), "image[1][2][3]: expected a number, got a boolean"),
    (spoiled_lists(1, 2, 3, "1"), "image[1][2][3]: expected a number, got a string"),
    (spoiled_lists(1, 2, 3, None), "image[1][2][3]: expected a number, got null"),
    (spoiled_lists(2, 0, 0, 10**400), "image[2][0][0]: number too large"),
    (spoiled_lists(2, 0, 0, float("inf")), "image: NaN or infinite values"),
    (spoiled_lists(2, 0, 0, float("nan")), "image: NaN or infinite values"),
    (spoiled_lists(2, 0, 0, 1e300), "image: NaN or infinite values"),  # inf in float32
]


@pytest.mark.parametrize(("value", "message"), ERRORS)
def test_each_error_names_what_is_wrong(value: Any, message: str) -> None:
    with pytest.raises(ImageError, match=f"^{re.escape(message)}$"):
        parse_image(value)


def test_errors_start_with_the_given_place() -> None:
    with pytest.raises(ImageError, match=r"^messages\[0\]\.image\.data: not valid base64$"):
        parse_image(good_raw(data="!!"), where="messages[0].image")
    assert issubclass(ImageError, ValueError)


# ---------------------------------------------------------------- EncoderModel


@pytest.mark.parametrize(("height", "width"), [(4, 4), (8, 12), (64, 64), (16, 64)])
def test_encode_gives_one_hidden_vector_per_patch(height: int, width: int) -> None:
    out = MODEL.encode(random_image(height, width))
    assert num_image_tokens(height, width) == (height // PATCH) * (width // PATCH)
    assert out.shape == (num_image_tokens(height, width), HIDDEN)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert bool(torch.isfinite(out).all())
    assert MODEL.width == 64 and MODEL.hidden_size == HIDDEN


def test_output_scale_matches_the_token_embeddings() -> None:
    out = MODEL.encode(random_image(32, 32))
    embed = preset_source(0)("model.embed_tokens.weight", (64, HIDDEN))
    ratio = float(out.pow(2).mean().sqrt() / embed.pow(2).mean().sqrt())
    assert 0.5 < ratio < 2.0, ratio


def test_same_seed_gives_bitwise_equal_embeddings_whatever_runs_between() -> None:
    image, other = random_image(16, 24, seed=1), random_image(64, 8, seed=2)
    first = MODEL.encode(image)
    torch.manual_seed(1234)  # the global RNG plays no part
    twin = EncoderModel(HIDDEN, seed=0)
    MODEL.encode(other)
    twin.encode(random_image(4, 4, seed=3))
    assert torch.equal(twin.encode(image), first)
    assert torch.equal(MODEL.encode(image), first)
    assert torch.equal(MODEL.encode(image.clone()), first)


def test_building_a_model_leaves_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    EncoderModel(32, seed=5)
    assert torch.equal(torch.get_rng_state(), state)


def test_embeddings_depend_on_the_image_the_position_and_the_seed() -> None:
    image = random_image(16, 16, seed=4)
    base = MODEL.encode(image)
    nudged = image.clone()
    nudged[0, 0, 0] += 0.5
    moved = MODEL.encode(nudged)
    assert not torch.equal(moved, base)
    assert float((moved[0] - base[0]).abs().max()) > 1e-3  # the changed patch itself
    assert bool((moved != base).any(dim=1).all())  # attention spreads it to every patch
    flat = MODEL.encode(torch.full((CHANNELS, 8, 8), 0.5))
    assert len({tuple(row.tolist()) for row in flat}) == 4  # same pixels, distinct positions
    assert not torch.equal(EncoderModel(HIDDEN, seed=1).encode(image), base)


def test_bfloat16_model_runs_and_tracks_float32() -> None:
    model = EncoderModel(HIDDEN, dtype=torch.bfloat16, seed=0)
    image = random_image(12, 20, seed=6)
    out = model.encode(image)
    assert out.shape == (15, HIDDEN) and out.dtype == torch.bfloat16
    assert torch.equal(model.encode(image), out)
    reference = MODEL.encode(image)
    cosine = torch.nn.functional.cosine_similarity(out.float().flatten(), reference.flatten(), 0)
    assert float(cosine) > 0.99


def test_odd_hidden_sizes_are_padded_internally() -> None:
    out = EncoderModel(100, seed=0).encode(random_image(8, 8))
    assert out.shape == (4, 100) and out.is_contiguous()


@pytest.mark.parametrize("shape", [(3, 8), (1, 8, 8), (3, 6, 8), (3, 8, 128)])
def test_encode_refuses_a_bad_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(ImageError, match=r"^image: "):
        MODEL.encode(torch.zeros(shape))


# ---------------------------------------------------------------- tensor parallelism


class ThreadGather:
    """An all-gather across `world` threads, in rank order (what TPGroup.gather does
    across processes), so the TP ranks of one encoder run side by side in-process."""

    def __init__(self, world: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def gather(partials: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = partials.clone()
            self.barrier.wait()
            stacked = torch.cat([p for p in self.parts if p is not None])
            self.barrier.wait()  # everyone has read the parts before the next product
            return stacked

        return gather


def encode_with_tp(tp: int, image: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's output of one image, the ranks running concurrently; rank 0
    announces the image first, as the encoder role does."""
    gather = ThreadGather(tp)
    models = [
        EncoderModel(HIDDEN, dtype=dtype, seed=0, tp=tp, tp_rank=rank, gather=gather.for_rank(rank))
        for rank in range(tp)
    ]
    announced: list[torch.Tensor] = []
    models[0].announce = announced.append
    with concurrent.futures.ThreadPoolExecutor(tp) as pool:
        outputs = list(pool.map(lambda m: m.encode(image), models))
    assert len(announced) == 1 and torch.equal(announced[0], image)
    return outputs


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_tp_ranks_give_bitwise_the_tp1_embeddings(tp: int, dtype: torch.dtype) -> None:
    single = EncoderModel(HIDDEN, dtype=dtype, seed=0)
    for height, width in [(4, 4), (12, 20), (64, 64)]:
        image = random_image(height, width, seed=height + width)
        outputs = encode_with_tp(tp, image, dtype)
        expected = single.encode(image)
        for rank, out in enumerate(outputs):
            assert torch.equal(out, expected), (tp, rank, height, width)


def test_each_rank_holds_only_its_share() -> None:
    gather = ThreadGather(2).for_rank(1)
    rank1 = EncoderModel(HIDDEN, seed=0, tp=2, tp_rank=1, gather=gather)
    layer, full = rank1.layers[0], MODEL.layers[0]
    assert rank1.local_heads == 2 and layer.qkv_t.shape == (64, 3 * 32)
    assert layer.fc1_t.shape == (64, 128) and len(layer.fc2_chunks) == len(full.fc2_chunks) // 2
    assert torch.equal(layer.fc2_chunks[0], full.fc2_chunks[len(full.fc2_chunks) // 2])


@pytest.mark.parametrize(
    ("tp", "rank", "gather", "message"),
    [
        (3, 0, True, "4 attention heads do not split over 3 ranks"),
        (8, 0, True, "TP sizes that work: 1, 2, 4"),
        (2, 2, True, "rank 2 of 2"),
        (2, 0, False, "a gather for TP > 1"),
        (1, 0, True, "a gather for TP > 1"),
    ],
)
def test_impossible_tp_layouts_are_refused(tp: int, rank: int, gather: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EncoderModel(HIDDEN, tp=tp, tp_rank=rank, gather=(lambda t: t) if gather else None)
