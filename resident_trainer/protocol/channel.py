"""The trainer-only channel: tagged records over the rendezvous store.

Serving never reads or writes these keys, and the channel never touches the
serving link's, so trainer traffic cannot interleave with serving
collectives. Every record is tagged (job, seq, name, rank) twice: in its key
and inside its JSON value; a record read back from the wrong key is an error.

Key layout, all under ``rt/<group>/``::

    j<job>/<name>/<seq>/<rank>   a record of job <job> (a per-group serial)
    open                         the job in flight: {"job", "last"}
    closed                       the highest job whose keys were purged, and
                                 the outcomes of the last few jobs

A job's keys are enumerable from its serial, its last boundary and the world
size (`job_keys`), so a finished job is purged by deleting exactly those keys;
nothing relies on prefix listing or ``num_keys`` (TCPStore has no per-prefix
count and no expiry).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from resident_trainer.protocol.errors import ChannelError
from resident_trainer.protocol.store import KVStore, RecordTooLarge, check_value

#: Record names. Reports go worker -> head, decisions head -> workers (a worker
#: may claim one on timeout), acks close a job.
REPORT = "report"
DECISION = "decision"
ACK = "ack"
RECORD_NAMES = (REPORT, DECISION, ACK)

#: The decision slot of every boundary is tagged with the head's rank.
HEAD = 0

#: The first boundary of every job: the sealed start.
SEAL = -1


@dataclass(frozen=True)
class Record:
    """One tagged record of the trainer channel."""

    job: int
    seq: int
    name: str
    rank: int
    body: Mapping[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(
            {"job": self.job, "seq": self.seq, "name": self.name, "rank": self.rank, "body": dict(self.body)},
            separators=(",", ":"),
            sort_keys=True,
        ).encode()


def _check_tags(job: int, seq: int, name: str, rank: int) -> None:
    if (
        type(job) is int
        and type(seq) is int
        and type(rank) is int
        and job >= 0
        and seq >= SEAL
        and rank >= 0
        and name in RECORD_NAMES
    ):
        return
    if not isinstance(job, int) or isinstance(job, bool) or job < 0:
        raise ValueError(f"job must be a non-negative int, got {job!r}")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < SEAL:
        raise ValueError(f"seq must be an int >= {SEAL}, got {seq!r}")
    if name not in RECORD_NAMES:
        raise ValueError(f"name must be one of {RECORD_NAMES}, got {name!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")


class TrainerChannel:
    """Tagged records of one rank group over a KVStore.

    group: a name for the rank group's generation (keys of different groups
    never collide); world: number of ranks (for enumerating a job's keys).
    """

    def __init__(self, store: KVStore, *, group: str, world: int) -> None:
        if not isinstance(group, str) or not group or "/" in group or any(c.isspace() for c in group):
            raise ValueError(f"group must be a non-empty str without '/' or whitespace, got {group!r}")
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be a positive int, got {world!r}")
        self.store = store
        self.group = group
        self.world = world
        self.prefix = f"rt/{group}/"

    # --- keys -----------------------------------------------------------------

    def key(self, job: int, seq: int, name: str, rank: int) -> str:
        _check_tags(job, seq, name, rank)
        return f"{self.prefix}j{job}/{name}/{seq}/{rank}"

    def job_keys(self, job: int, last_seq: int) -> Iterator[str]:
        """Every key job `job` can have written if its boundaries ran up to
        `last_seq`: reports and acks of every rank but the head, one decision
        slot per boundary."""
        for seq in range(SEAL, last_seq + 1):
            yield self.key(job, seq, DECISION, HEAD)
            for rank in range(self.world):
                if rank != HEAD:
                    yield self.key(job, seq, REPORT, rank)
                    yield self.key(job, seq, ACK, rank)

    @property
    def open_key(self) -> str:
        return self.prefix + "open"

    @property
    def closed_key(self) -> str:
        return self.prefix + "closed"

    # --- records ----------------------------------------------------------------

    def _encode(self, record: Record) -> tuple[str, bytes]:
        key = self.key(record.job, record.seq, record.name, record.rank)
        value = record.encode()
        try:
            check_value(key, value)
        except RecordTooLarge as exc:
            raise RecordTooLarge(
                f"record (job={record.job}, seq={record.seq}, name={record.name!r}, rank={record.rank}) "
                f"is {len(value)} bytes: {exc}"
            ) from None
        return key, value

    def _decode(self, key: str, raw: bytes, job: int, seq: int, name: str, rank: int) -> Record:
        try:
            obj = json.loads(raw)
            rec = Record(int(obj["job"]), int(obj["seq"]), str(obj["name"]), int(obj["rank"]), obj["body"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ChannelError(f"record under {key!r} is not a channel record: {exc}") from None
        if (rec.job, rec.seq, rec.name, rec.rank) != (job, seq, name, rank):
            raise ChannelError(
                f"record under {key!r} is tagged (job={rec.job}, seq={rec.seq}, name={rec.name!r}, "
                f"rank={rec.rank}), not (job={job}, seq={seq}, name={name!r}, rank={rank})"
            )
        return rec

    def post(self, record: Record) -> str:
        """Write `record` (overwriting the same tags); return its key."""
        key, value = self._encode(record)
        self.store.set(key, value)
        return key

    def claim(self, record: Record) -> Record:
        """Write `record` only if its slot is empty; return whichever record
        holds the slot afterwards (the winner). Writers must put something
        unique to them in the body, so a winner can recognise itself."""
        key, value = self._encode(record)
        raw = self.store.create(key, value)
        return self._decode(key, raw, record.job, record.seq, record.name, record.rank)

    def read(self, job: int, seq: int, name: str, rank: int) -> Record | None:
        key = self.key(job, seq, name, rank)
        raw = self.store.get(key)
        return None if raw is None else self._decode(key, raw, job, seq, name, rank)

    def delete(self, job: int, seq: int, name: str, rank: int) -> None:
        self.store.delete(self.key(job, seq, name, rank))

    def purge(self, job: int, last_seq: int) -> int:
        """Delete every key job `job` can have written; return how many
        deletes were issued."""
        n = 0
        for key in self.job_keys(job, last_seq):
            self.store.delete(key)
            n += 1
        return n

    # --- group-level markers ----------------------------------------------------

    def set_open(self, job: int, last_seq: int) -> None:
        self.store.set(self.open_key, json.dumps({"job": job, "last": last_seq}).encode())

    def get_open(self) -> tuple[int, int] | None:
        raw = self.store.get(self.open_key)
        if raw is None:
            return None
        obj = json.loads(raw)
        return int(obj["job"]), int(obj["last"])

    def clear_open(self) -> None:
        self.store.delete(self.open_key)

    def set_closed(self, job: int, verdict: str, boundary: int, previous: ClosedMarker | None = None) -> ClosedMarker:
        """Record job `job` as closed with its outcome, keeping the outcomes of
        the last CLOSED_HISTORY jobs (a worker that fell behind adopts its
        job's outcome from here). Only the head writes this key."""
        outcomes = dict(previous.outcomes) if previous is not None else {}
        outcomes[job] = (verdict, boundary)
        keep = sorted(outcomes)[-CLOSED_HISTORY:]
        marker = ClosedMarker(max(job, previous.job if previous is not None else -1), {k: outcomes[k] for k in keep})
        self.store.set(self.closed_key, marker.encode())
        return marker

    def closed_marker(self) -> ClosedMarker:
        raw = self.store.get(self.closed_key)
        return ClosedMarker.decode(raw) if raw is not None else ClosedMarker(-1, {})

    def closed(self) -> int:
        """Highest job serial whose keys were purged (-1 before any)."""
        return self.closed_marker().job


#: How many closed jobs' outcomes the `closed` marker remembers.
CLOSED_HISTORY = 16


@dataclass(frozen=True)
class ClosedMarker:
    """The group's `closed` key: the highest closed job and the outcomes
    (verdict, final boundary) of the most recent ones."""

    job: int
    outcomes: Mapping[int, tuple[str, int]]

    def encode(self) -> bytes:
        return json.dumps(
            {"job": self.job, "outcomes": {str(k): list(v) for k, v in self.outcomes.items()}}, sort_keys=True
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ClosedMarker:
        d = json.loads(raw)
        return cls(int(d["job"]), {int(k): (str(v[0]), int(v[1])) for k, v in d["outcomes"].items()})
