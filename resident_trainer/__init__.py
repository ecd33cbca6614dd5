"""resident-trainer: train added shared-expert neurons inside a live LLM server.

Public ops (see docs/ for the full reference):
    fingerprint, fingerprint_tensors   64-bit digests of frozen weights
    linear_cross_entropy               exact CE of h @ W.T in vocabulary tiles
    added_expert, AddedExpert          fused added-neuron SwiGLU block, forward + backward
    protocol                           jobs inside a live tensor-parallel server (docs/ARCHITECTURE.md)
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
from resident_trainer.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from resident_trainer.ops.added_expert import AddedExpert, added_expert, added_expert_reference
from resident_trainer import protocol
from resident_trainer.protocol import JobSpec, ProtocolConfig

__version__ = "0.1.0"

__all__ = [
    "JobSpec",
    "ProtocolConfig",
    "protocol",
    "HAS_C",
    "HAS_TRITON",
    "FingerprintTable",
    "combine_partials",
    "fingerprint",
    "fingerprint_partial",
    "fingerprint_sharded",
    "fingerprint_tensors",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "AddedExpert",
    "added_expert",
    "added_expert_reference",
]
