"""The block's checkpoint: this rank's shard of the added neurons (trainable
and published copies, gate thresholds and arming, what it was taught) and its optimizer state, as
safetensors with the base model's fingerprint (and the version of the
fingerprint definition that computed it) in the metadata."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from resident_trainer._files import write_atomic
from resident_trainer.ops.fingerprint_version import FINGERPRINT_VERSION

if TYPE_CHECKING:
    from resident_trainer.train.trainer import Trainer

CHECKPOINT_FORMAT = "resident-trainer-block/1"


def _checkpoint_tensors(trainer: Trainer) -> tuple[dict[str, Tensor], dict[str, str]]:
    block = trainer.block
    tensors = {
        "w_gate_up": block.w_gate_up.detach().contiguous(),
        "w_down": block.w_down.detach().contiguous(),
        "published_gate_up": block.published_gate_up.contiguous(),
        "published_down": block.published_down.contiguous(),
    }
    for name, arming in (("arming", block.arming), ("published_arming", block.published_arming)):
        if arming is not None:
            tensors[f"{name}_rows"] = arming[0].detach().float().contiguous()
            tensors[f"{name}_threshold"] = arming[1].detach().float().contiguous()
    state = trainer.optimizer.state_dict()["state"]
    for i, st in state.items():
        for k, v in st.items():
            tensors[f"optim.{i}.{k}"] = v.detach().reshape(-1).contiguous() if v.dim() == 0 else v.detach().contiguous()
    meta = {
        "format": CHECKPOINT_FORMAT,
        "config": json.dumps(asdict(trainer.config)),
        "base_fingerprint": trainer.base_fingerprint.hex,
        "fingerprint_version": str(FINGERPRINT_VERSION),
        "step": str(trainer.step_index),
        "threshold": _threshold_meta(block.threshold, "threshold", tensors),
        "published_threshold": _threshold_meta(block.published_threshold, "published_threshold", tensors),
        "neurons": json.dumps([block.neuron_start, block.neuron_stop, block.num_neurons]),
        "memory": json.dumps(block.memory),
        "published_memory": json.dumps(block.published_memory),
    }
    return tensors, meta


# Per-neuron thresholds are stored as tensors under their own name; the
# metadata then says so. A float (one threshold for every neuron, as earlier
# checkpoints hold) or None stays a JSON number or null.
_PER_NEURON = json.dumps("per_neuron")


def _threshold_meta(t, name: str, tensors: dict[str, Tensor]) -> str:
    if isinstance(t, Tensor):
        tensors[name] = t.detach().float().contiguous()
        return _PER_NEURON
    return json.dumps(t)


def _threshold_of(meta: dict[str, str], name: str, tensors: dict[str, Tensor], device) -> Tensor | float | None:
    if meta[name] == _PER_NEURON:
        return tensors[name].to(device)
    return json.loads(meta[name])


def _arming_of(name: str, tensors: dict[str, Tensor], block) -> tuple[Tensor, Tensor] | None:
    if f"{name}_rows" not in tensors:
        return None
    rows, thr = tensors[f"{name}_rows"], tensors[f"{name}_threshold"]
    if rows.shape != (block.local_neurons, block.hidden_size) or thr.shape != (block.local_neurons,):
        raise ValueError(
            f"the checkpoint's {name} rows are {tuple(rows.shape)}, this rank's block needs "
            f"{(block.local_neurons, block.hidden_size)}"
        )
    dev = block.w_down.device
    return rows.float().to(dev), thr.float().to(dev)


def checkpoint_bytes(trainer: Trainer) -> bytes:
    """This rank's shard of the block and its optimizer state, as safetensors bytes."""
    from safetensors.torch import save

    tensors, meta = _checkpoint_tensors(trainer)
    return save({k: v.cpu() for k, v in tensors.items()}, metadata=meta)


def save_checkpoint(trainer: Trainer, path: str | os.PathLike) -> None:
    """Write the checkpoint atomically: a temporary file in the same folder,
    flushed to disk, then renamed over `path` (a crash leaves the old one)."""
    write_atomic(os.path.abspath(os.fspath(path)), checkpoint_bytes(trainer))


def read_checkpoint(data: bytes) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors, metadata) of checkpoint bytes; refuses anything that is not
    a block checkpoint."""
    from safetensors.torch import load

    if len(data) < 8:
        raise ValueError("not a safetensors checkpoint: fewer than 8 bytes")
    n = int.from_bytes(data[:8], "little")
    try:
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except ValueError as exc:
        raise ValueError(f"not a safetensors checkpoint: unreadable header ({exc})") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"not a {CHECKPOINT_FORMAT} checkpoint (format={meta.get('format')!r})")
    return load(bytes(data)), meta


def check_fingerprint_version(meta: dict[str, str], path: str) -> None:
    """Refuse a checkpoint whose base fingerprint was computed by another
    version of the fingerprint definition: it cannot be compared with this
    build's digest of the base, so the base check cannot be made."""
    have = meta.get("fingerprint_version")
    if have != str(FINGERPRINT_VERSION):
        stated = f"version {have}" if have is not None else "version 1 (the checkpoint records no version)"
        raise ValueError(
            f"{path}: its base fingerprint {meta.get('base_fingerprint')} is of fingerprint definition {stated}, "
            f"this build computes version {FINGERPRINT_VERSION}, so the base model it was trained on cannot be "
            "checked. The block weights in it may be fine, but loaded unchecked they could land on another base: "
            f"re-train the job with this build (its checkpoints record version {FINGERPRINT_VERSION}), or load "
            "the checkpoint with the resident-trainer release that wrote it"
        )


def load_block(block, data: bytes, *, publish: bool = False) -> dict[str, str]:
    """Put a checkpoint's block weights (trainable and published copies,
    thresholds, arming) into `block`, which must hold the same shard of the same
    number of neurons; returns the checkpoint's metadata. publish=True: the
    trainable weights (what a job's commit checkpoint holds: the block as it
    publishes it) become the published ones too, as after that publish."""
    tensors, meta = read_checkpoint(data)
    want = [block.neuron_start, block.neuron_stop, block.num_neurons]
    if json.loads(meta["neurons"]) != want:
        raise ValueError(f"the checkpoint holds neurons {json.loads(meta['neurons'])}, this rank has {want}")
    with torch.no_grad():
        block.w_gate_up.copy_(tensors["w_gate_up"])
        block.w_down.copy_(tensors["w_down"])
        block.published_gate_up.copy_(tensors["published_gate_up"])
        block.published_down.copy_(tensors["published_down"])
    block.threshold = _threshold_of(meta, "threshold", tensors, block.w_down.device)
    block.published_threshold = _threshold_of(meta, "published_threshold", tensors, block.w_down.device)
    # Checkpoints written before arming hold none: served without it, as then.
    block.arming, block.published_arming = (_arming_of(name, tensors, block) for name in ("arming", "published_arming"))
    # Checkpoints written before the block kept its memory: nothing taught on
    # record, and no neuron known to be free (the same answer on every rank).
    empty = json.dumps({"taught": [], "used": block.num_neurons})
    block.memory = json.loads(meta.get("memory", empty))
    block.published_memory = json.loads(meta.get("published_memory", empty))
    if publish:
        block.publish()
    return meta


def load_checkpoint(trainer: Trainer, path: str | os.PathLike) -> None:
    """Restore the block, its optimizer state and the step counter. Refuses a
    checkpoint made on another base model or another shard of the neurons."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        tensors, meta = read_checkpoint(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    check_fingerprint_version(meta, path)
    if meta.get("base_fingerprint") != trainer.base_fingerprint.hex:
        raise ValueError(
            f"{path} was trained on a base model with fingerprint {meta.get('base_fingerprint')}, "
            f"this one is {trainer.base_fingerprint.hex}"
        )
    try:
        load_block(trainer.block, data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    dev = trainer.block.w_gate_up.device
    state = trainer.optimizer.state_dict()
    restored: dict[int, dict[str, Tensor]] = {}
    for key, v in tensors.items():
        if key.startswith("optim."):
            _, i, name = key.split(".", 2)
            t = v.to(dev)
            restored.setdefault(int(i), {})[name] = t.reshape(()) if name == "step" else t
    state["state"] = restored
    trainer.optimizer.load_state_dict(state)
    trainer.step_index = int(meta["step"])
