"""One job across the rank group: the head's and the workers' state machines.

A job is a walk over boundaries. At each boundary every worker posts a
report (its local vote: whether it must abort, and why), the head collects
them with a deadline, decides, and claims the boundary's decision slot; every
rank then follows the decision in that slot and nothing else.

| boundary | what the votes carry | decisions |
|---|---|---|
| -1 (seal) | the START op's message number each worker decoded | GO, CANCEL |
| 0 .. n-1 (before step b) | step failure, budget breach, STOP file | TRAIN, PAUSE, ABORT |
| n (verify) | the frozen fingerprint after the job equals the one before | SAVE, ABORT |
| n+1 (commit) | this rank's checkpoint shard written, and its digest | PUBLISH, ABORT |
| hot-load 0 | digest of the staged code snapshot | LOAD, ABORT |
| hot-load 1 | the snapshot executed | DONE, ABORT |

The decision slot is written with the store's atomic create, never set: a
worker whose wait for a decision runs out claims ABORT (CANCEL at the seal)
in the same slot, and whichever write lands first is the decision for every
rank. So all ranks abort at the same boundary whatever one of them saw, and
a slow head cannot train while a worker that gave up goes back to serving.

The machines never block: `tick()` does all the work it can and returns a
`Wake` naming when (and on which store keys) it next has something to do.
Their store, clock, filesystem, serving link and job body are all passed
in, so a seeded simulation drives the same code that runs over TCPStore.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from resident_trainer.protocol.authority import start_tag, tag_ok
from resident_trainer.protocol.budget import BudgetMonitor
from resident_trainer.protocol.channel import ACK, DECISION, HEAD, REPORT, SEAL, ClosedMarker, Record, TrainerChannel
from resident_trainer.protocol.checkpoint import CheckpointStore
from resident_trainer.protocol.clock import Clock
from resident_trainer.protocol.config import ProtocolConfig
from resident_trainer.protocol.errors import HotLoadRefused, LinkClosed, ProtocolError, StoreError
from resident_trainer.protocol.fs import FileSystem
from resident_trainer.protocol.hotload import StagedCode, check_modules, execute, stage
from resident_trainer.protocol.records import RecordLog
from resident_trainer.protocol.serving import OpKind, ServingOp

if TYPE_CHECKING:
    from types import ModuleType

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class JobKind(str, Enum):
    TRAIN = "train"
    HOTLOAD = "hotload"


class Verdict(str, Enum):
    GO = "go"
    CANCEL = "cancel"
    TRAIN = "train"
    PAUSE = "pause"
    SAVE = "save"
    PUBLISH = "publish"
    LOAD = "load"
    DONE = "done"
    ABORT = "abort"


class JobState(str, Enum):
    """Where one rank's machine is within a job (both sides share the names;
    each side uses its own subset)."""

    VOTE = "vote"  # compute this rank's vote at the current boundary
    COLLECT = "collect"  # head: gather the workers' reports until the deadline
    DECIDE = "decide"  # head: claim the boundary's decision slot
    WAIT = "wait"  # worker: wait for the head's decision
    PAUSE = "pause"  # a PAUSE decision: serve before the step
    PAUSE_SERVE = "pause_serve"  # head: one serving iteration
    PAUSE_RESUME = "pause_resume"  # head: queue RESUME
    PAUSE_FLUSH = "pause_flush"  # head: send SERVE and RESUME before stepping
    PAUSED = "paused"  # worker: execute serving ops until RESUME
    STEP = "step"  # run the microbatch
    FINISH = "finish"  # the job's outcome is known
    FINISH_LOCAL = "finish_local"  # worker: ack posted (or job abandoned); end the body


FINAL = frozenset({Verdict.CANCEL, Verdict.ABORT, Verdict.PUBLISH, Verdict.DONE})


@dataclass(frozen=True)
class JobSpec:
    """A job as submitted to the head.

    name: the submitter's id (receipts, checkpoints); steps: microbatches of a
    TRAIN job; root: the job's directory (its STOP file, staged code);
    authority: must equal RESIDENT_TRAINER_AUTHORITY, never leaves the head;
    modules: what a HOTLOAD job replaces.
    """

    name: str
    kind: JobKind = JobKind.TRAIN
    steps: int = 1
    root: str = "."
    authority: str = field(default="", repr=False)
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"job name must be 1-64 characters of [A-Za-z0-9_.-], got {self.name!r}")
        object.__setattr__(self, "kind", JobKind(self.kind))
        if self.kind is JobKind.TRAIN:
            if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
                raise ValueError(f"steps must be a positive int for a TRAIN job, got {self.steps!r}")
            if self.modules:
                raise ValueError("modules are for HOTLOAD jobs only")
        else:
            object.__setattr__(self, "steps", 0)
            object.__setattr__(self, "modules", check_modules(tuple(self.modules)))
        if not isinstance(self.root, str) or not self.root:
            raise ValueError(f"root must be a non-empty path, got {self.root!r}")
        if not isinstance(self.authority, str):
            raise TypeError(f"authority must be a str, got {type(self.authority).__name__}")

    @property
    def last_seq(self) -> int:
        """The last boundary this job can reach."""
        return self.steps + 1 if self.kind is JobKind.TRAIN else 1

    @property
    def stop_path(self) -> str:
        return posixpath.join(self.root, "STOP")

    def public(self) -> dict[str, Any]:
        """Everything but the authority: what the START op carries."""
        return {
            "name": self.name,
            "kind": self.kind.value,
            "steps": self.steps,
            "root": self.root,
            "modules": list(self.modules),
        }

    @classmethod
    def from_public(cls, d: Mapping[str, Any]) -> JobSpec:
        return cls(d["name"], JobKind(d["kind"]), int(d["steps"]) or 1, d["root"], "", tuple(d.get("modules", ())))


class BoundaryKind(str, Enum):
    """What a boundary is for (the table at the top of this module)."""

    SEAL = "seal"
    STEP = "step"
    VERIFY = "verify"
    COMMIT = "commit"
    LOAD = "load"
    LOADED = "loaded"


def boundary_kind(spec: JobSpec, b: int) -> BoundaryKind:
    if b == SEAL:
        return BoundaryKind.SEAL
    if spec.kind is JobKind.HOTLOAD:
        return BoundaryKind.LOAD if b == 0 else BoundaryKind.LOADED
    if b < spec.steps:
        return BoundaryKind.STEP
    return BoundaryKind.VERIFY if b == spec.steps else BoundaryKind.COMMIT


class JobBody(Protocol):
    """What a job does on one rank; the trainer implements it.

    Methods run inside the rank's serving process, between serving ops. A
    method may raise: the protocol turns the exception into an abort reason
    at the next boundary."""

    def fingerprint(self) -> Mapping[str, str]:
        """Digests of the frozen tensors (and the watch layer), by name."""

    def step(self, index: int) -> Mapping[str, float]:
        """Run microbatch `index` (may use collectives of the rank group)."""

    def checkpoint(self) -> bytes:
        """This rank's shard of the trained block, serialised."""

    def publish(self) -> None:
        """Make the trained block visible to serving."""

    def discard(self) -> None:
        """Drop the job's unpublished state."""


@dataclass
class RankContext:
    """Everything a rank's machines are given (nothing is global)."""

    rank: int
    world: int
    group: str
    channel: TrainerChannel
    clock: Clock
    fs: FileSystem
    log: RecordLog
    config: ProtocolConfig
    budget: BudgetMonitor
    checkpoints: CheckpointStore
    modules: Mapping[str, ModuleType | dict] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world must be a positive int, got {self.world!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in 0..{self.world - 1}, got {self.rank!r}")


BodyFactory = Callable[[JobSpec, RankContext], JobBody]


@dataclass(frozen=True)
class Wake:
    """When a machine next has something to do: at time `at` at the latest
    (None: only when something it waits on changes), or when all `keys`
    exist in the store."""

    at: float | None
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict | None  # None: the job was closed before this rank saw its decision
    boundary: int
    reasons: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.verdict in (Verdict.PUBLISH, Verdict.DONE)

    @property
    def label(self) -> str:
        return self.verdict.value if self.verdict is not None else "abandoned"


class GroupLost(ProtocolError):
    """The store or the serving link stayed silent past the group timeout:
    the rank leaves its group to recovery."""


class HeadServing(Protocol):
    """What a head's job needs from its serving loop."""

    def has_chats(self) -> bool: ...

    def serve_iteration(self) -> None: ...

    def resume(self, job: int, boundary: int) -> None: ...

    def flush(self) -> None:
        """Send every queued op now (raises StoreError if it cannot)."""


class WorkerServing(Protocol):
    """What a worker's job needs from its serving loop."""

    def read_op(self) -> ServingOp | None: ...

    def execute(self, op: ServingOp) -> None: ...

    def op_wait_keys(self) -> tuple[str, ...]: ...


def start_tag_for(authority: str, group: str, serial: int, spec: JobSpec) -> str:
    return start_tag(
        authority, group, serial, spec.name, spec.kind.value, spec.steps, spec.root, ",".join(spec.modules)
    )


class JobRun:
    """What the head's and the workers' machines share: votes, following a
    decision, steps, and the final receipt."""

    def __init__(self, ctx: RankContext, spec: JobSpec, serial: int, msg: int) -> None:
        self.ctx = ctx
        self.spec = spec
        self.serial = serial
        self.msg = msg
        self.timeouts = ctx.config.timeouts
        self.body: JobBody | None = None
        self.boundary = SEAL
        self.state = JobState.VOTE
        self.outcome: Outcome | None = None
        self.finished = False
        self.vote: dict[str, Any] | None = None
        self.decision: Mapping[str, Any] | None = None
        self.step_error: str | None = None
        self.fp_before: dict[str, str] | None = None
        self.fp_after: dict[str, str] | None = None
        self.fp_error: str | None = None
        self.staged: StagedCode | None = None
        self.exec_error: str | None = None
        self.loaded: list[str] = []
        self.shard: str | None = None
        self.steps_done = 0
        self.store_down_since: float | None = None

    # --- helpers ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.ctx.rank

    def now(self) -> float:
        return self.ctx.clock.now()

    def phase(self, name: str, **fields: Any) -> None:
        self.ctx.log.phase(self.spec.name, name, serial=self.serial, b=self.boundary, **fields)

    def timed_out(self, what: str, deadline: float) -> str:
        now = self.now()
        reason = f"rank {self.rank}: {what} (boundary {self.boundary}, waited until {deadline:.3f}, now {now:.3f})"
        self.phase("timeout", what=what, deadline=round(deadline, 6), late=round(now - deadline, 6))
        self.ctx.log.stacks(reason)
        return reason

    def tick(self) -> Wake:
        """Advance as far as possible; a store failure is retried on later
        ticks until it has lasted `timeouts.group`, then GroupLost."""
        try:
            wake = self._advance()
        except StoreError as exc:
            now = self.now()
            if self.store_down_since is None:
                self.store_down_since = now
                self.phase("store_error", error=str(exc))
            if now - self.store_down_since >= self.timeouts.group:
                raise GroupLost(
                    f"rank {self.rank}: store failing for {now - self.store_down_since:.3f}s: {exc}"
                ) from exc
            return Wake(now + self.timeouts.poll)
        self.store_down_since = None
        return wake

    def _advance(self) -> Wake:
        raise NotImplementedError

    # --- local work at a boundary ---------------------------------------------------

    def _body_call(self, what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
        try:
            return fn(), None
        except ProtocolError as exc:
            return None, f"rank {self.rank}: {what} failed: {exc}"
        except Exception as exc:  # the trainer's code: any failure aborts the job, never the server
            return None, f"rank {self.rank}: {what} failed: {type(exc).__name__}: {exc}"

    def local_vote(self) -> dict[str, Any]:
        """This rank's vote at the current boundary (computed once per boundary)."""
        kind = boundary_kind(self.spec, self.boundary)
        vote: dict[str, Any] = {"abort": None}

        def abort(why: str | None) -> None:
            if why and vote["abort"] is None:
                vote["abort"] = why

        if kind is BoundaryKind.SEAL:
            abort(self.seal_vote())
            vote["msg"] = self.msg
            return vote
        abort(self.step_error)
        abort(self.fp_error)
        breach = self.ctx.budget.breach()
        abort(f"rank {self.rank}: {breach}" if breach else None)
        if self.ctx.fs.exists(self.spec.stop_path):
            abort(f"rank {self.rank}: STOP file {self.spec.stop_path}")
        if kind is BoundaryKind.VERIFY and vote["abort"] is None:
            after, err = self._body_call("fingerprint after the job", lambda: dict(self.body.fingerprint()))
            self.fp_after = after
            abort(err)
            if after is not None:
                changed = sorted(
                    k for k in set(after) | set(self.fp_before or {}) if after.get(k) != (self.fp_before or {}).get(k)
                )
                abort(f"rank {self.rank}: frozen fingerprint changed: {', '.join(changed)}" if changed else None)
        if kind is BoundaryKind.COMMIT and vote["abort"] is None:
            digest, err = self._body_call(
                "checkpoint",
                lambda: self.ctx.checkpoints.write_shard(
                    self.ctx.group, self.serial, self.rank, self.body.checkpoint()
                ),
            )
            abort(err)
            self.shard = digest
            vote["shard"] = digest
        if kind is BoundaryKind.LOAD and vote["abort"] is None:
            try:
                self.staged = stage(self.ctx.fs, self.spec.root, self.spec.modules)
                vote["digest"] = self.staged.digest
            except (HotLoadRefused, OSError) as exc:
                abort(f"rank {self.rank}: {exc}")
        if kind is BoundaryKind.LOADED:
            abort(self.exec_error)
        return vote

    def seal_vote(self) -> str | None:
        return None

    # --- following a decision ---------------------------------------------------------

    def follow(self, d: Mapping[str, Any]) -> None:
        v = Verdict(d["v"])
        self.decision = d
        self.phase("decided", v=v.value, by=d.get("by"))
        self.vote = None
        if v in FINAL:
            self.outcome = Outcome(v, self.boundary, tuple(d.get("why", ())))
            self.state = JobState.FINISH
        elif v is Verdict.GO:
            self.ctx.budget.reset()
            before, err = self._body_call("fingerprint before the job", lambda: dict(self.body.fingerprint()))
            self.fp_before, self.fp_error = before, err
            self.boundary = 0
            self.state = JobState.VOTE
        elif v is Verdict.TRAIN:
            self.state = JobState.STEP
        elif v is Verdict.PAUSE:
            self.state = JobState.PAUSE
        elif v is Verdict.SAVE:
            self.boundary += 1
            self.state = JobState.VOTE
        elif v is Verdict.LOAD:
            self._load(str(d["digest"]))
            self.boundary += 1
            self.state = JobState.VOTE

    def _load(self, digest: str) -> None:
        self.phase("load", digest=digest[:16])
        if self.staged is None:
            self.exec_error = f"rank {self.rank}: no staged snapshot to load"
            return
        try:
            self.loaded = execute(self.staged, digest, self.ctx.modules)
        except HotLoadRefused as exc:
            self.exec_error = f"rank {self.rank}: {exc}"
        except Exception as exc:  # the staged code's own failure
            self.exec_error = f"rank {self.rank}: hot-loaded code raised {type(exc).__name__}: {exc}"

    def run_step(self) -> None:
        self.phase("step")
        _, err = self._body_call(f"step {self.boundary}", lambda: self.body.step(self.boundary))
        if err is None:
            self.steps_done += 1
        else:
            self.step_error = err
        self.boundary += 1
        self.state = JobState.VOTE

    def write_receipt(self, **extra: Any) -> None:
        o = self.outcome
        assert o is not None
        if self.fp_before is not None and self.fp_after is None and self.body is not None:
            # Every job that fingerprinted the base before is checked after,
            # aborted ones too: a change there means the base was damaged.
            self.fp_after, _ = self._body_call("fingerprint after the job", lambda: dict(self.body.fingerprint()))
        self.ctx.log.receipt(
            self.spec.name,
            o.label,
            serial=self.serial,
            kind=self.spec.kind.value,
            msg=self.msg,
            boundary=o.boundary,
            last=self.spec.last_seq,
            reasons=list(o.reasons),
            steps=self.steps_done,
            fingerprint_before=self.fp_before,
            fingerprint_after=self.fp_after,
            shard=self.shard,
            loaded=self.loaded,
            **extra,
        )

    def abandon_group(self, why: str) -> None:
        """The rank lost its group mid-job: a `group_lost` receipt, and the
        body's unpublished state dropped (recovery restarts the group)."""
        self.ctx.log.receipt(
            self.spec.name,
            "group_lost",
            serial=self.serial,
            kind=self.spec.kind.value,
            msg=self.msg,
            boundary=self.boundary,
            last=self.spec.last_seq,
            reasons=[why],
            steps=self.steps_done,
        )
        if self.body is not None:
            self._body_call("discard", self.body.discard)

    def end_body(self) -> None:
        """Discard the body's state unless the job's outcome publishes it."""
        if self.body is not None and not (self.outcome and self.outcome.verdict is Verdict.PUBLISH):
            self._body_call("discard", self.body.discard)


class HeadJob(JobRun):
    """The head's side of one job. The serving loop has already broadcast
    the START op (message `msg`) before the first tick."""

    def __init__(
        self, ctx: RankContext, spec: JobSpec, serial: int, msg: int, body: JobBody, serving: HeadServing
    ) -> None:
        super().__init__(ctx, spec, serial, msg)
        self.body = body
        self.serving = serving
        self.reports: dict[int, Mapping[str, Any]] = {}
        self.deadline = 0.0
        self.proposal: dict[str, Any] | None = None
        self.workers = [r for r in range(ctx.world) if r != ctx.rank]

    def _advance(self) -> Wake:
        ch = self.ctx.channel
        while not self.finished:
            if self.state == JobState.VOTE:
                if self.vote is None:
                    self.vote = self.local_vote()
                self.reports = {}
                self.proposal = None
                self.deadline = self.now() + self.timeouts.exchange
                self.phase("collect")
                self.state = JobState.COLLECT
            elif self.state == JobState.COLLECT:
                for r in self.workers:
                    if r not in self.reports:
                        rec = ch.read(self.serial, self.boundary, REPORT, r)
                        if rec is not None:
                            self.reports[r] = rec.body
                aborting = self.vote["abort"] or any(rep.get("abort") for rep in self.reports.values())
                if not aborting and len(self.reports) < len(self.workers) and self.now() < self.deadline:
                    missing = [
                        ch.key(self.serial, self.boundary, REPORT, r) for r in self.workers if r not in self.reports
                    ]
                    return Wake(self.deadline, tuple(missing))
                self.state = JobState.DECIDE
            elif self.state == JobState.DECIDE:
                if self.proposal is None:
                    self.proposal = self._propose()
                won = ch.claim(Record(self.serial, self.boundary, DECISION, HEAD, self.proposal))
                self.follow(won.body)
                if self.state == JobState.PAUSE:
                    self.state = JobState.PAUSE_SERVE
            elif self.state == JobState.PAUSE_SERVE:
                self.phase("pause")
                self.serving.serve_iteration()
                self.state = JobState.PAUSE_RESUME
            elif self.state == JobState.PAUSE_RESUME:
                self.serving.resume(self.serial, self.boundary)
                self.phase("resume")
                self.state = JobState.PAUSE_FLUSH
            elif self.state == JobState.PAUSE_FLUSH:
                # The step's collectives block until every worker joins, and
                # a worker joins only after decoding RESUME: it must be out.
                self.serving.flush()
                self.state = JobState.STEP
            elif self.state == JobState.STEP:
                self.run_step()
            elif self.state == JobState.FINISH:
                self.end_body()
                self.finished = True
        return Wake(None)

    def _propose(self) -> dict[str, Any]:
        reasons = []
        if self.vote["abort"]:
            reasons.append(self.vote["abort"])
        for r in self.workers:
            rep = self.reports.get(r)
            if rep is None:
                # Before the deadline a missing report is not a reason: the job
                # is aborting for another one already.
                if self.now() >= self.deadline:
                    reasons.append(
                        self.timed_out(f"no report from rank {r} within {self.timeouts.exchange}s", self.deadline)
                    )
            elif rep.get("abort"):
                reasons.append(str(rep["abort"]))
            elif self.boundary == SEAL and rep.get("msg") != self.msg:
                reasons.append(f"rank {r} confirmed serving message {rep.get('msg')}, not the START at {self.msg}")
        kind = boundary_kind(self.spec, self.boundary)
        p: dict[str, Any] = {"by": self.rank}
        if kind is BoundaryKind.LOAD and not reasons:
            digests = {self.rank: self.vote.get("digest"), **{r: self.reports[r].get("digest") for r in self.workers}}
            if len(set(digests.values())) != 1:
                reasons.append(
                    "hot-load refused: staged code differs between ranks: "
                    + ", ".join(f"rank {r}: {str(d)[:16]}" for r, d in sorted(digests.items()))
                )
            else:
                p["digest"] = digests[self.rank]
        if reasons:
            p.update(v=(Verdict.CANCEL if self.boundary == SEAL else Verdict.ABORT).value, why=reasons)
        elif kind is BoundaryKind.SEAL:
            p["v"] = Verdict.GO.value
        elif kind is BoundaryKind.STEP:
            p["v"] = (Verdict.PAUSE if self.serving.has_chats() else Verdict.TRAIN).value
        elif kind is BoundaryKind.VERIFY:
            p["v"] = Verdict.SAVE.value
        elif kind is BoundaryKind.COMMIT:
            p["v"] = Verdict.PUBLISH.value
            p["shards"] = {
                str(self.rank): self.vote.get("shard"),
                **{str(r): self.reports[r].get("shard") for r in self.workers},
            }
        elif kind is BoundaryKind.LOAD:
            p["v"] = Verdict.LOAD.value
        else:
            p["v"] = Verdict.DONE.value
        return p


class WorkerJob(JobRun):
    """A worker's side of one job, created when it decodes the START op."""

    def __init__(
        self,
        ctx: RankContext,
        spec: JobSpec,
        serial: int,
        msg: int,
        tag: str,
        body_factory: BodyFactory,
        serving: WorkerServing,
    ) -> None:
        super().__init__(ctx, spec, serial, msg)
        self.tag = tag
        self.body_factory = body_factory
        self.serving = serving
        self.deadline = 0.0
        self.written: list[tuple[int, str, int]] = []  # (seq, name, rank) of every key this rank wrote
        self.marker: ClosedMarker | None = None

    def seal_vote(self) -> str | None:
        cfg = self.ctx.config
        if not tag_ok(
            cfg.authority,
            self.tag,
            self.ctx.group,
            self.serial,
            self.spec.name,
            self.spec.kind.value,
            self.spec.steps,
            self.spec.root,
            ",".join(self.spec.modules),
        ):
            return f"rank {self.rank}: the START's authority tag does not match this rank's authority"
        if self.spec.kind is JobKind.HOTLOAD and not cfg.hotload:
            return f"rank {self.rank}: hot-load is disabled on this rank"
        body, err = self._body_call("creating the job body", lambda: self.body_factory(self.spec, self.ctx))
        self.body = body
        return err

    def _note(self, seq: int, name: str, rank: int) -> None:
        if (seq, name, rank) not in self.written:
            self.written.append((seq, name, rank))

    def _closed(self) -> bool:
        """After a write: if the head already closed this job, its purge may
        have run before the write landed, so take back what this rank wrote."""
        ch = self.ctx.channel
        marker = ch.closed_marker()
        if marker.job < self.serial:
            return False
        for seq, name, rank in self.written:
            ch.delete(self.serial, seq, name, rank)
        self.written.clear()
        self.marker = marker
        return True

    def _abandon(self) -> None:
        """The head closed the job before this rank saw its final decision
        (this rank was stalled past the head's ack wait): adopt the outcome
        the head recorded in the `closed` marker."""
        why = f"rank {self.rank}: job closed by the head before this rank saw its decision"
        got = self.marker.outcomes.get(self.serial) if self.marker is not None else None
        if got is None:
            self.phase("abandoned")
            self.outcome = Outcome(None, self.boundary, (why,))
        else:
            verdict, boundary = got
            self.phase("adopted", v=verdict, final=boundary)
            self.outcome = Outcome(Verdict(verdict) if verdict != "abandoned" else None, boundary, (why,))
        self.state = JobState.FINISH_LOCAL

    def _advance(self) -> Wake:
        ch = self.ctx.channel
        while not self.finished:
            if self.state == JobState.VOTE:
                if self.vote is None:
                    self.vote = self.local_vote()
                # Noted before writing: a write that fails after landing must
                # still be taken back if the job turns out closed.
                self._note(self.boundary, REPORT, self.rank)
                ch.post(Record(self.serial, self.boundary, REPORT, self.rank, self.vote))
                self.phase("reported", abort=self.vote["abort"])
                if self._closed():
                    self._abandon()
                    continue
                self.deadline = self.now() + self.timeouts.decision
                self.state = JobState.WAIT
            elif self.state == JobState.WAIT:
                rec = ch.read(self.serial, self.boundary, DECISION, HEAD)
                if rec is None:
                    # A decision missing from a closed job was purged: this
                    # rank fell behind the head's ack wait. Noticing now, not at
                    # the deadline, keeps the serving ops queued behind it moving.
                    if self._closed():
                        self._abandon()
                        continue
                    if self.now() < self.deadline:
                        return Wake(self.deadline, (ch.key(self.serial, self.boundary, DECISION, HEAD),))
                    why = self.timed_out(f"no decision within {self.timeouts.decision}s", self.deadline)
                    verdict = Verdict.CANCEL if self.boundary == SEAL else Verdict.ABORT
                    self._note(self.boundary, DECISION, HEAD)
                    rec = ch.claim(
                        Record(
                            self.serial,
                            self.boundary,
                            DECISION,
                            HEAD,
                            {"v": verdict.value, "by": self.rank, "why": [why]},
                        )
                    )
                if rec.body.get("by") == self.rank:
                    # This rank's own claim won (possibly on an earlier try).
                    self._note(self.boundary, DECISION, HEAD)
                    if self._closed():
                        self._abandon()
                        continue
                self.follow(rec.body)
            elif self.state == JobState.PAUSE:
                self.deadline = self.now() + self.timeouts.pause
                self.phase("pause")
                self.state = JobState.PAUSED
            elif self.state == JobState.PAUSED:
                try:
                    op = self.serving.read_op()
                except LinkClosed as exc:
                    raise GroupLost(f"rank {self.rank}: serving link closed during a pause: {exc}") from exc
                if op is None:
                    if self.now() < self.deadline:
                        return Wake(self.deadline, self.serving.op_wait_keys())
                    # The head sends RESUME right after one iteration; silence
                    # this long means it is gone, and leaving the pause alone
                    # would desynchronise the group.
                    raise GroupLost(
                        self.timed_out(f"no serving op within {self.timeouts.pause}s of a pause", self.deadline)
                    )
                if op.kind is OpKind.SERVE:
                    self.serving.execute(op)
                    self.deadline = self.now() + self.timeouts.pause
                elif op.kind is OpKind.RESUME and op.job == self.serial and op.boundary == self.boundary:
                    self.phase("resume")
                    self.state = JobState.STEP
                else:
                    raise GroupLost(
                        f"rank {self.rank}: unexpected {op.kind.value} op (message {op.msg}) inside the pause of boundary {self.boundary}"
                    )
            elif self.state == JobState.STEP:
                self.run_step()
            elif self.state == JobState.FINISH:
                self._note(self.boundary, ACK, self.rank)
                ch.post(Record(self.serial, self.boundary, ACK, self.rank, {"v": self.outcome.label}))
                self._closed()
                self.state = JobState.FINISH_LOCAL
            elif self.state == JobState.FINISH_LOCAL:
                if self.outcome.verdict is not None:
                    self.end_body()
                self.finished = True
        return Wake(None)
