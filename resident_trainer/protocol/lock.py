"""The recovery lock: one exclusive, expiring lease with a fencing counter.

A lease alone cannot guarantee exclusion: its holder can stall past expiry
while another takes over, then wake up and act. So every lease carries a
token from a counter that only grows, and every write the lock guards goes
through `write_fenced`, which refuses a token that is not the newest one (or
whose lease has expired or been released). The check and the write happen
under one exclusive section (`FileSystem.guard`: flock on disk), so no newer
lease can be granted between them.

Files under the state directory::

    lock.json    {"token": last token granted, "owner": holder or null, "expires": t}
    lock.guard   the flock target
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

from resident_trainer.protocol.clock import Clock
from resident_trainer.protocol.errors import FencedOut
from resident_trainer.protocol.fs import FileSystem


@dataclass(frozen=True)
class Lease:
    """A granted lease: `token` fences every write made under it."""

    owner: str
    token: int
    expires: float


class FencedLock:
    """Exclusive lease over `state_dir`, valid for `lease_seconds` unless renewed.

    clock: must be comparable across processes (WallClock in production)."""

    def __init__(self, fs: FileSystem, state_dir: str, clock: Clock, *, lease_seconds: float = 30.0) -> None:
        if not isinstance(state_dir, str) or not state_dir:
            raise ValueError(f"state_dir must be a non-empty path, got {state_dir!r}")
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds!r}")
        self.fs = fs
        self.state_dir = state_dir
        self.clock = clock
        self.lease_seconds = float(lease_seconds)
        self.path = posixpath.join(state_dir, "lock.json")
        self.guard_path = posixpath.join(state_dir, "lock.guard")

    def _read(self) -> dict:
        raw = self.fs.read_bytes(self.path)
        if raw is None:
            return {"token": 0, "owner": None, "expires": 0.0}
        return json.loads(raw)

    def _write(self, state: dict) -> None:
        self.fs.write_atomic(self.path, json.dumps(state, sort_keys=True).encode())

    def state(self) -> dict:
        """The lock record as stored (token, owner, expires)."""
        with self.fs.guard(self.guard_path):
            return self._read()

    def acquire(self, owner: str) -> Lease | None:
        """A new lease for `owner`, or None while another unexpired lease is
        held. Each grant takes the next token, also when it breaks an expired
        lease, so the previous holder is fenced out."""
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner must be a non-empty str, got {owner!r}")
        with self.fs.guard(self.guard_path):
            st = self._read()
            now = self.clock.now()
            if st["owner"] is not None and st["expires"] > now:
                return None
            lease = Lease(owner, int(st["token"]) + 1, now + self.lease_seconds)
            self._write({"token": lease.token, "owner": owner, "expires": lease.expires})
            return lease

    def _check_locked(self, lease: Lease, st: dict) -> None:
        now = self.clock.now()
        if int(st["token"]) != lease.token or st["owner"] != lease.owner:
            raise FencedOut(
                f"lease token {lease.token} of {lease.owner!r} is stale: the lock is at token {st['token']} "
                f"held by {st['owner']!r}"
            )
        if st["expires"] <= now:
            raise FencedOut(
                f"lease token {lease.token} of {lease.owner!r} expired at {st['expires']:.3f} (now {now:.3f})"
            )

    def check(self, lease: Lease) -> None:
        """Raise FencedOut unless `lease` is the current, unexpired lease."""
        with self.fs.guard(self.guard_path):
            self._check_locked(lease, self._read())

    def renew(self, lease: Lease) -> Lease:
        """Extend `lease` (same token); raises FencedOut if it is stale."""
        with self.fs.guard(self.guard_path):
            st = self._read()
            self._check_locked(lease, st)
            renewed = Lease(lease.owner, lease.token, self.clock.now() + self.lease_seconds)
            self._write({"token": lease.token, "owner": lease.owner, "expires": renewed.expires})
            return renewed

    def release(self, lease: Lease) -> bool:
        """Give the lease up; False (and nothing changes) if it was stale."""
        with self.fs.guard(self.guard_path):
            st = self._read()
            if int(st["token"]) != lease.token or st["owner"] != lease.owner:
                return False
            self._write({"token": lease.token, "owner": None, "expires": 0.0})
            return True

    def write_fenced(self, lease: Lease, path: str, data: bytes) -> None:
        """Atomically replace `path` with `data`, only if `lease` is current."""
        with self.fs.guard(self.guard_path):
            self._check_locked(lease, self._read())
            self.fs.write_atomic(path, data)
