"""Multimodal prompts: image markers, placeholder token ids, and where embeddings go.

A client puts images in a request (`image` or `images`) and marks where each goes in
the prompt: the token id -1 in `input_ids`, or the text `<image>` in `text`; with no
marker at all the images go first, in order. Whoever runs the encoder (the encoder
role of an EPD topology, or a colocated server in-process) turns image i into N_i
embedding vectors and the prompt into plain token ids, where image i occupies N_i
placeholder positions:

    placeholder ids = N_i ids drawn from the image's embedding digest

so two different images never share a radix-cache prefix and the same image always
does (its embeddings, hence its KV, are the same). `items` say which positions take
embeddings instead of token embeddings: [{"offset": o, "num_tokens": n}], in order,
rows of the concatenated embeddings [sum n, hidden].
"""

from __future__ import annotations

from typing import Any

import torch

from pdctl.serve.model.encoder import EncoderModel, ImageError, parse_image
from pdctl.serve.tokenizer import Tokenizer
from pdctl.staging.digest import chunk_digests

IMAGE_MARKER = -1
TEXT_MARKER = "<image>"
MAX_IMAGES = 8
_MASK = (1 << 64) - 1


class PromptError(ValueError):
    """A multimodal prompt that cannot be built; the message names the field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def images_of(body: Any) -> list[Any]:
    """The request's images (`image` or `images`), at most MAX_IMAGES; [] for none."""
    image, images = getattr(body, "image", None), getattr(body, "images", None)
    if image is not None and images is not None:
        raise PromptError("give image or images, not both", "images")
    if image is not None:
        return [image]
    if images is None:
        return []
    if not isinstance(images, list) or not images:
        raise PromptError("images must be a non-empty list", "images")
    if len(images) > MAX_IMAGES:
        raise PromptError(f"at most {MAX_IMAGES} images per request, got {len(images)}", "images")
    return images


def marked_prompt(text: Any, input_ids: Any, tokenizer: Tokenizer, vocab: int) -> list[int]:
    """One prompt as token ids with IMAGE_MARKER where images go."""
    if (text is None) == (input_ids is None):
        raise PromptError("give exactly one of text and input_ids", "text")
    if text is not None:
        if not isinstance(text, str):
            raise PromptError("a multimodal request takes one prompt, not a batch", "text")
        ids: list[int] = []
        for index, part in enumerate(text.split(TEXT_MARKER)):
            if index:
                ids.append(IMAGE_MARKER)
            ids += tokenizer.encode(part)
        return ids
    if not isinstance(input_ids, list) or any(isinstance(x, list) for x in input_ids):
        raise PromptError("a multimodal request takes one prompt, not a batch", "input_ids")
    for index, token in enumerate(input_ids):
        if token != IMAGE_MARKER and not 0 <= token < vocab:
            raise PromptError(
                f"token {token} at input_ids[{index}] is outside the vocabulary "
                f"(0..{vocab - 1}; {IMAGE_MARKER} marks an image)",
                "input_ids",
            )
    return list(input_ids)


def digest_of(embeddings: torch.Tensor) -> int:
    """One 64-bit digest of an embedding tensor's bytes (computed on its own device)."""
    return chunk_digests(embeddings.detach().contiguous().reshape(-1).view(torch.uint8), 1)[0]


def placeholder_ids(digest: int, count: int, vocab: int) -> list[int]:
    """`count` token ids drawn from `digest` (splitmix64 steps), all inside the vocabulary."""
    ids, state = [], digest & _MASK
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        ids.append((z ^ (z >> 31)) % vocab)
    return ids


def expand(
    marked: list[int], per_image: list[torch.Tensor], vocab: int
) -> tuple[list[int], list[dict[str, int]]]:
    """The prompt with each marker replaced by its image's placeholder ids, and the items."""
    markers = marked.count(IMAGE_MARKER)
    if markers == 0:
        marked = [IMAGE_MARKER] * len(per_image) + marked
    elif markers != len(per_image):
        raise PromptError(
            f"the prompt marks {markers} image(s) but the request has {len(per_image)}", "images"
        )
    ids: list[int] = []
    items: list[dict[str, int]] = []
    images = iter(per_image)
    for token in marked:
        if token != IMAGE_MARKER:
            ids.append(token)
            continue
        embeddings = next(images)
        items.append({"offset": len(ids), "num_tokens": int(embeddings.shape[0])})
        ids += placeholder_ids(digest_of(embeddings), int(embeddings.shape[0]), vocab)
    return ids, items


def check_items(items: Any, prompt_len: int, rows: int | None = None) -> list[dict[str, int]]:
    """Validate `mm_items` against the prompt (and the embedding rows, when known)."""
    if not isinstance(items, list) or not items or len(items) > MAX_IMAGES:
        raise PromptError(f"mm_items must be a list of 1..{MAX_IMAGES} items", "mm_items")
    checked, end, total = [], 0, 0
    for index, item in enumerate(items):
        offset = item.get("offset") if isinstance(item, dict) else None
        count = item.get("num_tokens") if isinstance(item, dict) else None
        if not (isinstance(offset, int) and isinstance(count, int)) or offset < end or count < 1:
            raise PromptError(
                f"mm_items[{index}] must be {{offset, num_tokens}} in order, not overlapping",
                "mm_items",
            )
        end, total = offset + count, total + count
        if end > prompt_len:
            raise PromptError(
                f"mm_items[{index}] ends at {end}, past the prompt's {prompt_len} tokens",
                "mm_items",
            )
        checked.append({"offset": offset, "num_tokens": count})
    if rows is not None and rows != total:
        raise PromptError(
            f"mm_items cover {total} positions but {rows} embedding rows arrived", "mm_items"
        )
    return checked


def splices(
    items: list[dict[str, int]], embeddings: torch.Tensor
) -> list[tuple[int, torch.Tensor]]:
    """(prompt offset, rows) per item, rows taken in order from `embeddings`."""
    out, row = [], 0
    for item in items:
        out.append((item["offset"], embeddings[row : row + item["num_tokens"]]))
        row += item["num_tokens"]
    return out


def encode_prompt(
    model: EncoderModel, tokenizer: Tokenizer, vocab: int, body: Any, images: list[Any]
) -> tuple[list[int], list[dict[str, int]], torch.Tensor]:
    """Run the encoder over a request: (prompt ids, items, embeddings [sum n, hidden])."""
    marked = marked_prompt(body.text, body.input_ids, tokenizer, vocab)
    tensors = []
    for index, image in enumerate(images):
        where = "image" if getattr(body, "image", None) is not None else f"images[{index}]"
        try:
            tensors.append(model.encode(parse_image(image, where)))
        except ImageError as exc:
            raise PromptError(str(exc), where) from None
    ids, items = expand(marked, tensors, vocab)
    return ids, items, torch.cat(tensors)
