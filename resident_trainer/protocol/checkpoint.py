"""Checkpoints of the added neurons under RESIDENT_TRAINER_CHECKPOINTS.

Each rank writes its own shard of a finished job to a fresh path (never over
an existing checkpoint); once every rank has reported its shard saved, the
head replaces ``LAST_GOOD.json`` (the manifest: which job, and each shard's
SHA-256) in one atomic rename. A failed or aborted job therefore never
changes what LAST_GOOD names, and a crash at any point leaves either the old
manifest or the new one.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resident_trainer.protocol.fs import FileSystem

MANIFEST = "LAST_GOOD.json"


@dataclass(frozen=True)
class Manifest:
    """What LAST_GOOD.json names: the job, and each rank's shard digest."""

    group: str
    job: int
    name: str
    shards: dict[int, str]
    meta: dict[str, Any] = field(default_factory=dict)


class CorruptCheckpoint(RuntimeError):
    """A shard named by the manifest is missing or does not match its digest."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CheckpointStore:
    def __init__(self, fs: FileSystem, root: str) -> None:
        if not isinstance(root, str) or not root:
            raise ValueError(f"root must be a non-empty path, got {root!r}")
        self.fs = fs
        self.root = root

    @property
    def manifest_path(self) -> str:
        return posixpath.join(self.root, MANIFEST)

    def shard_path(self, group: str, job: int, rank: int) -> str:
        return posixpath.join(self.root, group, f"j{job}", f"rank{rank}.bin")

    def write_shard(self, group: str, job: int, rank: int, data: bytes) -> str:
        """Write this rank's shard of job `job` atomically; return its SHA-256."""
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"shard data must be bytes, got {type(data).__name__}")
        self.fs.write_atomic(self.shard_path(group, job, rank), bytes(data))
        return sha256(bytes(data))

    def commit(self, group: str, job: int, name: str, shards: Mapping[int, str], **meta: Any) -> Manifest:
        """Make job `job` the last good checkpoint (one atomic rename)."""
        if not shards:
            raise ValueError("commit needs at least one shard digest")
        m = Manifest(group, job, name, {int(r): str(d) for r, d in shards.items()}, dict(meta))
        body = {
            "group": group,
            "job": job,
            "name": name,
            "shards": {str(r): d for r, d in sorted(m.shards.items())},
            "meta": m.meta,
        }
        self.fs.write_atomic(self.manifest_path, json.dumps(body, sort_keys=True).encode())
        return m

    def last_good(self) -> Manifest | None:
        raw = self.fs.read_bytes(self.manifest_path)
        if raw is None:
            return None
        obj = json.loads(raw)
        return Manifest(
            obj["group"],
            int(obj["job"]),
            obj["name"],
            {int(r): d for r, d in obj["shards"].items()},
            obj.get("meta", {}),
        )

    def load(self, rank: int) -> tuple[Manifest, bytes] | None:
        """The last good checkpoint's shard for `rank`, verified against its
        digest; None when there is no checkpoint yet."""
        m = self.last_good()
        if m is None:
            return None
        if rank not in m.shards:
            raise CorruptCheckpoint(f"last good checkpoint (job {m.name!r}) has no shard for rank {rank}")
        data = self.fs.read_bytes(self.shard_path(m.group, m.job, rank))
        if data is None:
            raise CorruptCheckpoint(f"shard of rank {rank} for job {m.name!r} is missing")
        if sha256(data) != m.shards[rank]:
            raise CorruptCheckpoint(f"shard of rank {rank} for job {m.name!r} does not match its digest")
        return m, data
