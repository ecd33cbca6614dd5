"""The production worker loop with the simulation's "never joins" fault,
and deliberately broken variants of the machines: the checker must catch
each one (tests/test_protocol_sim.py runs them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from resident_trainer.protocol.job import HeadJob, JobState, Outcome, Verdict, WorkerJob
from resident_trainer.protocol.server import HeadServer, WorkerServer
from resident_trainer.protocol.serving import OpKind, ServingOp

if TYPE_CHECKING:
    from resident_trainer.testing.simulation import Simulation


class _SelfishJob(WorkerJob):
    """BROKEN: pauses or trains by its own view of the serving stream (did
    the last op it decoded leave chats live?), not by the head's decision."""

    def follow(self, d):
        if d.get("v") in (Verdict.TRAIN.value, Verdict.PAUSE.value):
            own = Verdict.TRAIN if self.serving.need_ring else Verdict.PAUSE
            d = {**d, "v": own.value}
        super().follow(d)


class _LoneAbortJob(WorkerJob):
    """BROKEN: aborts by itself as soon as it sees a budget breach, instead
    of reporting it at the next boundary and following the head."""

    def _advance(self):
        if self.state is JobState.WAIT and self.boundary >= 0 and self.ctx.budget.breach():
            self.outcome = Outcome(Verdict.ABORT, self.boundary, (f"rank {self.rank}: aborted alone",))
            self.state = JobState.FINISH
        return super()._advance()


class _DeafHeadJob(HeadJob):
    """BROKEN: ignores the workers' abort votes at step boundaries."""

    def _propose(self):
        if not 0 <= self.boundary < self.spec.steps:
            return super()._propose()
        kept = self.reports
        self.reports = {r: {**rep, "abort": None} for r, rep in kept.items()}
        try:
            return super()._propose()
        finally:
            self.reports = kept


class SimWorker(WorkerServer):
    """The production worker loop, plus the 'never joins' fault: a worker
    whose trainer side ignores one START op."""

    def __init__(self, sim: Simulation, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.sim = sim

    def _handle(self, op: ServingOp) -> None:
        nj = self.sim.sc.never_join
        if (
            op.kind is OpKind.START
            and nj
            and nj[0] == self.ctx.rank
            and self.sim.job_index(op.data.get("name")) == nj[1]
        ):
            self.ctx.log.phase(op.data.get("name"), "ignored_start", serial=op.job, msg=op.msg)
            return
        super()._handle(op)


class _SelfishWorker(SimWorker):
    job_class = _SelfishJob


class _LoneAbortWorker(SimWorker):
    job_class = _LoneAbortJob


class _StallingWorker(SimWorker):
    """BROKEN: always waits for the doorbell after a job, even when the
    job's last RESUME left chats live."""

    def after_job(self, job):
        super().after_job(job)
        self.need_ring = True


class _DeafHead(HeadServer):
    job_class = _DeafHeadJob


class DeafHead(HeadServer):
    job_class = _DeafHeadJob


#: The broken variants' worker loops, by name (the deaf head is a head).
BROKEN_WORKERS = {"selfish_pause": _SelfishWorker, "doorbell_stall": _StallingWorker, "lone_abort": _LoneAbortWorker}
