"""What the page-digest kernels read beside the pages: where a launch's words lie
(`PageRows`), and per list of KV views, cached (`base.BufferCache`), the table of the
views' addresses and whether every view starts at 16 bytes (the alignment Triton
compiles pointers for). Shared by the checked page digests
(`kernels.start_slice_digests`) and the mapped write (`kernels.page_write`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdctl.staging.descriptors import pointer_table
from pdctl.staging.kernels.base import BufferCache

DIGEST_TABLES: BufferCache[torch.Tensor] = BufferCache(
    lambda views: pointer_table(views, views[0].device)
)
ALIGNED: BufferCache[bool] = BufferCache(  # every buffer starts at 16 bytes
    lambda views: all(view.data_ptr() % 16 == 0 for view in views)
)


@dataclass(frozen=True)
class PageRows:
    """Where the words of a page launch lie: per buffer (staging order) its base
    address in a [N] int64 table on the device, every token row `row_words` int32
    words, the slice's first word `col_start`; `pages` the host page ids."""

    table: torch.Tensor
    pages: np.ndarray | torch.Tensor  # host ids, or ids already on the device
    row_words: int
    col_start: int
    aligned: bool = False  # every base address in the table is 16-byte aligned

    @property
    def num_buffers(self) -> int:
        return len(self.table)

    def vec(self) -> int:
        """4 where every row and the slice start at 16 bytes, else 1."""
        return 4 if self.aligned and self.row_words % 4 == 0 and self.col_start % 4 == 0 else 1


def page_rows(
    views: list[torch.Tensor], pages: np.ndarray | torch.Tensor, col_start: int
) -> PageRows:
    """The rows of `pages` in these [pool_tokens, row_words] int32 views, from word
    `col_start` on (the views' table and alignment from the caches)."""
    return PageRows(
        DIGEST_TABLES.get(views), pages, views[0].shape[1], col_start, ALIGNED.get(views)
    )
