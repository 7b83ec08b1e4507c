"""Local Hugging Face checkpoints: our engine matches transformers' logits and serves them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.model.batch import Piece
from pdctl.serve.model.runner import ModelRunner
from pdctl.serve.model.weights import build_rank_weights, checkpoint_config, checkpoint_source
from tests.serve.checkpoints import reference_logits, write_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("ckpt")
    return {arch: write_checkpoint(folder, arch) for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_transformers(checkpoints, architecture, tp) -> None:
    path = checkpoints[architecture]
    config = checkpoint_config(path)
    assert config.architecture == architecture
    ids = [5, 17, 200, 3, 99, 150, 42, 7, 8, 9, 10, 250]
    expected = reference_logits(path, architecture, ids)
    if tp == 1:
        weights = build_rank_weights(
            config, checkpoint_source(path), 1, 0, torch.float32, torch.device("cpu")
        )
        kv = KVPool(
            2, 256, weights.kv_heads, config.shape.head_dim, 16, torch.float32, torch.device("cpu")
        )
        runner = ModelRunner(weights, kv, torch.device("cpu"))
        logits = runner.forward(
            [Piece(torch.tensor(ids), 0, kv.rows(kv.pages.allocate(1) or [], len(ids)))]
        )
        assert logits is not None
        torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
    else:
        import threading

        from tests.serve.test_determinism import CONFIG  # noqa: F401 (same process setup)

        barrier = threading.Barrier(tp)
        slots: list = [None] * tp
        out: list = [None] * tp

        def worker(rank: int) -> None:
            def gather(partials: torch.Tensor) -> torch.Tensor:
                slots[rank] = partials
                barrier.wait()
                joined = torch.cat(slots)
                barrier.wait()
                return joined

            weights = build_rank_weights(
                config, checkpoint_source(path), tp, rank, torch.float32, torch.device("cpu")
            )
            kv = KVPool(
                2,
                256,
                weights.kv_heads,
                config.shape.head_dim,
                16,
                torch.float32,
                torch.device("cpu"),
            )
            runner = ModelRunner(weights, kv, torch.device("cpu"), gather)
            out[rank] = runner.forward(
                [Piece(torch.tensor(ids), 0, kv.rows(kv.pages.allocate(1) or [], len(ids)))]
            )

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(tp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        torch.testing.assert_close(out[0][0], expected, atol=1e-4, rtol=1e-4)


def test_server_serves_a_checkpoint_with_its_tokenizer(checkpoints, server_factory) -> None:
    server = server_factory("--model-path", str(checkpoints["llama"]), "--kv-pool-tokens", "1024")
    info = httpx.get(f"{server.url}/get_model_info", timeout=10).json()
    assert info["model_path"] == str(checkpoints["llama"]) and info["vocab_size"] == 272
    result = server.generate(
        text="hello", sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    )
    assert result["meta_info"]["prompt_tokens"] == 5 and len(result["output_ids"]) == 4
