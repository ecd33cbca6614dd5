"""resident-trainer: train added shared-expert neurons inside a live LLM server.

Public ops (see docs/ for the full reference):
    fingerprint, fingerprint_tensors   64-bit digests of frozen weights
"""

from resident_trainer._ext import HAS_C, HAS_TRITON
from resident_trainer.ops.fingerprint import (
    FingerprintTable,
    fingerprint,
    fingerprint_partial,
    fingerprint_sharded,
    fingerprint_tensors,
    combine_partials,
)

__version__ = "0.1.0"

__all__ = [
    "HAS_C",
    "HAS_TRITON",
    "FingerprintTable",
    "combine_partials",
    "fingerprint",
    "fingerprint_partial",
    "fingerprint_sharded",
    "fingerprint_tensors",
]
