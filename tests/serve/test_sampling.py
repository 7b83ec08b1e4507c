"""Sampling never dies on what the API accepts: any temperature from 5e-324 up, top-k
and top-p at their bounds (a temperature of 1e-300 once turned the scores into
inf - inf = nan and killed the engine's scheduler thread, found by the fuzzer)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.serve.engine.sampling import SamplingParams, choose


@settings(max_examples=200, deadline=None)
@given(
    temperature=st.one_of(
        st.sampled_from([5e-324, 1e-300, 1e-45, 1e-6, 1.0, 100.0]),
        st.floats(min_value=5e-324, max_value=100.0, allow_nan=False),
    ),
    top_k=st.sampled_from([-1, 1, 2, 511, 512, 10_000]),
    top_p=st.sampled_from([1e-9, 0.5, 1.0]),
    scale=st.sampled_from([1e-3, 1.0, 1e4, 1e30]),  # finite logits, as a model gives them
)
def test_any_accepted_temperature_samples_a_token(
    temperature: float, top_k: int, top_p: float, scale: float
) -> None:
    logits = torch.randn(512, generator=torch.Generator().manual_seed(1)) * scale
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
    choice = choose(logits, params, torch.Generator().manual_seed(3), top_n=5)
    assert 0 <= choice.token < 512


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30])
def test_a_vanishing_temperature_samples_the_greedy_token(temperature: float) -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.999])
    params = SamplingParams(temperature=temperature, seed=0)
    assert choose(logits, params, torch.Generator().manual_seed(0), top_n=0).token == 1
