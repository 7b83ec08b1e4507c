"""What the page-digest kernels read beside the pages, cached per list of KV views
(`base.BufferCache`): the table of the views' addresses, and whether every view starts
at 16 bytes (the alignment Triton compiles pointers for). Shared by the checked page
digests (`kernels.start_page_digests`) and the mapped write (`kernels.page_write`)."""

from __future__ import annotations

import torch

from pdctl.staging.descriptors import pointer_table
from pdctl.staging.kernels.base import BufferCache

DIGEST_TABLES: BufferCache[torch.Tensor] = BufferCache(
    lambda views: pointer_table(views, views[0].device)
)
ALIGNED: BufferCache[bool] = BufferCache(  # every buffer starts at 16 bytes
    lambda views: all(view.data_ptr() % 16 == 0 for view in views)
)
