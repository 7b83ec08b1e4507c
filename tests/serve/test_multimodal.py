"""Images in the engine: the same tokens at TP 1 and TP 2, whole or chunked prefill,
and the prompt helpers (markers, placeholder ids, items)."""

from __future__ import annotations

import base64
import random
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdctl.serve.multimodal import (
    PromptError,
    check_items,
    expand,
    placeholder_ids,
)
from tests.serve.conftest import start_server

GREEDY = {"temperature": 0, "max_new_tokens": 6}


def picture(seed: int, height: int = 16, width: int = 16) -> dict[str, Any]:
    rng = random.Random(seed)
    data = bytes(rng.randrange(256) for _ in range(3 * height * width))
    return {"data": base64.b64encode(data).decode(), "dtype": "uint8", "shape": [3, height, width]}


BODIES = [
    {"text": "An image: <image> and more text after it.", "image": picture(1)},
    {"input_ids": [5, -1, 6, 7, -1, 8], "images": [picture(2, 8, 8), picture(3, 12, 16)]},
    {"input_ids": list(range(3, 40)), "image": picture(4, 32, 32)},  # 64 image positions
]


def outputs(url: str) -> list[list[int]]:
    return [
        httpx.post(f"{url}/generate", json={**b, "sampling_params": GREEDY}, timeout=60).json()[
            "output_ids"
        ]
        for b in BODIES
    ]


def test_tp2_and_chunked_prefill_give_the_tp1_tokens() -> None:
    servers = [
        start_server("--model-preset", "tiny", name="mm1"),
        start_server("--model-preset", "tiny", tp=2, name="mm2"),
        # chunks of 16 tokens: every image straddles chunk boundaries
        start_server("--model-preset", "tiny", "--chunked-prefill-tokens", "16", name="mm3"),
    ]
    try:
        results = [outputs(s.url) for s in servers]
    finally:
        for server in servers:
            server.stop()
    assert results[0] == results[1] == results[2]
    assert len({tuple(r) for r in results[0]}) == 3


@given(st.integers(0, 2**64 - 1), st.integers(1, 64), st.integers(2, 50_000))
def test_placeholder_ids_are_in_the_vocabulary_and_repeatable(
    digest: int, count: int, vocab: int
) -> None:
    ids = placeholder_ids(digest, count, vocab)
    assert len(ids) == count and all(0 <= i < vocab for i in ids)
    assert placeholder_ids(digest, count, vocab) == ids


def test_expand_places_each_image_at_its_marker() -> None:
    a, b = torch.ones(3, 4), torch.zeros(2, 4)
    ids, items = expand([7, -1, 8, -1], [a, b], vocab=500)
    assert items == [{"offset": 1, "num_tokens": 3}, {"offset": 5, "num_tokens": 2}]
    assert ids[0] == 7 and ids[4] == 8 and len(ids) == 7
    first, _ = expand([-1, 9], [a], vocab=500)
    again, _ = expand([9], [a], vocab=500)  # unmarked: images first
    assert first == again
    other, _ = expand([-1, 9], [a + 1], vocab=500)
    assert other[:3] != first[:3]  # another image, other placeholders
    with pytest.raises(PromptError, match="marks 2 image"):
        expand([-1, -1], [a], vocab=500)


@pytest.mark.parametrize(
    ("items", "words"),
    [
        ([], "list of 1..8"),
        ([{"offset": 2, "num_tokens": 3}, {"offset": 3, "num_tokens": 1}], "not overlapping"),
        ([{"offset": 8, "num_tokens": 3}], "past the prompt's 10 tokens"),
        ([{"offset": 0, "num_tokens": 0}], "in order"),
        (["x"], "in order"),
        ([{"offset": 0, "num_tokens": 4}], "4 positions but 5 embedding rows"),
    ],
)
def test_items_are_checked_against_prompt_and_rows(items: Any, words: str) -> None:
    with pytest.raises(PromptError, match=words):
        check_items(items, prompt_len=10, rows=5)
