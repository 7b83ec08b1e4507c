"""Tiny random Hugging Face checkpoints (Llama, Qwen2) written with transformers."""

from __future__ import annotations

from pathlib import Path

import torch


def write_checkpoint(folder: Path, architecture: str, seed: int = 0) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=272,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    if architecture == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # make the q/k/v biases visible in the comparison
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    model = model.float().eval()
    path = folder / architecture
    model.save_pretrained(path, safe_serialization=True)
    vocab = {chr(c): c - 32 for c in range(32, 127)}
    vocab["[UNK]"] = 100
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def reference_logits(path: Path, architecture: str, ids: list[int]) -> torch.Tensor:
    import transformers

    cls = (
        transformers.LlamaForCausalLM if architecture == "llama" else transformers.Qwen2ForCausalLM
    )
    model = cls.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]
