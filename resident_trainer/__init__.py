"""resident-trainer: train added shared-expert neurons inside a live LLM server.

The package re-exports the public ops (docs/ has the full reference):

    fingerprint, fingerprint_tensors   64-bit digests of frozen weights
    linear_cross_entropy               exact CE of h @ W.T in vocabulary tiles
    added_expert                       fused added-neuron SwiGLU block, forward + backward

The layers below it are packages of their own (docs/LAYOUT.md):
resident_trainer.train (the training core), .models (adapters), .protocol
(job coordination, torch-free), .integrations (engines and the torch
bridges of the protocol), .testing (the protocol's simulation), .eval.

The ops load on first use of one of these names, so importing a torch-free
subpackage such as resident_trainer.protocol does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "HAS_C": "resident_trainer._ext",
    "HAS_TRITON": "resident_trainer._ext",
    "FINGERPRINT_VERSION": "resident_trainer.ops.fingerprint_version",
    "FingerprintTable": "resident_trainer.ops.fingerprint",
    "combine_partials": "resident_trainer.ops.fingerprint",
    "fingerprint": "resident_trainer.ops.fingerprint",
    "fingerprint_partial": "resident_trainer.ops.fingerprint",
    "fingerprint_sharded": "resident_trainer.ops.fingerprint",
    "fingerprint_tensors": "resident_trainer.ops.fingerprint",
    "linear_cross_entropy": "resident_trainer.ops.linear_cross_entropy",
    "linear_cross_entropy_reference": "resident_trainer.ops.linear_cross_entropy",
    "added_expert": "resident_trainer.ops.added_expert",
    "added_expert_reference": "resident_trainer.ops.added_expert",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'resident_trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
