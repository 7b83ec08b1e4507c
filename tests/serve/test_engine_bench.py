"""`python -m pdctl.serve.bench`: step times against a weight-read bound measured in the run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pdctl.serve.bench import read_gbps, weight_bytes
from pdctl.serve.model.weights import build_rank_weights, preset_config, preset_source


def test_the_bound_counts_every_weight_a_step_reads() -> None:
    config = preset_config("tiny")
    weights = build_rank_weights(config, preset_source(0), 1, 0, torch.float32, torch.device("cpu"))
    per_layer = sum(
        t.numel() * 4 for t in vars(weights.layers[0]).values() if isinstance(t, torch.Tensor)
    )
    head = weights.lm_head_t.numel() * 4 + weights.final_norm.numel() * 4
    assert weight_bytes(weights) == config.shape.num_layers * per_layer + head
    assert read_gbps(torch.device("cpu")) > 0.1


def test_each_row_is_set_against_the_bound() -> None:
    argv = [sys.executable, "-m", "pdctl.serve.bench", "--batches", "1,4", "--new-tokens", "6"]
    result = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["weight_bytes"] > 0 and report["read_gbps"] > 0
    bound = report["weight_bytes"] / (report["read_gbps"] * 1e9) * 1e3
    assert report["bound_ms"] == pytest.approx(bound, rel=0.01, abs=0.002)
    assert [row["batch"] for row in report["rows"]] == [1, 4]
    for row in report["rows"]:
        assert row["vs_bound"] == pytest.approx(row["step_ms"] / report["bound_ms"], rel=0.05)
        assert row["vs_bound"] >= 1.0  # no step reads its weights faster than the device can
