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
