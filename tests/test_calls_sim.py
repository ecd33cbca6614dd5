"""The ordered-call protocol (the vLLM mapping) under the seeded fault
simulation: the production CallJob driver against fake ranks that run every
call in order, with injected faults (resident_trainer.testing.calls)."""

import pytest

from resident_trainer.protocol.calls import Call, CallJob, drive
from resident_trainer.protocol.checkpoint import CheckpointStore
from resident_trainer.protocol.fs import MemoryFileSystem
from resident_trainer.protocol.job import JobSpec, Verdict
from resident_trainer.protocol.records import RecordLog
from resident_trainer.testing import calls as sim

SEEDS = 4000


def test_sweep_finds_no_violation_and_reaches_every_fault():
    bad = [(s, v) for s in range(SEEDS) if (v := sim.run_seed(s))]
    assert not bad, f"{len(bad)} failing seeds; first: seed {bad[0][0]}: {bad[0][1][:3]}"
    cov = sim.coverage(range(1000))
    missing = [k for k in (*sim.CALL_FAULTS, "recovery:restarted", "recovery:none") if cov.get(k, 0) == 0]
    assert not missing, cov


@pytest.mark.parametrize("variant", sorted(sim.VARIANTS))
def test_the_checker_catches_each_broken_driver(variant):
    caught = [s for s in range(400) if sim.run_seed(s, variant)]
    assert caught, f"no seed caught the {variant} driver"
    # A failing seed replays exactly.
    assert sim.run_seed(caught[0], variant) == sim.run_seed(caught[0], variant)
    assert not sim.run_seed(caught[0])


class _Clock:
    def now(self):
        return 0.0


def _job(fs, **kw):
    spec = JobSpec("j", steps=kw.pop("steps", 2), root="/j", authority=kw.pop("authority", "key"))
    log = RecordLog(fs, "/r", rank=0, group="d", clock=_Clock())
    return CallJob(spec, {"facts": []}, world=2, authority="key", fs=fs, clock=_Clock(), log=log,
                   checkpoints=CheckpointStore(fs, "/c"), group="g", serial=1, version="v1", **kw)  # fmt: skip


def test_a_healthy_job_makes_exactly_these_calls():
    fs = MemoryFileSystem()
    made = []

    def call(c: Call):
        made.append(c.method)
        extra = {"rt_begin": {"fingerprint": "f"}, "rt_verify": {"fingerprint": "f"}, "rt_step": {"loss": 0.5},
                 "rt_checkpoint": {"shard": "s"}}.get(c.method, {})  # fmt: skip
        return [{"rank": r, "error": None, **extra} for r in range(2)]

    out = drive(_job(fs), call)
    assert out.verdict is Verdict.PUBLISH
    assert made == ["rt_begin", "rt_step", "rt_step", "rt_verify", "rt_checkpoint", "rt_publish"]
    m = CheckpointStore(fs, "/c").last_good()
    assert (m.name, m.shards, m.meta["version"]) == ("j", {0: "s", 1: "s"}, "v1")


def test_one_ranks_error_aborts_every_rank_at_the_next_boundary():
    fs = MemoryFileSystem()
    made = []

    def call(c: Call):
        made.append(c.method)
        res = [{"rank": r, "error": None, "fingerprint": "f", "loss": 1.0} for r in range(2)]
        if c.method == "rt_step" and c.args == (0,):
            res[1]["error"] = "rank 1: RuntimeError: gloo timed out"
        return res

    job = _job(fs, steps=3)
    out = drive(job, call)
    assert (out.verdict, out.boundary) == (Verdict.ABORT, 1)
    assert made == ["rt_begin", "rt_step", "rt_discard"]
    assert out.reasons == ("rank 1: RuntimeError: gloo timed out",)
    assert CheckpointStore(fs, "/c").last_good() is None


def test_no_call_without_the_authority():
    made = []
    out = drive(_job(MemoryFileSystem(), authority="guess"), lambda c: made.append(c) or [])
    assert out.verdict is Verdict.CANCEL and made == []


def test_the_receipt_records_the_fingerprint_version_and_ranks_must_agree_on_it():
    from resident_trainer.protocol.records import read_jsonl

    def engine(versions):
        def call(c: Call):
            extra = {"rt_begin": {"fingerprint": "f"}, "rt_verify": {"fingerprint": "f"}, "rt_step": {"loss": 0.5},
                     "rt_checkpoint": {"shard": "s"}}.get(c.method, {})  # fmt: skip
            out = [{"rank": r, "error": None, **extra} for r in range(2)]
            if c.method == "rt_begin":
                for r, v in zip(out, versions):
                    r["fingerprint_version"] = v
                    r["fact_neurons"], r["fact_neurons_wanted"] = 3, 9
            return out

        return call

    fs = MemoryFileSystem()
    job = _job(fs)
    assert drive(job, engine([2, 2])).verdict is Verdict.PUBLISH
    assert job.progress.fingerprint_version == 2
    # What each new fact got, for the job's status (fewer than wanted: the block is filling up).
    assert (job.progress.fact_neurons, job.progress.fact_neurons_wanted) == (3, 9)
    (receipt,) = read_jsonl(fs, "/r/rank0/receipts.jsonl")
    assert (receipt["fingerprint_before"], receipt["fingerprint_version"]) == ("f", 2)
    out = drive(_job(MemoryFileSystem()), engine([2, 1]))
    assert out.verdict is Verdict.CANCEL
    assert out.reasons == ("the ranks compute different fingerprint versions: ['1', '2']",)
