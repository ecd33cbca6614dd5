"""Matrix products on the CPU: oneDNN's inner product where it beats torch.mm.

torch.mm on the CPU goes to MKL's sgemm, which on AMD processors runs its
AVX2 code; oneDNN dispatches on the instruction set and runs AVX-512. Measured
on a 2-core AMD EPYC (Zen 5, fp32, one run, side by side): (2048 x 576)
@ (576 x 49152) takes 705 ms with torch.mm and 347 ms with oneDNN (165 against
335 GFLOP/s). oneDNN is reached through ``torch.ops.mkldnn._linear_pointwise``,
the op torch's own CPU compiler emits for linear layers; builds without it, other
devices and other dtypes use torch.mm.

oneDNN's bf16 inner product needs AVX-512 (or AMX): on an AVX2-only EPYC (Zen 3)
it refuses to create the primitive ("could not create a primitive descriptor").
Whether a dtype works is probed once per process on a tiny product, and a dtype
that fails goes to torch.mm.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN's inner product runs for `dtype` on this CPU (probed once)."""
    if not ONEDNN or dtype not in _ONEDNN_DTYPES:
        return False
    a = torch.ones(2, 8, dtype=dtype)
    b = torch.ones(3, 8, dtype=dtype)
    try:
        out = torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    except RuntimeError:
        return False
    return bool((out == 8).all())


def _operand(t: Tensor) -> Tensor:
    # Row- or column-major operands go in as they are; anything else is copied.
    return t if t.is_contiguous() or t.t().is_contiguous() else t.contiguous()


def linear(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b.T`` for a: (M, K), b: (L, K), accumulated in fp32, output (M, L)
    contiguous in a's dtype. A transposed `a` is copied by oneDNN first, so
    callers keep the transposed operand small (a tile, not a whole matrix)."""
    a, b = _operand(a), _operand(b)
    if a.device.type == "cpu" and b.dtype == a.dtype and a.numel() and b.numel() and onednn_supports(a.dtype):
        return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    return torch.mm(a, b.t())
