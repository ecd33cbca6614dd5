"""A job as a sequence of ordered collective calls: the protocol for engines
that deliver one call to every rank, in order with their serving steps, and
return one result per rank (vLLM's ``collective_rpc``).

Such an engine already keeps two of the invariants by its ordering:

- a job starts on every rank or on none: ``begin`` reaches every rank between
  the same two serving steps, or the engine is down;
- the served block changes on every rank at once: ``publish`` runs on every
  rank between the same two serving steps.

The rest is this driver's: it sees every rank's result of a call before it
makes the next one, so it decides for all of them at each boundary.

| boundary | call | a rank's result counts against the job when |
|---|---|---|
| -1 (seal) | ``rt_begin(payload)`` | it has an error, or the ranks' base fingerprints differ |
| 0 .. n-1 | ``rt_step(b)`` (after the checks) | it has an error (NaN loss, a failed collective), a budget breach |
| n (verify) | ``rt_verify()`` | it has an error, its fingerprint differs from before the job, or its own tensors changed (``local``; then the engine restarts too) |
| n+1 (commit) | ``rt_checkpoint(root, group, serial)`` | it has an error (its shard was not written) |
| - | ``rt_publish(version)`` | (after LAST_GOOD names the job; a failure here needs a restart) |

Before each step the driver also checks the STOP file in the job's root, a
cancel request and the job's time budget. Whatever the reason and whichever
rank had it, every rank gets the same ``rt_discard()`` at that boundary, and
the job ends there: nothing publishes, LAST_GOOD is untouched. Chats are
served between any two calls (the engine runs its serving steps in between).

`CallJob.run()` is a generator: it yields each `Call` and is sent back the
list of per-rank results, so an asyncio server, a blocking test and the
seeded simulation (resident_trainer.testing.calls) all drive the same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from resident_trainer.protocol.authority import authority_ok
from resident_trainer.protocol.checkpoint import CheckpointStore
from resident_trainer.protocol.clock import Clock
from resident_trainer.protocol.errors import ProtocolError
from resident_trainer.protocol.fs import FileSystem
from resident_trainer.protocol.job import SEAL, JobKind, JobSpec, Outcome, Verdict
from resident_trainer.protocol.records import RecordLog


@dataclass(frozen=True)
class Call:
    """One collective call: `method` with `args` on every rank."""

    method: str
    args: tuple = ()


class EngineLost(ProtocolError):
    """The engine failed mid-call (a rank died, the call timed out): its
    ranks may disagree now, so only a restart from LAST_GOOD is safe."""


Results = Sequence[Mapping[str, Any]]


@dataclass
class Progress:
    """What a job has done so far, for status queries."""

    phase: str = "queued"
    boundary: int = SEAL
    step: int = 0
    loss: float | None = None
    fingerprint_before: str | None = None
    fingerprint_after: str | None = None
    fingerprint_version: int | None = None  # the definition the ranks' digests are of
    # The neurons each of the job's new facts got, and what it would have got
    # with the block's neurons free (fewer: the block is filling up).
    fact_neurons: int | None = None
    fact_neurons_wanted: int | None = None
    reasons: list[str] = field(default_factory=list)


def _rank_errors(results: Results, what: str) -> list[str]:
    out = []
    for i, r in enumerate(results):
        err = r.get("error")
        if err:
            out.append(str(err) if str(err).startswith("rank ") else f"rank {r.get('rank', i)}: {what}: {err}")
    return out


class CallJob:
    """One training job on `world` ranks, decided at every boundary from
    every rank's result (module docstring has the table).

    spec: the job (its root holds the STOP file; its authority must match);
    payload: what ``rt_begin`` gets (facts, anchors, training settings);
    checkpoints/group/serial: where shards and LAST_GOOD go; version: the
    name the published block is served under; cancelled(): a cancel request;
    deadline: seconds the job may run (None: no limit)."""

    def __init__(
        self,
        spec: JobSpec,
        payload: Mapping[str, Any],
        *,
        world: int,
        authority: str,
        fs: FileSystem,
        clock: Clock,
        log: RecordLog,
        checkpoints: CheckpointStore,
        group: str,
        serial: int,
        version: str,
        cancelled: Callable[[], bool] = lambda: False,
        deadline: float | None = None,
    ) -> None:
        if spec.kind is not JobKind.TRAIN:
            raise ValueError(f"a call job trains; got a {spec.kind.value} job")
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be a positive int, got {world!r}")
        self.spec, self.payload, self.world = spec, dict(payload), world
        self.authority = authority
        self.fs, self.clock, self.log = fs, clock, log
        self.checkpoints, self.group, self.serial, self.version = checkpoints, group, serial, version
        self.cancelled = cancelled
        self.deadline = deadline
        self.progress = Progress()
        self.outcome: Outcome | None = None
        self.started_at: float | None = None
        self.shards: dict[int, str] = {}
        # Set when the served base is damaged (its fingerprint changed, or the
        # ranks disagree): serving it on is wrong, the engine must restart
        # (reloading the base from its files) once the job has ended.
        self.needs_restart = False

    # --- helpers ------------------------------------------------------------------

    def _phase(self, name: str, **fields: Any) -> None:
        self.progress.phase = name
        self.log.phase(self.spec.name, name, serial=self.serial, b=self.progress.boundary, **fields)

    def _checked(self, results: Results, method: str) -> Results:
        if len(results) != self.world:
            raise EngineLost(f"{method}: {len(results)} results from {self.world} ranks")
        return results

    def _local_reasons(self) -> list[str]:
        """What the driver itself sees at a boundary."""
        out = []
        if self.fs.exists(self.spec.stop_path):
            out.append(f"STOP file {self.spec.stop_path}")
        if self.cancelled():
            out.append("cancelled by request")
        if self.deadline is not None and self.started_at is not None:
            took = self.clock.now() - self.started_at
            if took > self.deadline:
                out.append(f"the job ran {took:.1f}s, past its {self.deadline:.1f}s budget")
        return out

    def _step_reasons(self, results: Results) -> list[str]:
        out = _rank_errors(results, "step")
        for i, r in enumerate(results):
            if r.get("budget"):
                out.append(str(r["budget"]))
            loss = r.get("loss")
            if loss is not None and not math.isfinite(float(loss)):
                out.append(f"rank {r.get('rank', i)}: loss {loss}")
        return out

    def _end(self, verdict: Verdict, reasons: Sequence[str]) -> Outcome:
        self.outcome = Outcome(verdict, self.progress.boundary, tuple(reasons))
        self.progress.reasons = list(reasons)
        self.progress.phase = verdict.value
        p = self.progress
        self.log.receipt(
            self.spec.name,
            self.outcome.label,
            serial=self.serial,
            kind=self.spec.kind.value,
            boundary=p.boundary,
            last=self.spec.last_seq,
            reasons=list(reasons),
            steps=p.step,
            fingerprint_before=p.fingerprint_before,
            fingerprint_after=p.fingerprint_after,
            fingerprint_version=p.fingerprint_version,
            shards={str(r): d for r, d in sorted(self.shards.items())},
            version=self.version if verdict is Verdict.PUBLISH else None,
        )
        return self.outcome

    def _abort(self, verdict: Verdict, reasons: Sequence[str]) -> Generator[Call, Results, Outcome]:
        """Every rank drops the job at this boundary, whoever had the reason."""
        self._phase("discard", why=list(reasons)[:4])
        results = self._checked((yield Call("rt_discard")), "rt_discard")
        extra = _rank_errors(results, "discard")
        return self._end(verdict, list(reasons) + extra)

    # --- the job ------------------------------------------------------------------

    def run(self) -> Generator[Call, Results, Outcome]:
        """Yield the calls of the job; return its Outcome. An `EngineLost`
        thrown in (or raised here) ends the job without a receipt of its
        own: the supervisor's restart serves LAST_GOOD."""
        p = self.progress
        if not authority_ok(self.authority, self.spec.authority):
            p.phase = "refused"
            return self._end(Verdict.CANCEL, ["the job does not carry the configured authority"])
        self.started_at = self.clock.now()
        self._phase("begin")
        results = self._checked((yield Call("rt_begin", (dict(self.payload),))), "rt_begin")
        reasons = _rank_errors(results, "begin")
        prints = {r.get("fingerprint") for r in results}
        if not reasons and len(prints) != 1:
            reasons.append(f"the ranks' base fingerprints differ: {sorted(str(x) for x in prints)}")
            self.needs_restart = True
        versions = {r.get("fingerprint_version") for r in results}
        if not reasons and len(versions) != 1:
            reasons.append(f"the ranks compute different fingerprint versions: {sorted(str(x) for x in versions)}")
        if not reasons:
            p.fingerprint_before = next(iter(prints))
            p.fingerprint_version = next(iter(versions))
            p.fact_neurons = results[0].get("fact_neurons")
            p.fact_neurons_wanted = results[0].get("fact_neurons_wanted")
        reasons += self._local_reasons()
        if reasons:
            return (yield from self._abort(Verdict.CANCEL, reasons))
        for b in range(self.spec.steps):
            p.boundary = b
            reasons = self._local_reasons()
            if reasons:
                return (yield from self._abort(Verdict.ABORT, reasons))
            self._phase("step")
            results = self._checked((yield Call("rt_step", (b,))), "rt_step")
            reasons = self._step_reasons(results)
            if reasons:
                p.boundary = b + 1
                return (yield from self._abort(Verdict.ABORT, reasons))
            p.step = b + 1
            losses = [float(r["loss"]) for r in results if r.get("loss") is not None]
            p.loss = losses[0] if losses else None
        p.boundary = self.spec.steps
        reasons = self._local_reasons()
        if not reasons:
            self._phase("verify")
            results = self._checked((yield Call("rt_verify")), "rt_verify")
            reasons = _rank_errors(results, "verify")
            prints = {r.get("fingerprint") for r in results}
            p.fingerprint_after = sorted(str(x) for x in prints)[0] if prints else None
            # Each rank also checks its own copies (replicated tensors count
            # once in the combined digest, every copy here).
            local = [f"rank {r.get('rank', i)}: {m}" for i, r in enumerate(results) for m in (r.get("local") or ())]
            if local:
                self.needs_restart = True
                reasons += local
            if not reasons and prints != {p.fingerprint_before}:
                self.needs_restart = True
                reasons.append(
                    f"the frozen base changed during the job: {p.fingerprint_before} before, {sorted(map(str, prints))} after"
                )
        if reasons:
            return (yield from self._abort(Verdict.ABORT, reasons))
        p.boundary = self.spec.steps + 1
        self._phase("commit")
        results = self._checked(
            (yield Call("rt_checkpoint", (self.checkpoints.root, self.group, self.serial))), "rt_checkpoint"
        )
        reasons = _rank_errors(results, "checkpoint")
        self.shards = {int(r.get("rank", i)): str(r.get("shard")) for i, r in enumerate(results)}
        if not reasons and (len(self.shards) != self.world or any(d in ("", "None") for d in self.shards.values())):
            reasons.append(f"missing checkpoint shards: {self.shards}")
        if reasons:
            return (yield from self._abort(Verdict.ABORT, reasons))
        self.checkpoints.commit(
            self.group, self.serial, self.spec.name, self.shards, version=self.version, fingerprint=p.fingerprint_before
        )
        self._phase("publish", version=self.version)
        results = self._checked((yield Call("rt_publish", (self.version,))), "rt_publish")
        reasons = _rank_errors(results, "publish")
        if reasons:
            # LAST_GOOD names this job already; a rank that did not swap must
            # be restarted, and a restart serves LAST_GOOD on every rank.
            raise EngineLost("publish failed on some rank after LAST_GOOD was written: " + "; ".join(reasons))
        return self._end(Verdict.PUBLISH, [])


def drive(job: CallJob, call: Callable[[Call], Results]) -> Outcome:
    """Run `job` to its end with a blocking `call` (one result per rank);
    an exception from `call` is the engine's failure (EngineLost)."""
    gen = job.run()
    try:
        c = next(gen)
        while True:
            try:
                results = call(c)
            except EngineLost:
                raise
            except Exception as exc:
                raise EngineLost(f"{c.method}: {type(exc).__name__}: {exc}") from exc
            c = gen.send(results)
    except StopIteration as stop:
        return stop.value
