"""Per-rank records under RESIDENT_TRAINER_RECEIPTS.

Layout, one directory per rank::

    rank<r>/phases.jsonl     one JSON line per phase a job enters
    rank<r>/receipts.jsonl   one JSON line per job that ends (its outcome)
    rank<r>/stacks/<n>.txt   stack dumps of every thread, one per timed-out wait

Every line carries ``t`` (the rank's clock), ``rank``, ``group`` and ``job``.
"""

from __future__ import annotations

import json
import posixpath
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from resident_trainer.protocol.clock import Clock
from resident_trainer.protocol.fs import FileSystem


def dump_all_stacks() -> str:
    """The current stack of every Python thread in this process, as text."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sorted(frames.items()):
        parts.append(f"--- thread {names.get(ident, '?')} (ident {ident}) ---\n")
        parts.extend(traceback.format_stack(frame))
    return "".join(parts)


class RecordLog:
    """Phase log, receipts and stack dumps of one rank.

    `on_phase`, when given, is called with every phase line before it is
    written (the simulation uses it to kill a rank at a chosen phase).
    """

    def __init__(
        self,
        fs: FileSystem,
        root: str,
        *,
        rank: int,
        group: str,
        clock: Clock,
        stack_dumper: Callable[[], str] = dump_all_stacks,
        on_phase: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if not isinstance(root, str) or not root:
            raise ValueError(f"root must be a non-empty path, got {root!r}")
        self.fs = fs
        self.rank = rank
        self.group = group
        self.clock = clock
        self.dir = posixpath.join(root, f"rank{rank}")
        self.stack_dumper = stack_dumper
        self.on_phase = on_phase
        self.dumps = 0

    @property
    def phases_path(self) -> str:
        return posixpath.join(self.dir, "phases.jsonl")

    @property
    def receipts_path(self) -> str:
        return posixpath.join(self.dir, "receipts.jsonl")

    def _line(self, job: str | None, **fields: Any) -> dict[str, Any]:
        return {"t": round(self.clock.now(), 6), "rank": self.rank, "group": self.group, "job": job, **fields}

    def phase(self, job: str | None, phase: str, **fields: Any) -> None:
        line = self._line(job, phase=phase, **fields)
        if self.on_phase is not None:
            self.on_phase(line)
        self.fs.append_line(self.phases_path, json.dumps(line, sort_keys=True))

    def receipt(self, job: str | None, outcome: str, **fields: Any) -> None:
        line = self._line(job, outcome=outcome, **fields)
        self.fs.append_line(self.receipts_path, json.dumps(line, sort_keys=True))

    def stacks(self, reason: str) -> str:
        """Write every thread's stack, headed by `reason`; return the path."""
        self.dumps += 1
        path = posixpath.join(self.dir, "stacks", f"{self.dumps:04d}.txt")
        self.fs.write_atomic(path, (f"# {reason}\n" + self.stack_dumper()).encode())
        return path


def read_jsonl(fs: FileSystem, path: str) -> list[dict[str, Any]]:
    """Parse a JSON-lines file ([] when missing); a torn last line (a crash
    mid-append) is skipped."""
    raw = fs.read_bytes(path)
    if not raw:
        return []
    out = []
    for line in raw.decode().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
