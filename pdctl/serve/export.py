"""A preset written as a Hugging Face Llama checkpoint, for engines that load checkpoints.

`engine: vllm` with `model.preset` serves the very weights pdctl's own servers draw
for that preset and seed (`weights.preset_source`, CPU generator), saved under the
names transformers gives a Llama, with a tokenizer that encodes text as the presets'
byte tokenizer does (token i < 256 is byte i; 256 BOS, 257 EOS). The launcher runs
this module in pdctl's interpreter before it starts the servers
(`python -m pdctl.serve.export`), once per preset, seed and dtype: the folder
is written beside it and renamed into place, so a folder that exists is whole.

Not known here: any engine's flags. The checkpoint is plain transformers format.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from pdctl.core import MODEL_PRESETS, ModelShape
from pdctl.serve.model.weights import DTYPES, preset_source
from pdctl.serve.tokenizer import ByteTokenizer

FORMAT = 1  # bumped when what is written changes: an older folder is not reused


def tensor_names(shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama of `shape`, named and shaped as the loaders read them."""
    hidden, d = shape.hidden_size, shape.head_dim
    yield "model.embed_tokens.weight", (shape.vocab_size, hidden)
    for i in range(shape.num_layers):
        prefix = f"model.layers.{i}."
        yield prefix + "self_attn.q_proj.weight", (shape.num_attention_heads * d, hidden)
        yield prefix + "self_attn.k_proj.weight", (shape.num_kv_heads * d, hidden)
        yield prefix + "self_attn.v_proj.weight", (shape.num_kv_heads * d, hidden)
        yield prefix + "self_attn.o_proj.weight", (hidden, shape.num_attention_heads * d)
        yield prefix + "mlp.gate_proj.weight", (shape.intermediate_size, hidden)
        yield prefix + "mlp.up_proj.weight", (shape.intermediate_size, hidden)
        yield prefix + "mlp.down_proj.weight", (hidden, shape.intermediate_size)
        yield prefix + "input_layernorm.weight", (hidden,)
        yield prefix + "post_attention_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (shape.vocab_size, hidden)


def config_json(shape: ModelShape, dtype: str) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": ByteTokenizer.BOS,
        "eos_token_id": ByteTokenizer.EOS,
        "torch_dtype": dtype,
    }


def _byte_chars() -> list[str]:
    """The printable character byte-level tokenizers stand for each byte (GPT-2's map)."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_json(vocab_size: int) -> dict[str, object]:
    """A byte-level BPE without merges: each byte its own token, id = byte value."""
    vocab = {char: byte for byte, char in enumerate(_byte_chars())}
    specials = {ByteTokenizer.BOS: "<s>", ByteTokenizer.EOS: "</s>"}
    specials |= {i: f"<unused_{i}>" for i in range(258, vocab_size)}
    vocab |= {text: i for i, text in specials.items()}
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, text in sorted(specials.items())
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def export_preset(preset: str, seed: int, dtype: str, folder: Path) -> Path:
    """Write `preset` at `seed` into `folder` (skipped when a whole one is there)."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(MODEL_PRESETS)}")
    stamp = {"preset": preset, "seed": seed, "dtype": dtype, "format": FORMAT}
    marker = folder / "pdctl-export.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return folder
    from safetensors.torch import save_file

    shape = MODEL_PRESETS[preset]
    source = preset_source(seed)
    tensors = {
        name: source(name, dims).to(DTYPES[dtype]).contiguous()
        for name, dims in tensor_names(shape)
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        files: dict[str, object] = {
            "config.json": config_json(shape, dtype),
            "generation_config.json": {
                "bos_token_id": ByteTokenizer.BOS,
                "eos_token_id": ByteTokenizer.EOS,
            },
            "tokenizer.json": tokenizer_json(shape.vocab_size),
            "tokenizer_config.json": {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": shape.max_position,
            },
            "pdctl-export.json": stamp,
        }
        for name, content in files.items():
            (partial / name).write_text(json.dumps(content, indent=1), encoding="utf-8")
        os.chmod(partial, 0o755)
        if folder.exists():  # another format, or a folder someone else left: replaced
            shutil.rmtree(folder)
        try:
            partial.rename(folder)
        except OSError:
            if not marker.is_file():  # not a concurrent export that won the rename
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, choices=sorted(MODEL_PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    with torch.inference_mode():
        print(export_preset(args.preset, args.seed, args.dtype, args.folder))


if __name__ == "__main__":
    main()
