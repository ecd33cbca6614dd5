"""What autograd keeps for a backward, in bytes: the activation memory of a
step (tests, benchmarks, and the replay's own report)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch


class SavedBytes:
    """Within the `with`, counts the bytes of every tensor autograd saves for
    backward, each storage once, skipping the storages of `exclude` (inputs
    or weights that exist anyway). `total` holds the count."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._own = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, int] = {}

    @property
    def total(self) -> int:
        return sum(self._seen.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._own:
            self._seen[ptr] = storage.nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_bytes(fn: Callable[..., object], inputs: Sequence[torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves while running ``fn(*inputs)`` that
    are not the inputs themselves, each storage counted once."""
    with SavedBytes(exclude=inputs) as meter:
        fn(*inputs)
    return meter.total
