"""Random KV pools (raw random bits, NaN patterns included) for bitwise tests."""

from __future__ import annotations

import torch

INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_kv(
    num_layers: int,
    pool_tokens: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    device: str | torch.device = "cpu",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        tensor = torch.empty(pool_tokens, heads, head_dim, dtype=dtype)  # [pool, heads, dim]
        bits = tensor.view(INT_OF[tensor.element_size()])
        bits.copy_(torch.randint(-(2**15), 2**15, bits.shape, generator=generator).to(bits.dtype))
        return tensor.to(device)

    return [one() for _ in range(num_layers)], [one() for _ in range(num_layers)]


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(INT_OF[tensor.element_size()])


def random_pages(num_pages_in_pool: int, count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_pages_in_pool, generator=generator)[:count]


def naive_gather(k, v, pages, page_size, start, count) -> torch.Tensor:
    """The plain reference: a loop over layers, K/V and tokens."""
    rows = torch.tensor([int(p) * page_size + i for p in pages for i in range(page_size)])
    blocks = []
    for layer in range(len(k)):
        for buffer in (k[layer], v[layer]):
            bits = as_bits(buffer).cpu()
            blocks.append(torch.stack([bits[r, start : start + count] for r in rows]))
    return torch.stack(blocks).to(k[0].device)  # [2L, tokens, count, dim] in bits
