"""The bottom of the package: the optional compiled extension
(resident_trainer._C), whether Triton is installed, and the checks every op
shares (implementation choice, tensor arguments).

Importing the package never requires the extension; a path that needs it
calls `require_extension`, which says how to build it.
"""

from __future__ import annotations

import os

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


# Three CPU choices are made by timing, once per process and shape class:
# the products' backend (ops/_gemm.py), the cross-entropy's vocabulary tiles
# and the added expert's path (compiled kernel or torch composition). They
# round differently, and a close timing can go either way from one process to
# the next: the same job trained twice gave blocks that differ in their
# bits (docs/RESULTS.md, "Reproducible runs"). With
# RESIDENT_TRAINER_REPRODUCIBLE=1 each takes a fixed choice instead and
# measures nothing: torch.mm, the default tiles, the compiled kernel (where it
# is built). A variable that forces one choice by name still wins.
REPRODUCIBLE_ENV = "RESIDENT_TRAINER_REPRODUCIBLE"


def reproducible() -> bool:
    """Whether RESIDENT_TRAINER_REPRODUCIBLE asks for fixed choices instead of
    measured ones (read on every call; "1" yes, "0" or unset no)."""
    raw = os.environ.get(REPRODUCIBLE_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{REPRODUCIBLE_ENV} must be 0 or 1 (unset: 0), got {raw!r}")
    return raw == "1"


def reproducible_note(choice: str) -> str:
    """For the benchmarks' reports of what was measured: ": ...=1 takes
    `choice`" when RESIDENT_TRAINER_REPRODUCIBLE took it, else ""."""
    return f": {REPRODUCIBLE_ENV}=1 takes {choice}" if reproducible() else ""


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


def triton_interpreted() -> bool:
    """Whether Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1),
    which is the only way they take CPU tensors. Triton reads the variable
    when it is first imported: set it before that."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_impl(
    op: str, impl: str, impls: tuple[str, ...], device: torch.device, *, gpu_auto: str, cpu_auto: str = "cpu"
) -> str:
    """The implementation `op` runs for `impl` on `device`: "auto" picks
    `cpu_auto` on CPUs and `gpu_auto` on CUDA; an explicit choice is checked
    against the device (Triton takes CPU tensors only in its interpreter)."""
    if impl not in impls:
        raise ValueError(f"impl must be one of {impls}, got {impl!r}")
    if impl == "auto":
        if device.type == "cpu":
            impl = cpu_auto
        elif device.type == "cuda":
            impl = gpu_auto
        else:
            raise ValueError(f"no {op} kernel for device type {device.type!r}; pass impl='reference'")
    elif impl == "cpu" and device.type != "cpu":
        raise ValueError(f"impl='cpu' needs CPU tensors, got tensors on {device}")
    elif impl == "cuda" and device.type != "cuda":
        raise ValueError(f"impl='cuda' needs CUDA tensors, got tensors on {device}")
    elif impl == "triton" and device.type != "cuda" and not triton_interpreted():
        raise ValueError(
            f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got tensors on {device}"
        )
    if impl == "triton":
        require_triton(f"{op} (impl='triton')")
    return impl


def check_tensor(t: object, name: str) -> torch.Tensor:
    """`t` itself, after checking that it is a dense torch.Tensor (the error names `name`)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    return t
