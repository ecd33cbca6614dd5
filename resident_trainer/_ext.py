"""The optional compiled extension, resident_trainer._C.

Importing the package never requires it; a path that needs it calls
`require_extension`, which says how to build it.
"""

from __future__ import annotations

import torch

try:
    from resident_trainer import _C  # noqa: F401  (registers torch.ops.resident_trainer.*)

    HAS_C = True
    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:
    HAS_C = False
    _IMPORT_ERROR = exc

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

BUILD_HINT = (
    "build it from the source tree with `pip install --no-build-isolation -e .` "
    "(torch must already be installed; `make test` does all of it)"
)


def require_extension(what: str) -> None:
    """Raise a RuntimeError naming `what` when the compiled extension is missing."""
    if not HAS_C:
        raise RuntimeError(
            f"{what} needs the compiled extension resident_trainer._C, which is not available "
            f"({_IMPORT_ERROR}); {BUILD_HINT}, or pass impl='reference' for the slow oracle"
        )


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether the extension registered torch.ops.resident_trainer.<op> for dispatch_key."""
    return HAS_C and torch._C._dispatch_has_kernel_for_dispatch_key(f"resident_trainer::{op}", dispatch_key)


def require_triton(what: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{what} needs Triton, which is not installed: pip install triton")


def resolve_impl(op: str, impl: str, impls: tuple[str, ...], device: torch.device, gpu_auto: str) -> str:
    """The implementation an op runs for `impl` on `device`: "auto" picks "cpu"
    on CPUs and `gpu_auto` on CUDA; explicit choices are checked against the
    device (Triton runs on CPU tensors only under TRITON_INTERPRET=1)."""
    import os

    if impl not in impls:
        raise ValueError(f"impl must be one of {impls}, got {impl!r}")
    if impl == "auto":
        if device.type == "cpu":
            return "cpu"
        if device.type == "cuda":
            return gpu_auto
        raise ValueError(f"no {op} kernel for device type {device.type!r}; pass impl='reference'")
    if impl == "cpu" and device.type != "cpu":
        raise ValueError(f"impl='cpu' needs CPU tensors, got tensors on {device}")
    if impl == "cuda" and device.type != "cuda":
        raise ValueError(f"impl='cuda' needs CUDA tensors, got tensors on {device}")
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got tensors on {device}")
    return impl
