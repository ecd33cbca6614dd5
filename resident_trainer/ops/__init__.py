"""Public functional ops: input checks, device dispatch, autograd, oracles."""

from resident_trainer.ops.fingerprint import (
    FingerprintPartial,
    FingerprintTable,
    combine_partials,
    fingerprint,
    fingerprint_partial,
    fingerprint_sharded,
    fingerprint_tensors,
)

__all__ = [
    "FingerprintPartial",
    "FingerprintTable",
    "combine_partials",
    "fingerprint",
    "fingerprint_partial",
    "fingerprint_sharded",
    "fingerprint_tensors",
]
