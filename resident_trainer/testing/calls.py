"""Seeded simulation of jobs driven through ordered collective calls (the
vLLM mapping, resident_trainer.protocol.calls), with injected faults.

The engine delivers every call to every rank in order, as vLLM's
collective_rpc does, and each fake rank keeps what serving would see (its
served version), whether it has a job open, its frozen base (a string that a
fault can change), and a log of every call it ran. Faults, all chosen up front
from the seed: a rank's error in begin, a step, verify or checkpoint; a NaN
loss or a budget breach on one rank at one step; the base changed on one
rank; a STOP file or a cancel request at a boundary; a job without the
authority; the engine dying at its k-th call (a worker's death takes vLLM
down), after which a supervisor restarts it under the fenced lock and the new
engine serves LAST_GOOD; a publish that fails on one rank.

`check()` then verifies, from the ranks' logs and the files:

- every rank of a generation ran the same calls, and saw the served version
  change at the same publish call, to the same version;
- a job ends at the first boundary where any rank (or the driver) had a
  reason, every rank was told to discard it there, no step ran after it, and
  no rank is left with a job open;
- a published job had no fault, the base unchanged, and LAST_GOOD names it;
  LAST_GOOD only ever names a job whose every shard was written and verifies;
- after every restart each rank serves LAST_GOOD's version;
- a job without the authority made no call at all.

``python -m resident_trainer.testing.calls --seeds N`` sweeps; a failing seed
replays with ``--seed S``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import dataclass, field
from typing import Any

from resident_trainer.protocol.calls import Call, CallJob, EngineLost, drive
from resident_trainer.protocol.checkpoint import CheckpointStore, CorruptCheckpoint
from resident_trainer.protocol.fs import MemoryFileSystem
from resident_trainer.protocol.job import JobSpec, Verdict
from resident_trainer.protocol.lock import FencedLock
from resident_trainer.protocol.records import RecordLog, read_jsonl
from resident_trainer.protocol.recovery import GroupState, Recovery

AUTHORITY = "calls-sim-authority"
CALL_FAULTS = ("begin_error", "step_error", "nan", "budget", "corrupt", "verify_error", "ckpt_error", "stop", "cancel",
               "unauthorised", "engine_death", "publish_error")  # fmt: skip


# --- deliberately broken drivers: the checker must catch each --------------------------


class _IgnoresBudget(CallJob):
    """BROKEN: trains on through a rank's budget breach."""

    def _step_reasons(self, results):
        return [r for r in super()._step_reasons(results) if "workspace" not in r]


class _TrustsVerify(CallJob):
    """BROKEN: publishes whatever the ranks' fingerprints say after the job."""

    def run(self):
        gen = super().run()
        results = None
        try:
            call = next(gen)
            while True:
                results = yield call
                if call.method == "rt_verify":
                    results = [{**r, "fingerprint": self.progress.fingerprint_before} for r in results]
                call = gen.send(results)
        except StopIteration as stop:
            return stop.value


class _DiscardsAlone(CallJob):
    """BROKEN: on an abort, ends the job without telling the ranks."""

    def _abort(self, verdict, reasons):
        return self._end(verdict, list(reasons))
        yield  # a generator, like the method it replaces


VARIANTS = {"ignores_budget": _IgnoresBudget, "trusts_verify": _TrustsVerify, "discards_alone": _DiscardsAlone}


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


@dataclass
class CallScenario:
    seed: int
    world: int
    jobs: list[dict] = field(default_factory=list)
    death_at: int | None = None  # the engine dies at its k-th call (counted over the run)

    @classmethod
    def generate(cls, seed: int) -> CallScenario:
        rng = random.Random(seed * 104729 + 3)
        sc = cls(seed, rng.choice((1, 2, 2, 3, 4)))
        for j in range(rng.choice((1, 2, 3))):
            steps = rng.randint(1, 5)
            job: dict[str, Any] = {"name": f"job{j}", "steps": steps, "fault": None}
            if rng.random() < 0.7:
                kind = rng.choice(CALL_FAULTS)
                fault: dict[str, Any] = {"kind": kind, "rank": rng.randrange(sc.world), "b": rng.randrange(steps)}
                if kind == "engine_death":
                    fault = None
                    sc.death_at = rng.randint(1, 3 + 2 * steps)
                job["fault"] = fault
            sc.jobs.append(job)
        return sc


class _Rank:
    def __init__(self, rank: int, served: str) -> None:
        self.rank = rank
        self.served = served
        self.base = "base"
        self.open: str | None = None
        self.calls: list[tuple[int, str, tuple]] = []  # (call index, method, args)
        self.publishes: list[tuple[int, str]] = []
        self.trained = ""


class _Engine:
    """One generation: `world` ranks that run every call in order."""

    def __init__(self, sim: CallSimulation, number: int) -> None:
        self.sim, self.number = sim, number
        version = "zero"
        m = sim.store.last_good()
        if m is not None:
            try:
                for r in range(sim.sc.world):
                    sim.store.load(r)
                version = str(m.meta.get("version"))
            except CorruptCheckpoint as exc:
                sim.violations.append(f"generation {number}: LAST_GOOD does not verify at restart: {exc}")
        self.ranks = [_Rank(r, version) for r in range(sim.sc.world)]
        self.alive = True
        self.started_version = version

    def call(self, c: Call) -> list[dict]:
        sim = self.sim
        if not self.alive:
            raise EngineLost("the engine is down")
        sim.ncalls += 1
        sim.clock.t += 0.1
        if sim.sc.death_at is not None and sim.ncalls == sim.sc.death_at:
            self.alive = False
            sim.fired.append((sim.job_name, "engine_death", sim.boundary))
            raise EngineLost("a worker died; vLLM went down with it")
        f = sim.fault
        if f is not None and f["kind"] == "stop":
            # The STOP file appears while the call before boundary b runs.
            before_b = (c.method == "rt_begin" and f["b"] == 0) or (c.method == "rt_step" and c.args[0] == f["b"] - 1)
            if before_b:
                self.sim.fs.files[self.sim.stop_path] = b""
                sim.fired.append((sim.job_name, "stop", f["b"]))
        return [self._run(r, c) for r in self.ranks]

    def _fault(self, kind: str, rank: int, b: int | None = None) -> bool:
        f = self.sim.fault
        if f is None or f["kind"] != kind or f["rank"] != rank or (b is not None and f["b"] != b):
            return False
        self.sim.fired.append((self.sim.job_name, kind, self.sim.boundary))
        return True

    def _run(self, r: _Rank, c: Call) -> dict:
        sim = self.sim
        r.calls.append((sim.ncalls, c.method, c.args))
        out: dict[str, Any] = {"rank": r.rank, "error": None}
        m = c.method
        if m == "rt_begin":
            if r.open is not None:
                out["error"] = f"rank {r.rank}: a job is still open"
            elif self._fault("begin_error", r.rank):
                out["error"] = f"rank {r.rank}: begin failed"
            else:
                r.open = sim.job_name
                out["fingerprint"] = r.base
        elif m == "rt_step":
            (b,) = c.args
            if r.open is None:
                out["error"] = f"rank {r.rank}: no job open"
            elif self._fault("step_error", r.rank, b):
                out["error"] = f"rank {r.rank}: step {b} failed"
            else:
                out["loss"] = float("nan") if self._fault("nan", r.rank, b) else 1.0 / (b + 1)
                out["budget"] = (
                    f"rank {r.rank}: workspace over the ceiling" if self._fault("budget", r.rank, b) else None
                )
                if self._fault("corrupt", r.rank, b):
                    r.base += "!"
                r.trained = hashlib.sha256(f"{r.trained}|{sim.job_name}|{b}".encode()).hexdigest()[:12]
        elif m == "rt_verify":
            out["fingerprint"] = r.base
            if self._fault("verify_error", r.rank):
                out["error"] = f"rank {r.rank}: verify failed"
        elif m == "rt_checkpoint":
            root, group, serial = c.args
            if self._fault("ckpt_error", r.rank):
                out["error"] = f"rank {r.rank}: shard write failed"
            else:
                out["shard"] = sim.store.write_shard(group, serial, r.rank, f"{sim.job_name}:{r.trained}".encode())
        elif m == "rt_publish":
            (version,) = c.args
            if self._fault("publish_error", r.rank):
                out["error"] = f"rank {r.rank}: gather failed"
            else:
                r.served = version
                r.publishes.append((sim.ncalls, version))
            r.open = None
        elif m == "rt_discard":
            r.open = None
        else:
            out["error"] = f"unknown method {m}"
        return out


class CallSimulation:
    def __init__(self, seed: int, variant: str | None = None) -> None:
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"variant must be one of {sorted(VARIANTS)} or None, got {variant!r}")
        self.job_class = VARIANTS.get(variant or "", CallJob)
        self.sc = CallScenario.generate(seed)
        self.fs = MemoryFileSystem()
        self.clock = _Clock()
        self.store = CheckpointStore(self.fs, "/ckpt")
        self.log = RecordLog(self.fs, "/receipts", rank=0, group="driver", clock=self.clock)
        self.lock = FencedLock(self.fs, "/state", self.clock, lease_seconds=5.0)
        self.engines: list[_Engine] = []
        self.ncalls = 0
        self.fired: list[tuple[str, str, int]] = []
        self.violations: list[str] = []
        self.outcomes: dict[str, Any] = {}
        self.fault: dict | None = None
        self.job_name = ""
        self.boundary = -1
        self.restarts: list[dict] = []
        self.stop_path = ""

    # --- the supervisor --------------------------------------------------------------

    def _recover(self) -> None:
        sim = self

        class Control:
            def healthy(self, state: GroupState) -> bool:
                return bool(sim.engines) and sim.engines[-1].alive

            def stop(self, state: GroupState) -> None:
                if sim.engines:
                    sim.engines[-1].alive = False

            def start(self, generation: int, token: int) -> tuple[int, tuple[int, ...]]:
                sim.engines.append(_Engine(sim, generation))
                return 0, tuple(range(sim.sc.world))

        res = Recovery(self.lock, Control(), owner="supervisor").run()
        m = self.store.last_good()
        self.restarts.append({"action": res.action, "served": [r.served for r in self.engines[-1].ranks],
                              "last_good": None if m is None else m.meta.get("version")})  # fmt: skip

    # --- the run -------------------------------------------------------------------------

    def run(self) -> None:
        self._recover()
        for serial, j in enumerate(self.sc.jobs, start=1):
            self.fault, self.job_name, self.boundary = j["fault"], j["name"], -1
            f = j["fault"] or {}
            auth = "wrong" if f.get("kind") == "unauthorised" else AUTHORITY
            spec = JobSpec(j["name"], steps=j["steps"], root=f"/jobs/{j['name']}", authority=auth)
            engine = self.engines[-1]
            before = self.ncalls

            job = self.job_class(spec, {"facts": []}, world=self.sc.world, authority=AUTHORITY, fs=self.fs, clock=self.clock,
                          log=self.log, checkpoints=self.store, group=f"g{engine.number}", serial=serial,
                          version=f"{j['name']}-v")  # fmt: skip

            def cancelled(job=job, f=f) -> bool:
                if f.get("kind") == "cancel" and job.progress.boundary == f["b"]:
                    self.fired.append((self.job_name, "cancel", f["b"]))
                    return True
                return False

            job.cancelled = cancelled

            def call(c: Call, job=job) -> list[dict]:
                self.boundary = job.progress.boundary
                return self.engines[-1].call(c)

            self.stop_path = spec.stop_path
            try:
                outcome = drive(job, call)
                self.outcomes[j["name"]] = (outcome.verdict, outcome.boundary, job, (before, self.ncalls))
                if job.needs_restart:  # a damaged base is never served on
                    self.engines[-1].alive = False
                    self._recover()
            except EngineLost:
                self.outcomes[j["name"]] = ("engine_lost", job.progress.boundary, job, (before, self.ncalls))
                # The driver takes the engine down: its ranks may disagree now.
                self.engines[-1].alive = False
                self._recover()
                self._recover()  # a second recovery on a healthy engine changes nothing

    # --- invariants ----------------------------------------------------------------------

    def check(self) -> list[str]:
        v = list(self.violations)
        for e in self.engines:
            seqs = [[(k, m) for k, m, _ in r.calls] for r in e.ranks]
            if any(s != seqs[0] for s in seqs):
                v.append(f"generation {e.number}: the ranks ran different calls")
            pubs = [r.publishes for r in e.ranks]
            if any(p != pubs[0] for p in pubs) and not any(k == "publish_error" for _, k, _ in self.fired):
                v.append(f"generation {e.number}: the ranks published differently: {pubs}")
            if e.alive and any(r.open is not None for r in e.ranks):
                v.append(f"generation {e.number}: a rank still has job {[r.open for r in e.ranks]} open at the end")
        for j in self.sc.jobs:
            name = j["name"]
            if name not in self.outcomes:
                continue
            verdict, boundary, job, (before, after) = self.outcomes[name]
            fired = [(k, b) for n, k, b in self.fired if n == name]
            mine = [(k, m, a) for e in self.engines for r in e.ranks for k, m, a in r.calls if before < k <= after]
            steps = [(k, a) for k, m, a in mine if m == "rt_step"]
            if (j["fault"] or {}).get("kind") == "unauthorised":
                if verdict is not Verdict.CANCEL or mine:
                    v.append(f"job {name}: ran without the authority ({verdict})")
                continue
            if verdict == "engine_lost":
                continue
            if verdict is Verdict.PUBLISH:
                if fired:
                    v.append(f"job {name}: published although {fired} happened")
                m = self.store.last_good()
                if m is None or m.name != name and self._published_after(name):
                    v.append(f"job {name}: published but LAST_GOOD names {None if m is None else m.name}")
                if job.progress.fingerprint_before != job.progress.fingerprint_after:
                    v.append(f"job {name}: published over a changed base")
                continue
            if not fired:
                v.append(f"job {name}: ended {verdict} at {boundary} with no fault")
                continue
            kind, at = fired[0]
            b = j["fault"]["b"]
            # A STOP file that appears during begin is seen at the seal.
            want = {"step_error": b + 1, "nan": b + 1, "budget": b + 1, "stop": b if b else -1, "cancel": b, "begin_error": -1,
                    "corrupt": j["steps"], "verify_error": j["steps"], "ckpt_error": j["steps"] + 1}.get(kind)  # fmt: skip
            if want is not None and boundary != want:
                v.append(f"job {name}: {kind} at boundary {want} but the job ended at {boundary}")
            late = [a[0] for _, a in steps if a and a[0] >= boundary]
            if late:
                v.append(f"job {name}: steps {sorted(set(late))} ran after the job ended at boundary {boundary}")
            last = [m for _, m, _ in sorted(mine, key=lambda x: x[0])]
            if last and last[-1] != "rt_discard":
                v.append(f"job {name}: the ranks' last call was {last[-1]}, not rt_discard")
        m = self.store.last_good()
        if m is not None:
            for r in range(self.sc.world):
                try:
                    self.store.load(r)
                except CorruptCheckpoint as exc:
                    v.append(f"LAST_GOOD does not verify: {exc}")
            receipts = {x["job"]: x for x in read_jsonl(self.fs, self.log.receipts_path)}
            committed = (
                m.name in receipts
                and receipts[m.name]["outcome"] == "publish"
                or any(n == m.name and k == "publish_error" for n, k, _ in self.fired)
                or self.outcomes.get(m.name, ("",))[0] == "engine_lost"
            )
            if not committed:
                v.append(f"LAST_GOOD names {m.name}, which neither published nor was committed")
        for rs in self.restarts:
            if rs["action"] == "restarted" and any(s != (rs["last_good"] or "zero") for s in rs["served"]):
                v.append(f"a restart serves {rs['served']}, LAST_GOOD is {rs['last_good']}")
        return v

    def _published_after(self, name: str) -> bool:
        names = [j["name"] for j in self.sc.jobs]
        later = names[names.index(name) + 1 :]
        return not any(self.outcomes.get(n, (None,))[0] in (Verdict.PUBLISH, "engine_lost") for n in later)


def run_seed(seed: int, variant: str | None = None) -> list[str]:
    sim = CallSimulation(seed, variant)
    sim.run()
    return sim.check()


def coverage(seeds: range) -> dict[str, int]:
    """How often each fault fired over `seeds` (a sweep must reach all)."""
    out: dict[str, int] = {}
    for s in seeds:
        sim = CallSimulation(s)
        sim.run()
        for _, kind, _ in sim.fired:
            out[kind] = out.get(kind, 0) + 1
        for j in sim.sc.jobs:
            if (j["fault"] or {}).get("kind") == "unauthorised":
                out["unauthorised"] = out.get("unauthorised", 0) + 1
        for rs in sim.restarts:
            out[f"recovery:{rs['action']}"] = out.get(f"recovery:{rs['action']}", 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resident_trainer.testing.calls", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, help="replay one seed: print its scenario and violations")
    p.add_argument("--seeds", type=int, default=2000, help="sweep this many seeds from 0 (default: 2000)")
    p.add_argument("--variant", choices=sorted(VARIANTS), default=None, help="run a deliberately broken driver")
    a = p.parse_args(argv)
    if a.seed is not None:
        sim = CallSimulation(a.seed, a.variant)
        print(json.dumps(sim.sc.__dict__, default=str))
        sim.run()
        v = sim.check()
        print(f"seed {a.seed}: {len(v)} violation(s); fired {sim.fired}")
        for line in v:
            print(" -", line)
        return 1 if v else 0
    bad = [(s, v) for s in range(a.seeds) if (v := run_seed(s, a.variant))]
    print(f"{a.seeds} seeds, {len(bad)} failing")
    for s, v in bad[:20]:
        print(f"seed {s}: {v[0]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
