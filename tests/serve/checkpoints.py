"""Tiny random Hugging Face checkpoints written with transformers, one per case.

llama             Llama, default RoPE
llama3            Llama 3.x RoPE scaling, written as transformers 5 does (`rope_parameters`,
                  rope_theta inside it)
llama3-scaling    the same model, config.json in the earlier form (`rope_scaling`, a
                  top-level rope_theta)
qwen2             q/k/v biases (drawn large, so they count)
qwen3             q/k head norms, head_dim 16 (not hidden / heads)
mistral           sliding window of WINDOW keys, shorter than the tests' prompts
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CASES = ("llama", "llama3", "llama3-scaling", "qwen2", "qwen3", "mistral")
WINDOW = 24  # Mistral's sliding window: the tests' prompts are longer
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small: the scaling matters at short prompts
}
LLAMA3_THETA = 500000.0


def _model(case: str):  # type: ignore[no-untyped-def]
    import transformers

    common = dict(
        vocab_size=272,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.2,  # sharp attention: RoPE, norms and windows count
    )
    if case.startswith("llama3"):
        rope = {**LLAMA3_ROPE, "rope_theta": LLAMA3_THETA}
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, rope_parameters=rope)
        )
    if case == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if case == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16)
        model = transformers.Qwen3ForCausalLM(config)
        with torch.no_grad():  # norms away from 1, so they count
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.5)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.5)
        return model
    if case == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=WINDOW)
        return transformers.MistralForCausalLM(config)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():  # make the q/k/v biases visible in the comparison
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def write_checkpoint(folder: Path, architecture: str, seed: int = 0) -> Path:
    """Checkpoint `architecture` (a case of CASES) in folder/architecture, with a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    model = _model(architecture).float().eval()
    path = folder / architecture
    model.save_pretrained(path, safe_serialization=True)
    if architecture == "llama3-scaling":  # the form transformers 4 wrote
        config = json.loads((path / "config.json").read_text())
        config.pop("rope_parameters")
        config["rope_scaling"], config["rope_theta"] = dict(LLAMA3_ROPE), LLAMA3_THETA
        (path / "config.json").write_text(json.dumps(config, indent=2))
    vocab = {chr(c): c - 32 for c in range(32, 127)}
    vocab["[UNK]"] = 100
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def reference_model(path: Path):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_logits(path: Path, architecture: str, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits of the last of `ids` [vocab]."""
    with torch.no_grad():
        return reference_model(path)(torch.tensor([ids])).logits[0, -1]


def reference_greedy(path: Path, ids: list[int], count: int) -> list[int]:
    """transformers' greedy continuation of `ids`: `count` token ids."""
    model, out = reference_model(path), list(ids)
    with torch.no_grad():
        for _ in range(count):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]
