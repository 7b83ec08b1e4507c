"""The verify workload: deterministic prompts from a seed, shaped by the topology.

Lengths are chosen against the topology so every path runs: shorter than a page,
exactly a page, longer than a prefill chunk, longer than a staging segment, and
longer than the decode ring (so one request wraps it). Families share a long
prefix (whole pages) so the prefix-hit pass has something to reuse; a few text
prompts go through the tokenizer. Every prompt is token ids or text, never both.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

from pdctl.core import MODEL_PRESETS, ModelShape, read_checkpoint_shape
from pdctl.engines.dialect import PromptBody
from pdctl.topology.model import Topology

TEXTS = (
    "The staging buffer gathers each decode rank's heads into one contiguous write.",
    "Prefill computes the prompt; decode generates the answer, one token at a time.",
    "A radix cache reuses the pages of a shared prefix across requests.",
)


class PromptRecord(TypedDict):
    """A prompt in a report."""

    id: str
    kind: str
    input_ids: None  # regenerated from the seed
    text: str | None
    family: str | None
    images: int  # how many (regenerated from the seed)
    length: int


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # sub-page | one-page | chunked | segmented | ring-wrap | family | text
    input_ids: list[int] | None = None
    text: str | None = None
    family: str | None = None
    images: tuple[Any, ...] = ()  # EPD topologies: images the encoder turns into embeddings

    @property
    def length(self) -> int:
        return len(self.input_ids) if self.input_ids is not None else len(self.text or "")

    def body(self) -> PromptBody:
        body: PromptBody = (
            {"input_ids": self.input_ids} if self.input_ids is not None else {"text": self.text}
        )
        if self.images:
            body["images"] = list(self.images)
        return body

    def to_json(self) -> PromptRecord:
        """The prompt as a report lists it: its ids and images are regenerated from the
        seed, so a report stays small (the number of images kept)."""
        return {
            "id": self.id,
            "kind": self.kind,
            "input_ids": None,
            "text": self.text,
            "family": self.family,
            "images": len(self.images),
            "length": self.length,
        }


@dataclass(frozen=True)
class Shape:
    """What the workload needs to know of the topology, in tokens."""

    page: int
    chunk: int
    segment: int
    ring: int
    max_context: int
    vocab: int
    encoder: bool = False

    @staticmethod
    def of(topology: Topology) -> Shape:
        page = topology.serving.page_size
        chunk = topology.serving.chunked_prefill_tokens
        preset = (
            MODEL_PRESETS.get(topology.model.preset or "") if topology.model.uses_preset else None
        )
        if preset is not None:
            elem = 2 if topology.effective_dtype in ("float16", "bfloat16") else 4
            heads = max(1, preset.num_kv_heads // topology.roles.decode.tp)
            per_token = 2 * preset.num_layers * heads * preset.head_dim * elem
            staging = topology.transfer.staging
            segment = int(staging.effective_segment_mb * (1 << 20)) // per_token
            ring = int(staging.pool_size_mb * (1 << 20)) // per_token
            max_context, vocab = preset.max_position, preset.vocab_size
        else:  # a checkpoint: its config.json bounds ids and lengths, where it is here
            segment, ring, max_context, vocab = 512, 2048, 4096, 32000
            checkpoint = checkpoint_shape(topology)
            if checkpoint is not None:  # never an id the model does not have
                max_context, vocab = checkpoint.max_position, checkpoint.vocab_size
        encoder = topology.roles.encoder is not None
        return Shape(page, chunk, max(page, segment), max(page, ring), max_context, vocab, encoder)


def checkpoint_shape(topology: Topology) -> ModelShape | None:
    """The shape in model.path's config.json (absolute once loaded), None when unreadable
    here (a hub id, another host's path): the servers' own report still bounds the ids."""
    if topology.model.path is None:
        return None
    try:
        return read_checkpoint_shape(Path(topology.model.path).expanduser())
    except (OSError, ValueError):
        return None


def build(shape: Shape, count: int, seed: int, max_new_tokens: int) -> list[Prompt]:
    """`count` prompts; the mix below is cycled, so every count gets the short kinds first."""
    rng = random.Random(seed)
    room = shape.max_context - max_new_tokens - 1  # the longest prompt that still fits
    low, high = 3, min(shape.vocab, 32000) - 1

    def ids(n: int) -> list[int]:
        return [rng.randint(low, high) for _ in range(max(1, min(n, room)))]

    prefix_len = min(3 * shape.page, room // 2)
    families = {f"f{k}": ids(prefix_len) for k in range(2)}
    lengths = {
        "sub-page": max(1, shape.page // 2 - 1),
        "one-page": shape.page,
        "chunked": shape.chunk + shape.page // 2 + 1,
        "segmented": shape.segment + shape.segment // 2 + 1,
        "ring-wrap": shape.ring + shape.page * 3 + 5,
    }
    order = [
        "sub-page",
        "family:f0",
        "one-page",
        "family:f0",
        "text",
        "segmented",
        "family:f1",
        "chunked",
        "family:f1",
        "ring-wrap",
        "text",
        "family:f0",
    ]
    prompts: list[Prompt] = []
    texts = 0
    for index in range(count):
        kind = order[index % len(order)]
        pid = f"p{index:03d}"
        if kind.startswith("family:"):
            family = kind.split(":")[1]
            tail = ids(rng.randint(1, shape.page + 3))
            prompts.append(Prompt(pid, "family", families[family] + tail, family=family))
        elif kind == "text":
            prompts.append(Prompt(pid, "text", text=f"{TEXTS[texts % len(TEXTS)]} ({index})"))
            texts += 1
        else:
            prompts.append(Prompt(pid, kind, ids(lengths[kind])))
    return with_images(prompts, rng) if shape.encoder else prompts


def image(rng: random.Random, height: int, width: int, raw: bool) -> Any:
    """A deterministic 3-channel image: base64 uint8 bytes, or nested lists of floats."""
    if raw:
        data = bytes(rng.randrange(256) for _ in range(3 * height * width))
        return {
            "data": base64.b64encode(data).decode(),
            "dtype": "uint8",
            "shape": [3, height, width],
        }
    return [
        [[round(rng.random(), 3) for _ in range(width)] for _ in range(height)] for _ in range(3)
    ]


def with_images(prompts: list[Prompt], rng: random.Random) -> list[Prompt]:
    """EPD: images on the short prompts. A family shares one image at its start, so the
    prefix-hit pass reuses image positions too; a text prompt marks where its image goes;
    every third sub-page or one-page prompt carries two images of different sizes."""
    family_images = {f: image(rng, 16, 16, raw=True) for f in ("f0", "f1")}
    out, count = [], 0
    for prompt in prompts:
        if prompt.kind == "family" and prompt.family is not None:
            prompt = replace(prompt, images=(family_images[prompt.family],))
        elif prompt.kind == "text" and prompt.text is not None:
            words = prompt.text.split(" ")
            text = " ".join([*words[:3], "<image>", *words[3:]])
            prompt = replace(prompt, text=text, images=(image(rng, 8, 12, raw=False),))
        elif prompt.kind in ("sub-page", "one-page"):
            count += 1
            shapes = [(12, 8), (4, 16)] if count % 3 == 0 else [(8, 8)]
            marks = [-1] * len(shapes)
            assert prompt.input_ids is not None
            ids = [*prompt.input_ids[:1], *marks[:1], *prompt.input_ids[1:], *marks[1:]]
            images = tuple(image(rng, h, w, raw=bool(count % 2)) for h, w in shapes)
            prompt = replace(prompt, input_ids=ids, images=images)
        out.append(prompt)
    return out
