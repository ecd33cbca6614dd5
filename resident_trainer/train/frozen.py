"""The proof that the frozen base did not change: digests of the frozen
tensors (and, separately, of a watch layer) from
``resident_trainer.fingerprint_tensors``, taken before and after a job.

The trainer checks it at the end of every job, the protocol's job bodies
report it at the job's first and verify boundaries, and the command line
prints it; all three use this class.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from resident_trainer.ops.fingerprint import FINGERPRINT_VERSION, FingerprintTable, fingerprint_tensors

Tensors = Mapping[str, torch.Tensor] | torch.nn.Module


class FrozenWeightsChanged(RuntimeError):
    """A tensor that must never change did."""


class FrozenFingerprint:
    """Callable returning ``{"frozen": hex, "watch": hex, "version": "3"}``.

    frozen: every tensor that must never change (a module, or a name ->
    tensor mapping); watch: one layer's tensors, fingerprinted on their own so
    a receipt shows at a glance whether that layer moved. `last` keeps the
    most recent tables, so a mismatch can be traced to tensor names
    (`changed`). "version" is the fingerprint definition's version
    (FINGERPRINT_VERSION), so a receipt says which definition its digests
    are of."""

    def __init__(self, frozen: Tensors, watch: Tensors | None = None, *, impl: str = "auto") -> None:
        if not isinstance(frozen, (Mapping, torch.nn.Module)):
            raise TypeError(f"frozen must be an nn.Module or a Mapping[str, Tensor], got {type(frozen).__name__}")
        if watch is not None and not isinstance(watch, (Mapping, torch.nn.Module)):
            raise TypeError(f"watch must be an nn.Module, a Mapping[str, Tensor] or None, got {type(watch).__name__}")
        self.frozen = frozen
        self.watch = watch
        self.impl = impl
        self.last: dict[str, FingerprintTable] = {}

    def tables(self) -> dict[str, FingerprintTable]:
        out = {"frozen": fingerprint_tensors(self.frozen, impl=self.impl)}
        if self.watch is not None:
            out["watch"] = fingerprint_tensors(self.watch, impl=self.impl)
        self.last = out
        return out

    def __call__(self) -> dict[str, str]:
        return {**{k: t.hex for k, t in self.tables().items()}, "version": str(FINGERPRINT_VERSION)}

    def check(self, before: Mapping[str, FingerprintTable]) -> dict[str, FingerprintTable]:
        """Fingerprint now and raise FrozenWeightsChanged, naming the tensors,
        unless every digest equals `before`'s; returns the new tables."""
        after = self.tables()
        changed = self.changed(before, after)
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise FrozenWeightsChanged(f"the frozen base changed: {shown}")
        return after

    @staticmethod
    def changed(before: Mapping[str, FingerprintTable], after: Mapping[str, FingerprintTable]) -> list[str]:
        """Tensor names whose digest differs between two `tables()` results."""
        out = []
        for part in sorted(set(before) | set(after)):
            if part in before and part in after:
                out += [f"{part}:{n}" for n in before[part].changed(after[part])]
            else:
                out.append(part)
        return out
