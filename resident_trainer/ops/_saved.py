"""What autograd keeps for a backward, in bytes (benchmarks and tests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def saved_bytes(fn: Callable[..., object], inputs: Sequence[torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves while running ``fn(*inputs)`` that
    are not the inputs themselves, each storage counted once."""
    own = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(seen.values())
