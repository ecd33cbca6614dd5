"""The serving side as the protocol sees it: an ordered sequence of serving
ops that the head broadcasts and every worker decodes in order, plus a
doorbell that wakes idle workers.

Doorbell rule, the same on both sides: the head rings once before every op
that follows an op whose ``live_after`` is False (the stream went idle), and
a worker consumes one ring before decoding such an op. So a worker that
decoded an op leaving chats live, such as the last RESUME of a job, decodes
the next op without waiting for a ring; waiting there would stall, since no
ring is coming.

`StoreServingLink` carries the sequence over its own key prefix of a store
(the minimal serving harness uses it; a production engine brings its own
broadcast). It never touches the trainer channel's keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from resident_trainer.protocol.store import KVStore


class OpKind(str, Enum):
    SERVE = "serve"  # one serving iteration over the live chats (a collective in TP)
    START = "start"  # a job starts here: every worker confirms this message number
    RESUME = "resume"  # closes the serving iteration nested in a job's pause
    PUBLISH = "publish"  # the job's trained block becomes visible to serving here


@dataclass(frozen=True)
class ServingOp:
    """One message of the serving sequence; `msg` numbers are 1, 2, 3, ..."""

    msg: int
    kind: OpKind
    live_after: bool
    job: int = -1
    boundary: int = -1
    chats: tuple[int, ...] = ()
    data: Mapping[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "msg": self.msg,
                "kind": self.kind.value,
                "live": self.live_after,
                "job": self.job,
                "b": self.boundary,
                "chats": list(self.chats),
                "data": dict(self.data),
            },
            separators=(",", ":"),
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ServingOp:
        d = json.loads(raw)
        return cls(
            int(d["msg"]), OpKind(d["kind"]), bool(d["live"]), int(d["job"]), int(d["b"]), tuple(d["chats"]), d["data"]
        )


@dataclass
class Chat:
    """A chat request: `tokens` serving iterations until its reply is done."""

    id: int
    tokens: int
    arrived: float
    first_served: float | None = None
    first_msg: int | None = None


class HeadLink(Protocol):
    def send(self, op: ServingOp) -> None:
        """Broadcast `op` to every worker (idempotent for the same op)."""

    def ring(self, n: int) -> None:
        """Ring the doorbell for the `n`-th time (n = 1, 2, ...; idempotent)."""


class WorkerLink(Protocol):
    def poll(self) -> ServingOp | None:
        """The next op in order, or None if it has not arrived."""

    def rung(self) -> bool:
        """Consume one doorbell ring if one has arrived."""

    def wait_keys(self, ring: bool) -> tuple[str, ...]:
        """Store keys whose arrival would make rung (`ring`) or poll succeed."""


class ServingBackend(Protocol):
    def execute(self, op: ServingOp) -> None:
        """This rank's share of a SERVE op (in TP, a forward with collectives)."""


class ChatSource(Protocol):
    def take(self) -> list[Chat]:
        """Chats that arrived since the last call."""

    def finished(self, chat: Chat, msg: int) -> None:
        """`chat`'s reply is complete at serving message `msg`."""


class StoreServingLink:
    """The serving sequence over ``srv/<group>/`` keys of a store.

    The head writes each op (and each ring) once per worker; each worker
    deletes what it consumed, so consumed messages do not pile up in a store
    without expiry."""

    def __init__(self, store: KVStore, *, group: str, rank: int, world: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..{world - 1}, got {rank!r}")
        self.store = store
        self.prefix = f"srv/{group}/"
        self.rank = rank
        self.world = world
        self.next_msg = 1
        self.next_ring = 1

    def _op_key(self, rank: int, msg: int) -> str:
        return f"{self.prefix}op/{rank}/{msg}"

    def _ring_key(self, rank: int, n: int) -> str:
        return f"{self.prefix}bell/{rank}/{n}"

    # head side
    def send(self, op: ServingOp) -> None:
        raw = op.encode()
        for r in range(self.world):
            if r != self.rank:
                self.store.set(self._op_key(r, op.msg), raw)

    def ring(self, n: int) -> None:
        for r in range(self.world):
            if r != self.rank:
                self.store.set(self._ring_key(r, n), b"1")

    # worker side
    def poll(self) -> ServingOp | None:
        key = self._op_key(self.rank, self.next_msg)
        raw = self.store.get(key)
        if raw is None:
            return None
        op = ServingOp.decode(raw)
        self.store.delete(key)
        self.next_msg += 1
        return op

    def rung(self) -> bool:
        key = self._ring_key(self.rank, self.next_ring)
        if self.store.get(key) is None:
            return False
        self.store.delete(key)
        self.next_ring += 1
        return True

    def wait_keys(self, ring: bool) -> tuple[str, ...]:
        if ring:
            return (self._ring_key(self.rank, self.next_ring),)
        return (self._op_key(self.rank, self.next_msg),)
