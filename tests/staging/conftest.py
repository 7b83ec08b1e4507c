"""Staging tests run the Triton kernels through the interpreter when no GPU is present."""

from __future__ import annotations

import os

import torch


def _has_triton_device() -> bool:
    cuda = getattr(torch, "cuda", None)
    xpu = getattr(torch, "xpu", None)
    return bool((cuda and cuda.is_available()) or (xpu and xpu.is_available()))


if not _has_triton_device():
    # Must be set before triton.jit decorates the kernels (first import of the backend).
    os.environ.setdefault("TRITON_INTERPRET", "1")
