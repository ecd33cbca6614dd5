"""Crash recovery: every restart of the rank group happens under the fenced lock.

`Recovery.run` takes the lease, reads the group's state, and asks the
`GroupControl` whether the group is healthy. A healthy group is left exactly
as it is (no write, no restart): running recovery on a healthy group is a
no-op. Otherwise, with every step fenced by the lease's token:

1. write the intent ``{"status": "restarting", "generation": g+1, "token": t}``;
2. stop the old generation's processes (only those the state names);
3. start generation g+1, telling each process the token; a process whose
   token is not the one in the group state refuses to run (`admits`), so a
   group launched by a superseded owner never serves;
4. write ``{"status": "running", ...}`` with the new processes.

A stale owner fails its next fenced write with FencedOut and stops there.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import asdict, dataclass, field
from typing import Protocol

from resident_trainer.protocol.errors import FencedOut
from resident_trainer.protocol.fs import FileSystem
from resident_trainer.protocol.lock import FencedLock, Lease

GROUP_FILE = "group.json"


@dataclass(frozen=True)
class GroupState:
    """The rank group as recovery last left it."""

    generation: int
    token: int
    status: str  # "restarting" | "running"
    port: int = 0
    pids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)

    def encode(self) -> bytes:
        d = asdict(self)
        d["pids"] = list(self.pids)
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> GroupState:
        d = json.loads(raw)
        return cls(
            int(d["generation"]),
            int(d["token"]),
            str(d["status"]),
            int(d.get("port", 0)),
            tuple(d.get("pids", ())),
            d.get("extra", {}),
        )


class GroupControl(Protocol):
    """How recovery sees and drives the rank group."""

    def healthy(self, state: GroupState) -> bool:
        """Every rank of `state` is alive and answering."""

    def stop(self, state: GroupState) -> None:
        """End whatever is left of `state`'s processes."""

    def start(self, generation: int, token: int) -> tuple[int, tuple[int, ...]]:
        """Launch generation `generation` (its processes told `token`);
        return (store port, pids)."""


@dataclass(frozen=True)
class RecoveryResult:
    action: str  # "none": healthy, left alone | "restarted" | "busy": another owner holds the lock | "fenced"
    generation: int | None
    token: int | None
    detail: str = ""


def read_group(fs: FileSystem, state_dir: str) -> GroupState | None:
    raw = fs.read_bytes(posixpath.join(state_dir, GROUP_FILE))
    return None if raw is None else GroupState.decode(raw)


def admits(fs: FileSystem, state_dir: str, generation: int, token: int) -> bool:
    """True when the group state names this generation and token: a process
    launched by a superseded recovery owner finds it does not, and exits."""
    st = read_group(fs, state_dir)
    return st is not None and st.generation == generation and st.token == token


class Recovery:
    def __init__(self, lock: FencedLock, control: GroupControl, *, owner: str) -> None:
        self.lock = lock
        self.control = control
        self.owner = owner
        self.fs = lock.fs
        self.path = posixpath.join(lock.state_dir, GROUP_FILE)

    def state(self) -> GroupState | None:
        return read_group(self.fs, self.lock.state_dir)

    def run(self) -> RecoveryResult:
        lease = self.lock.acquire(self.owner)
        if lease is None:
            return RecoveryResult("busy", None, None, "another owner holds the recovery lock")
        started: tuple[int, tuple[int, ...]] | None = None
        try:
            state = self.state()
            if state is not None and state.status == "running" and self.control.healthy(state):
                return RecoveryResult("none", state.generation, state.token, "group healthy")
            generation = (state.generation if state is not None else 0) + 1
            self._write(lease, GroupState(generation, lease.token, "restarting"))
            if state is not None:
                self.lock.check(lease)
                self.control.stop(state)
            self.lock.check(lease)
            started = self.control.start(generation, lease.token)
            port, pids = started
            self._write(lease, GroupState(generation, lease.token, "running", port, tuple(pids)))
            return RecoveryResult("restarted", generation, lease.token)
        except FencedOut as exc:
            if started is not None:
                # Our processes would refuse to run anyway (admits); end them now.
                self.control.stop(GroupState(-1, lease.token, "restarting", started[0], tuple(started[1])))
            return RecoveryResult("fenced", None, lease.token, str(exc))
        finally:
            self.lock.release(lease)

    def _write(self, lease: Lease, state: GroupState) -> None:
        self.lock.write_fenced(lease, self.path, state.encode())
