"""The serving loops the jobs live in: `HeadServer` (rank 0) and `WorkerServer`.

A minimal serving loop, enough to host the protocol: the head admits chats,
runs one serving iteration per op over every live chat, and starts queued
jobs; workers decode the op sequence in order, execute each op, and run a
job from the START op on. A production engine plugs its own link, backend
and chat source in; the loops' job handling is what this module defines.

Like the job machines, both loops are non-blocking: `tick()` returns a
`Wake`, and the same code runs under the simulation and in real processes.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from resident_trainer.protocol.authority import authority_ok
from resident_trainer.protocol.channel import ACK, ClosedMarker
from resident_trainer.protocol.errors import LinkClosed, StoreError
from resident_trainer.protocol.job import (
    BodyFactory,
    GroupLost,
    HeadJob,
    JobBody,
    JobKind,
    JobSpec,
    RankContext,
    Verdict,
    Wake,
    WorkerJob,
    start_tag_for,
)
from resident_trainer.protocol.serving import Chat, ChatSource, HeadLink, OpKind, ServingBackend, ServingOp, WorkerLink


@dataclass
class _Closing:
    """A finished job whose keys the head purges once every worker acked
    (or the ack deadline passed)."""

    serial: int
    last_seq: int
    final_seq: int
    deadline: float
    acked: set[int] = field(default_factory=set)
    verdict: str = "cancel"
    marked: bool = False  # `closed` raised and `open` cleared
    keys: list[str] | None = None  # keys still to delete (the purge resumes after a store error)


class HeadServer:
    """Rank 0's serving loop: chats, the op sequence, and the jobs."""

    #: The job machine this loop runs (a subclass may swap in a variant).
    job_class: type[HeadJob] = HeadJob

    def __init__(
        self,
        ctx: RankContext,
        *,
        link: HeadLink,
        backend: ServingBackend,
        chats: ChatSource,
        body_factory: BodyFactory,
    ) -> None:
        if ctx.rank != 0:
            raise ValueError(f"HeadServer runs on rank 0, got rank {ctx.rank}")
        self.ctx = ctx
        self.link = link
        self.backend = backend
        self.chats = chats
        self.body_factory = body_factory
        self.msg = 0
        self.rings = 0
        self.last_live = False
        self.outbox: deque[tuple[str, Any]] = deque()
        self.waiting: deque[Chat] = deque()
        self.live: dict[int, list] = {}  # chat id -> [chat, iterations left]
        self.queue: deque[JobSpec] = deque()
        self.job: HeadJob | None = None
        self.serial = 0
        self.closing: deque[_Closing] = deque()
        self.published: list[tuple[int, str, int]] = []  # (serial, name, msg)
        self.lost: str | None = None
        self.closed_marker: ClosedMarker | None = None

    # --- the op sequence ----------------------------------------------------------------

    def _op(self, kind: OpKind, **kw: Any) -> ServingOp:
        """Assign the next message number and queue the op (after a ring when
        the stream was idle); sending happens in `flush`, retried on store
        errors, so an op is numbered and executed exactly once."""
        self.msg += 1
        if not self.last_live:
            self.rings += 1
            self.outbox.append(("ring", self.rings))
        op = ServingOp(self.msg, kind, **kw)
        self.outbox.append(("op", op))
        self.last_live = op.live_after
        return op

    def flush(self) -> None:
        """Send queued rings and ops in order; a store error leaves the rest
        queued for the next call."""
        while self.outbox:
            what, item = self.outbox[0]
            if what == "ring":
                self.link.ring(item)
            else:
                self.link.send(item)
            self.outbox.popleft()

    # --- chats ---------------------------------------------------------------------------

    def _take_chats(self) -> None:
        for chat in self.chats.take():
            self.waiting.append(chat)

    def has_chats(self) -> bool:
        self._take_chats()
        return bool(self.waiting or self.live)

    def serve_iteration(self) -> None:
        """One serving iteration over every waiting and live chat."""
        self._take_chats()
        now = self.ctx.clock.now()
        while self.waiting:
            chat = self.waiting.popleft()
            self.live[chat.id] = [chat, chat.tokens]
        ids = tuple(sorted(self.live))
        live_after = any(left > 1 for _, left in self.live.values())
        op = self._op(OpKind.SERVE, live_after=live_after, chats=ids)
        self.backend.execute(op)
        for cid in ids:
            entry = self.live[cid]
            if entry[0].first_served is None:
                entry[0].first_served = now
                entry[0].first_msg = op.msg
            entry[1] -= 1
            if entry[1] <= 0:
                del self.live[cid]
                self.chats.finished(entry[0], op.msg)

    def resume(self, job: int, boundary: int) -> None:
        self._op(OpKind.RESUME, live_after=bool(self.live), job=job, boundary=boundary)

    # --- jobs ----------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> None:
        if not isinstance(spec, JobSpec):
            raise TypeError(f"spec must be a JobSpec, got {type(spec).__name__}")
        self.queue.append(spec)

    def _refuse(self, spec: JobSpec, why: str) -> None:
        self.ctx.log.receipt(spec.name, "refused", serial=None, kind=spec.kind.value, reasons=[why], boundary=None)

    def _start(self, spec: JobSpec) -> None:
        cfg = self.ctx.config
        if not authority_ok(cfg.authority, spec.authority):
            self._refuse(
                spec,
                "the job does not carry the configured authority" if cfg.authority else "no authority is configured",
            )
            return
        if spec.kind is JobKind.HOTLOAD and not cfg.hotload:
            self._refuse(spec, "hot-load is disabled (RESIDENT_TRAINER_HOTLOAD)")
            return
        try:
            body: JobBody = self.body_factory(spec, self.ctx)
        except Exception as exc:  # the trainer's factory: refuse the job, keep serving
            self._refuse(spec, f"creating the job body failed: {type(exc).__name__}: {exc}")
            return
        serial = self.serial + 1
        try:
            self.ctx.channel.set_open(serial, spec.last_seq)
        except StoreError:
            body.discard()
            raise
        self.serial = serial
        data = {**spec.public(), "tag": start_tag_for(cfg.authority, self.ctx.group, serial, spec)}
        op = self._op(OpKind.START, live_after=bool(self.live), job=serial, data=data)
        self.ctx.log.phase(spec.name, "start", serial=serial, b=-1, msg=op.msg)
        self.job = self.job_class(self.ctx, spec, serial, op.msg, body, self)

    def _after_job(self) -> None:
        job = self.job
        assert job is not None and job.outcome is not None
        self.job = None
        manifest_error = None
        if job.outcome.verdict is Verdict.PUBLISH:
            shards = {int(r): d for r, d in job.decision["shards"].items()}
            try:
                self.ctx.checkpoints.commit(self.ctx.group, job.serial, job.spec.name, shards)
            except OSError as exc:
                manifest_error = f"writing the checkpoint manifest failed: {exc}"
            if manifest_error is None:
                op = self._op(OpKind.PUBLISH, live_after=bool(self.live), job=job.serial)
                _, err = job._body_call("publish", job.body.publish)
                self.published.append((job.serial, job.spec.name, op.msg))
                self.ctx.log.phase(job.spec.name, "published", serial=job.serial, b=job.boundary, msg=op.msg, error=err)
            else:
                job._body_call("discard", job.body.discard)
        job.write_receipt(manifest_error=manifest_error)
        self.closing.append(
            _Closing(
                job.serial,
                job.spec.last_seq,
                job.boundary,
                self.ctx.clock.now() + self.ctx.config.timeouts.exchange,
                verdict=job.outcome.label,
            )
        )

    def _progress_closing(self) -> tuple[str, ...]:
        ch = self.ctx.channel
        while self.closing:
            c = self.closing[0]
            for r in range(1, self.ctx.world):
                if r not in c.acked and ch.read(c.serial, c.final_seq, ACK, r) is not None:
                    c.acked.add(r)
            if len(c.acked) < self.ctx.world - 1 and self.ctx.clock.now() < c.deadline:
                return tuple(
                    ch.key(c.serial, c.final_seq, ACK, r) for r in range(1, self.ctx.world) if r not in c.acked
                )
            # Closed before the purge: a worker writing after the purge sees it
            # and takes its write back.
            if not c.marked:
                self.closed_marker = ch.set_closed(c.serial, c.verdict, c.final_seq, self.closed_marker)
                ch.clear_open()
                c.marked = True
                c.keys = list(ch.job_keys(c.serial, c.last_seq))
            while c.keys:
                self.ctx.channel.store.delete(c.keys[-1])
                c.keys.pop()
            self.ctx.log.phase(None, "closed", serial=c.serial, acked=sorted(c.acked))
            self.closing.popleft()
        return ()

    # --- the loop ----------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A job, a queued job, unfinished cleanup or chats remain."""
        return bool(self.job or self.queue or self.closing or self.waiting or self.live or self.outbox)

    def tick(self) -> Wake:
        poll = self.ctx.config.timeouts.poll
        while self.lost is None:
            try:
                self.flush()
                ack_keys = self._progress_closing()
            except StoreError:
                return Wake(self.ctx.clock.now() + poll)
            if self.job is not None:
                try:
                    wake = self.job.tick()
                except GroupLost as exc:
                    # The head's own store failed for the whole group timeout:
                    # nothing can be coordinated any more; recovery restarts the group.
                    job, self.job = self.job, None
                    self.lost = str(exc)
                    job.abandon_group(str(exc))
                    return Wake(None)
                try:
                    self.flush()
                except StoreError:
                    return Wake(self.ctx.clock.now() + poll)
                if not self.job.finished:
                    return wake
                self._after_job()
                continue
            if self.queue and not self.closing:
                try:
                    self._start(self.queue[0])
                except StoreError:
                    return Wake(self.ctx.clock.now() + poll)
                self.queue.popleft()
                continue
            if self.has_chats():
                self.serve_iteration()
                continue
            at = self.closing[0].deadline if self.closing else None
            return Wake(at, ack_keys)
        return Wake(None)


class WorkerServer:
    """A worker's serving loop: decode ops in order, execute them, join jobs."""

    #: The job machine this loop runs (a subclass may swap in a variant).
    job_class: type[WorkerJob] = WorkerJob

    def __init__(
        self,
        ctx: RankContext,
        *,
        link: WorkerLink,
        backend: ServingBackend,
        body_factory: BodyFactory,
    ) -> None:
        if ctx.rank == 0:
            raise ValueError("WorkerServer runs on ranks 1..world-1, got rank 0")
        self.ctx = ctx
        self.link = link
        self.backend = backend
        self.body_factory = body_factory
        self.need_ring = True  # the first op follows an idle stream
        self.job: WorkerJob | None = None
        self.pending: tuple[int, str, JobBody] | None = None  # a job awaiting its PUBLISH op
        self.lost: str | None = None
        self.last_msg = 0
        self.published: list[tuple[int, str, int]] = []
        self.store_down_since: float | None = None

    # --- WorkerServing ------------------------------------------------------------------

    def read_op(self) -> ServingOp | None:
        """The next op, consuming the doorbell ring that precedes it when the
        previous op left the stream idle."""
        if self.need_ring:
            if not self.link.rung():
                return None
            self.need_ring = False
        op = self.link.poll()
        if op is None:
            return None
        if op.msg != self.last_msg + 1:
            raise GroupLost(f"rank {self.ctx.rank}: serving message {op.msg} follows {self.last_msg}")
        self.last_msg = op.msg
        self.need_ring = not op.live_after
        return op

    def execute(self, op: ServingOp) -> None:
        self.backend.execute(op)

    def op_wait_keys(self) -> tuple[str, ...]:
        return self.link.wait_keys(self.need_ring)

    # --- the loop --------------------------------------------------------------------------

    def after_job(self, job: WorkerJob) -> None:
        """Keep a job's body until its PUBLISH op, when it may publish.
        The doorbell state is left as the job's last op (START or the last
        RESUME) set it: if that op left chats live, no ring precedes the next
        op, and waiting for one would stall the group."""
        if job.outcome.verdict is Verdict.PUBLISH or job.outcome.verdict is None:
            self.pending = (job.serial, job.spec.name, job.body)
        job.write_receipt()

    def _handle(self, op: ServingOp) -> None:
        log = self.ctx.log
        if op.kind is OpKind.SERVE:
            self.execute(op)
        elif op.kind is OpKind.START:
            if self.pending is not None:
                with contextlib.suppress(Exception):  # the trainer's discard must not stop serving
                    self.pending[2].discard()
                self.pending = None
            spec = JobSpec.from_public(op.data)
            log.phase(spec.name, "start", serial=op.job, b=-1, msg=op.msg)
            self.job = self.job_class(
                self.ctx, spec, op.job, op.msg, str(op.data.get("tag", "")), self.body_factory, self
            )
        elif op.kind is OpKind.PUBLISH:
            if self.pending is not None and self.pending[0] == op.job:
                serial, name, body = self.pending
                self.pending = None
                try:
                    body.publish()
                except Exception as exc:  # the trainer's code: logged, serving goes on
                    log.phase(name, "publish_failed", serial=serial, msg=op.msg, error=f"{type(exc).__name__}: {exc}")
                self.published.append((serial, name, op.msg))
                log.phase(name, "published", serial=serial, b=None, msg=op.msg)
            else:
                log.phase(None, "stray_publish", serial=op.job, msg=op.msg)
        else:
            log.phase(None, "stray_resume", serial=op.job, msg=op.msg)

    def tick(self) -> Wake:
        while self.lost is None:
            try:
                if self.job is not None:
                    wake = self.job.tick()
                    if not self.job.finished:
                        return wake
                    job, self.job = self.job, None
                    self.after_job(job)
                    continue
                op = self.read_op()
            except GroupLost as exc:
                self._lose(str(exc))
                break
            except LinkClosed as exc:
                self._lose(f"rank {self.ctx.rank}: serving link closed: {exc}")
                break
            except StoreError as exc:
                now = self.ctx.clock.now()
                if self.store_down_since is None:
                    self.store_down_since = now
                if now - self.store_down_since >= self.ctx.config.timeouts.group:
                    self._lose(f"rank {self.ctx.rank}: store failing for {now - self.store_down_since:.3f}s: {exc}")
                    break
                return Wake(now + self.ctx.config.timeouts.poll)
            self.store_down_since = None
            if op is None:
                return Wake(None, self.op_wait_keys())
            self._handle(op)
        return Wake(None)

    def _lose(self, why: str) -> None:
        self.lost = why
        job = self.job
        if job is not None:
            job.phase("group_lost", why=why)
            job.abandon_group(why)
        else:
            self.ctx.log.phase(None, "group_lost", why=why)
