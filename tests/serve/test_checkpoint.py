"""Local Hugging Face checkpoints: our engine matches transformers' logits and serves them.

Every case of `checkpoints.CASES` (Llama, Llama 3.x scaled RoPE written both ways,
Qwen2, Qwen3, Mistral with a sliding window shorter than the prompt) against
transformers at TP 1 and TP 2; that RoPE scaling and the window matter (the engine
without them is far off); chunked prefill and decode bitwise the whole prompt's; the
fused kernels (interpreted on the CPU) close to transformers; what is not supported
refused with the file and key; and each architecture served through a PD topology.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdctl.core import RopeSettings
from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.model import ops
from pdctl.serve.model.batch import Piece
from pdctl.serve.model.runner import ModelRunner
from pdctl.serve.model.weights import (
    ModelConfig,
    build_rank_weights,
    checkpoint_config,
    checkpoint_source,
)
from tests.serve.checkpoints import (
    CASES,
    WINDOW,
    reference_greedy,
    reference_logits,
    write_checkpoint,
)
from tests.serve.pd_cluster import pd_cluster

torch.set_num_threads(1)  # batch invariance on the CPU: one thread (see ops.py), as servers
CPU = torch.device("cpu")
PROMPT = [(7 * i) % 270 + 1 for i in range(80)]  # past the window and one key block of 64
KIND = {"llama3": "llama", "llama3-scaling": "llama"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("ckpt")
    return {case: write_checkpoint(folder, case) for case in CASES}


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, Path]) -> dict[str, torch.Tensor]:
    return {case: reference_logits(path, case, PROMPT) for case, path in checkpoints.items()}


def engine_logits(
    path: Path,
    config: ModelConfig,
    batches: Sequence[Sequence[tuple[int, int]]] = (((0, len(PROMPT)),),),
    tp: int = 1,
) -> torch.Tensor:
    """Run `batches` of (start, count) pieces of PROMPT; the last batch's last logits.

    TP > 1: one thread per rank, the row-parallel partials gathered between them.
    """
    barrier = threading.Barrier(tp)
    slots: list = [None] * tp
    out: list = [None] * tp

    def gather(rank: int, partials: torch.Tensor) -> torch.Tensor:
        slots[rank] = partials
        barrier.wait()
        joined = torch.cat(slots)
        barrier.wait()
        return joined

    def worker(rank: int) -> None:
        weights = build_rank_weights(config, checkpoint_source(path), tp, rank, torch.float32, CPU)
        shape = config.shape
        kv = KVPool(shape.num_layers, 256, weights.kv_heads, shape.head_dim, 16, torch.float32,
                    CPU)  # fmt: skip
        join = (lambda partials: gather(rank, partials)) if tp > 1 else None
        runner = ModelRunner(weights, kv, CPU, join)
        rows = kv.rows(kv.pages.allocate(len(PROMPT) // 16 + 1) or [], len(PROMPT))
        for batch in batches:
            pieces = [
                Piece(torch.tensor(PROMPT[lo : lo + n]), lo, rows[: lo + n]) for lo, n in batch
            ]
            out[rank] = runner.forward(pieces)

    if tp == 1:
        worker(0)
    else:
        threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(tp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert out[0] is not None
    return out[0][-1]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(checkpoints, expected, case, tp) -> None:
    path = checkpoints[case]
    config = checkpoint_config(path)
    assert config.architecture == KIND.get(case, case)
    assert config.sliding_window == (WINDOW if case == "mistral" else None)
    if case.startswith("llama3"):  # theta read from inside rope_parameters, or beside rope_scaling
        assert config.rope.kind == "llama3" and config.rope.theta == 500000.0
    logits = engine_logits(path, config, tp=tp)
    torch.testing.assert_close(logits, expected[case], atol=1e-4, rtol=1e-4)


def test_the_scaling_and_the_window_matter(checkpoints, expected) -> None:
    """Read as unscaled or unwindowed, these checkpoints would give other logits."""
    llama3 = checkpoint_config(checkpoints["llama3"])
    unscaled = dataclasses.replace(llama3, rope=RopeSettings(llama3.rope.theta))
    off = engine_logits(checkpoints["llama3"], unscaled) - expected["llama3"]
    assert off.abs().max() > 0.1
    mistral = checkpoint_config(checkpoints["mistral"])
    unwindowed = dataclasses.replace(mistral, sliding_window=None)
    off = engine_logits(checkpoints["mistral"], unwindowed) - expected["mistral"]
    assert off.abs().max() > 0.1
    assert torch.equal(expected["llama3"], expected["llama3-scaling"])  # one model, two forms


@pytest.mark.parametrize("case", ["qwen3", "mistral"])
def test_chunks_and_decode_give_the_whole_prompts_logits_bitwise(checkpoints, case) -> None:
    path = checkpoints[case]
    config = checkpoint_config(path)
    whole = engine_logits(path, config)
    assert torch.equal(engine_logits(path, config, [[(0, 30)], [(30, 50)]]), whole)
    assert torch.equal(engine_logits(path, config, [[(0, 79)], [(79, 1)]]), whole)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels run interpreted on CPU hosts")
@pytest.mark.parametrize("case", ["llama3", "qwen3", "mistral"])
def test_the_fused_kernels_match_transformers(checkpoints, case, monkeypatch) -> None:
    """RMSNorm (and Qwen3's head norms), RoPE + KV write, attention with the window: the
    Triton kernels under TRITON_INTERPRET, close to transformers (40 tokens, past the
    window: the interpreter is slow; test_fused_kernels.py and test_paged_attention.py
    prove the kernels' invariance)."""
    monkeypatch.setattr(ops, "triton_available", lambda device_type: True)
    monkeypatch.setattr(ops, "invariant_kernels", lambda device_type: False)  # torch products
    path = checkpoints[case]
    logits = engine_logits(path, checkpoint_config(path), [[(0, 40)]])
    want = reference_logits(path, case, PROMPT[:40])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def edited(checkpoints: dict[str, Path], tmp_path: Path, case: str, **changes: object) -> Path:
    """A copy of a checkpoint's config.json with `changes` (None removes a key)."""
    config = json.loads((checkpoints[case] / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    ("case", "changes", "words"),
    [
        ("llama", {"architectures": ["GemmaForCausalLM"]}, "architectures ['GemmaForCausalLM']"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
         "rope_parameters.rope_type 'yarn' is not supported (supported: default, llama3)"),
        ("llama3-scaling", {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
         "rope_scaling.rope_type 'dynamic'"),
        ("llama3", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
         "lacks low_freq_factor, high_freq_factor, original_max_position_embeddings"),
        ("llama3", {"rope_scaling": {"rope_type": "default"}}, "disagree"),
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("mistral", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)  # fmt: skip
def test_what_the_engine_cannot_compute_is_refused(checkpoints, tmp_path, case, changes, words):
    path = edited(checkpoints, tmp_path, case, **changes)
    with pytest.raises(ValueError) as refused:
        checkpoint_config(path)
    message = str(refused.value)
    assert message.startswith(f"{path / 'config.json'}: ") and words in message, message
    if "architectures" in changes:
        assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM" in message


def test_server_serves_a_checkpoint_with_its_tokenizer(checkpoints, server_factory) -> None:
    server = server_factory("--model-path", str(checkpoints["llama"]), "--kv-pool-tokens", "1024")
    info = httpx.get(f"{server.url}/get_model_info", timeout=10).json()
    assert info["model_path"] == str(checkpoints["llama"]) and info["vocab_size"] == 272
    result = server.generate(
        text="hello", sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    )
    assert result["meta_info"]["prompt_tokens"] == 5 and len(result["output_ids"]) == 4


# each architecture through prefill -> decode, one side at TP 1 and the other at TP 2
PD_CASES = [
    pytest.param("llama3", 1, 2, id="llama3-p1d2"),
    pytest.param("qwen2", 2, 1, id="qwen2-p2d1"),
    pytest.param("qwen3", 1, 2, id="qwen3-p1d2"),
    pytest.param("mistral", 2, 1, id="mistral-p2d1"),
]


@pytest.mark.parametrize(("case", "prefill_tp", "decode_tp"), PD_CASES)
def test_pd_serves_each_architecture_as_transformers_decodes(
    checkpoints, case, prefill_tp, decode_tp
) -> None:
    """Greedy tokens through the router equal transformers' greedy continuation."""
    model = ("--model-path", str(checkpoints[case]), "--page-size", "16", "--kv-pool-tokens",
             "1024")  # fmt: skip
    prompts = [PROMPT[:40], PROMPT]  # both past Mistral's window
    count = 6
    want = [reference_greedy(checkpoints[case], prompt, count) for prompt in prompts]
    with pd_cluster(model=model, prefill_tp=prefill_tp, decode_tp=decode_tp) as cluster:
        for prompt, tokens in zip(prompts, want, strict=True):
            result = cluster.generate(
                input_ids=prompt,
                sampling_params={"temperature": 0, "max_new_tokens": count, "ignore_eos": True},
            )
            assert result["output_ids"] == tokens, case
            assert result["meta_info"]["kv_transfer"]["digest_ok"] is True
        cluster.pools_full()


@pytest.mark.parametrize("broken", ["missing", "no-tokenizer", "bad-safetensors"])
def test_a_checkpoint_that_cannot_load_ends_the_server_on_one_line(
    checkpoints, tmp_path, broken
) -> None:
    """The log tail the launcher shows: what is wrong and where, not a traceback."""
    import shutil

    from tests.serve.conftest import start_server

    path = tmp_path / "ckpt"
    if broken != "missing":
        shutil.copytree(checkpoints["qwen3"], path)
    if broken == "no-tokenizer":
        (path / "tokenizer.json").unlink()
    if broken == "bad-safetensors":
        (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError) as died:
        start_server("--model-path", str(path))
    tail = str(died.value)
    said = {
        "missing": f"cannot read {path}/config.json: No such file or directory",
        "no-tokenizer": f"{path}: no tokenizer.json",
        "bad-safetensors": f"{path}/model.safetensors: not a readable safetensors file",
    }[broken]
    assert f"pdctl serve colocated tp0: {said}" in tail and "Traceback" not in tail, tail
