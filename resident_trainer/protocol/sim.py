"""Deterministic, seeded simulation of the protocol with injected faults.

One seed fixes everything: the world size (when not given), the chat and job
arrivals, and the faults (delayed and reordered messages, a worker that never
joins or joins late, a rank dying in a chosen phase or at its k-th store
operation, the head dying with the store it hosts, store errors, slow
operations and outages, a budget breach on one rank, a STOP file mid-job,
hot-load bytes differing on one rank or changing after they were hashed, a
trainer that corrupts the frozen weights, a crash between a checkpoint's
temporary file and its rename, a stalled process, a stale recovery-lock
owner). The machines under test are the production classes of
`resident_trainer.protocol`, given an in-memory store, link, filesystem and
virtual clock.

Scheduling: every rank's `tick()` runs to the point where it waits; its
store operations take effect at the tick's virtual time and their latency
delays the rank's next tick; ranks that can run at the same instant run in a
seeded random order, repeatedly, until none changes the store or the link.
A training step blocks until every peer has entered the same collective (a
dead peer fails it, as a closed connection fails a gloo all-reduce); serving
ops and steps are recorded per rank and compared afterwards.

After the run, `check()` verifies the invariants of DESIGN.md; a failing seed
replays exactly: ``python -m resident_trainer.protocol.sim --seed N --world W``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import heapq
import json
import math
import random
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from resident_trainer.protocol.budget import BudgetMonitor, MemoryBudget, MemorySample
from resident_trainer.protocol.channel import TrainerChannel
from resident_trainer.protocol.checkpoint import CheckpointStore, CorruptCheckpoint
from resident_trainer.protocol.config import ProtocolConfig, Timeouts
from resident_trainer.protocol.errors import LinkClosed, PeerLost, StoreTimeout, StoreUnavailable
from resident_trainer.protocol.fs import MemoryFileSystem
from resident_trainer.protocol.hotload import code_digest, staged_path
from resident_trainer.protocol.job import HeadJob, JobKind, JobSpec, Outcome, RankContext, Verdict, WorkerJob
from resident_trainer.protocol.lock import FencedLock
from resident_trainer.protocol.records import RecordLog, read_jsonl
from resident_trainer.protocol.recovery import GroupState, Recovery, admits
from resident_trainer.protocol.server import HeadServer, WorkerServer
from resident_trainer.protocol.serving import Chat, OpKind, ServingOp
from resident_trainer.protocol.store import MemoryKVStore

AUTHORITY = "sim-authority"
STEP_MAX = 0.2  # longest simulated microbatch, seconds
SLOW_OP = 0.25  # a store operation that times out takes this long
TIMEOUTS = Timeouts(exchange=0.5, decision=1.5, pause=0.5, group=3.0, poll=0.02)
HOT_MODULE = "simhot"
#: Phases a rank can be killed in (logged by the machines).
DEATH_PHASES = ("start", "collect", "reported", "decided", "pause", "resume", "step", "load", "published")
VARIANTS = ("selfish_pause", "doorbell_stall", "lone_abort", "deaf_head")
#: Phases a sweep counts (they show a fault path was taken).
COVERED_PHASES = ("adopted", "timeout", "store_error", "group_lost", "refused_generation", "ignored_start", "pause")


class _Killed(BaseException):
    """A simulated kill -9: not an Exception, so no handler in the code under
    test can catch it."""


# --- the scenario: every random choice, made up front from the seed ------------------------


@dataclass
class Scenario:
    seed: int
    world: int
    jobs: list[dict] = field(default_factory=list)
    chats: list[tuple[float, int]] = field(default_factory=list)
    store_latency: float = 0.001
    link_delay: float = 0.005
    store_err_p: float = 0.0
    store_slow_p: float = 0.0
    outage: tuple[float, float] | None = None
    never_join: tuple[int, int] | None = None  # (worker, job index)
    late_start: tuple[int, int, float] | None = None  # (worker, job index, extra delay)
    death: dict | None = None  # {"rank", "how": "phase"|"op"|"time", ...}
    breach: tuple[int, float, float] | None = None  # (rank, from, to)
    stop: tuple[int, float] | None = None  # (job index, time)
    hot_differ: int | None = None  # rank that reads different staged bytes
    hot_change: float | None = None  # time the staged file changes
    corrupt: tuple[int, int, int] | None = None  # (rank, job index, step)
    ckpt_crash: tuple[int, str] | None = None  # (rank, "shard"|"manifest")
    stall: tuple[int, float, float] | None = None  # (rank, at, duration)
    stale_owner: str | None = None  # where supervisor A stalls: "healthy"|"stop"|"start"
    recovery_times: list[float] = field(default_factory=list)

    @classmethod
    def generate(cls, seed: int, world: int | None = None) -> Scenario:
        rng = random.Random(seed * 7919 + 17)
        # Drawn even when given, so (seed, None) replays as (seed, its world).
        drawn = rng.choice((2, 3))
        world = world or drawn
        sc = cls(seed, world)
        njobs = rng.choice((1, 2, 2, 3))
        for i in range(njobs):
            kind = JobKind.HOTLOAD if rng.random() < 0.15 else JobKind.TRAIN
            auth = AUTHORITY if rng.random() < 0.92 else rng.choice(("", "sim-authorit", "wrong"))
            sc.jobs.append({"t": round(rng.uniform(0.0, 2.5), 4), "name": f"job{i}", "kind": kind.value,
                            "steps": rng.randint(1, 4), "authority": auth})
        sc.chats = sorted((round(rng.uniform(0.0, 3.5), 4), rng.randint(1, 3)) for _ in range(rng.randint(0, 7)))
        sc.store_latency = rng.choice((0.0002, 0.001, 0.005))
        sc.link_delay = rng.choice((0.001, 0.01, 0.05))
        sc.store_err_p = rng.choice((0.0, 0.0, 0.02, 0.08))
        sc.store_slow_p = rng.choice((0.0, 0.0, 0.0, 0.01))
        if rng.random() < 0.12:
            t0 = rng.uniform(0.0, 3.0)
            sc.outage = (round(t0, 4), round(t0 + rng.uniform(0.05, 1.0), 4))
        workers = list(range(1, world))
        if rng.random() < 0.1:
            sc.never_join = (rng.choice(workers), rng.randrange(njobs))
        if rng.random() < 0.1:
            sc.late_start = (rng.choice(workers), rng.randrange(njobs), round(rng.uniform(0.3, 2.0), 4))
        r = rng.random()
        if r < 0.3:
            rank = rng.randrange(world)
            how = rng.choice(("phase", "phase", "phase", "op", "time"))
            if how == "phase":
                phases = [p for p in DEATH_PHASES if p != ("reported" if rank == 0 else "collect")]
                sc.death = {"rank": rank, "how": how, "job": rng.randrange(njobs), "phase": rng.choice(phases),
                            "b": rng.choice((-1, -1, 0, 1, 2))}
                # The job must run, and reach the phase, for the rank to die there.
                job = sc.jobs[sc.death["job"]]
                job["authority"] = AUTHORITY
                if sc.death["phase"] == "load":
                    job["kind"] = JobKind.HOTLOAD.value
                    sc.death["b"] = min(sc.death["b"], 0)  # a hot-load loads at boundary 0
                if sc.death["phase"] in ("pause", "resume"):
                    job["kind"] = JobKind.TRAIN.value
                    sc.chats = sorted(sc.chats + [(round(job["t"] + rng.uniform(0.01, 0.4), 4), rng.randint(1, 3))
                                                  for _ in range(3)])
            elif how == "op":
                sc.death = {"rank": rank, "how": how, "op": rng.randint(1, 150), "after": rng.random() < 0.5}
            else:
                sc.death = {"rank": rank, "how": how, "t": round(rng.uniform(0.0, 4.0), 4)}
        if rng.random() < 0.1:
            t0 = rng.uniform(0.0, 3.0)
            sc.breach = (rng.randrange(world), round(t0, 4), round(t0 + rng.uniform(0.01, 0.5), 4))
        if rng.random() < 0.1:
            sc.stop = (rng.randrange(njobs), round(rng.uniform(0.0, 3.5), 4))
        if any(j["kind"] == "hotload" for j in sc.jobs):
            if rng.random() < 0.5:
                sc.hot_differ = rng.randrange(world)
            if rng.random() < 0.3:
                sc.hot_change = round(rng.uniform(0.0, 3.0), 4)
        if rng.random() < 0.06:
            sc.corrupt = (rng.randrange(world), rng.randrange(njobs), rng.randint(0, 3))
        if rng.random() < 0.05:
            sc.ckpt_crash = (rng.randrange(world), rng.choice(("shard", "manifest")))
        if rng.random() < 0.12:
            sc.stall = (rng.randrange(world), round(rng.uniform(0.0, 3.5), 4), round(rng.uniform(0.05, 2.0), 4))
        if rng.random() < 0.15:
            sc.stale_owner = rng.choice(("healthy", "stop", "start"))
            if sc.death is None:
                # A stale owner only matters when there is something to recover.
                sc.death = {"rank": rng.randrange(world), "how": "time", "t": round(rng.uniform(0.0, 3.0), 4)}
        sc.recovery_times = [round(1.0 + 1.5 * k + rng.uniform(0.0, 0.5), 4) for k in range(5)]
        return sc


def _hot_source(job: str) -> bytes:
    """The staged hot-load source of `job`: it records its own execution."""
    return f"LOADED.append({job!r})\n".encode()


# --- the simulated world ----------------------------------------------------------------------


class SimStore(MemoryKVStore):
    """The store of one group generation, hosted by its head: faults and
    latency are charged to the rank currently ticking."""

    def __init__(self, sim: Simulation, gen: SimGen) -> None:
        super().__init__()
        self.sim = sim
        self.gen = gen

    def _pre(self) -> bool:
        sim = self.sim
        rank = sim.current
        if rank is None:
            return False
        sc = sim.sc
        if self.gen.head_dead:
            sim.charge(0.0005)
            raise StoreUnavailable("store server gone with the head")
        t = sim.clock_now()
        if sc.outage and sc.outage[0] <= t < sc.outage[1]:
            sim.charge(0.001)
            raise StoreUnavailable("store outage")
        sim.charge(sim.rng.uniform(0.2, 1.0) * sc.store_latency)
        sim.ops[rank] = sim.ops.get(rank, 0) + 1
        d = sc.death
        if d and d["how"] == "op" and d["rank"] == rank and sim.ops[rank] == d["op"] and self.gen.number == 1:
            sim.fired.append("death:op")
            if not d["after"]:
                raise _Killed()
            return True
        return False

    def _post(self, die: bool) -> None:
        sim = self.sim
        if sim.current is None:
            return
        if die:
            raise _Killed()
        sc = sim.sc
        if sc.store_err_p and sim.rng.random() < sc.store_err_p:
            sim.delay(sim.current, TIMEOUTS.poll + sc.store_latency)
            raise StoreUnavailable("injected store error (the operation may have landed)")
        if sc.store_slow_p and sim.rng.random() < sc.store_slow_p:
            sim.delay(sim.current, SLOW_OP)
            sim.charge(SLOW_OP)
            raise StoreTimeout("injected store timeout (the operation may have landed)")

    def _maybe_fail_before(self) -> None:
        sc = self.sim.sc
        if self.sim.current is not None and sc.store_err_p and self.sim.rng.random() < sc.store_err_p / 2:
            self.sim.delay(self.sim.current, TIMEOUTS.poll + sc.store_latency)
            raise StoreUnavailable("injected store error (nothing landed)")

    def set(self, key: str, value: bytes) -> None:
        die = self._pre()
        self._maybe_fail_before()
        super().set(key, value)
        self._post(die)

    def get(self, key: str) -> bytes | None:
        die = self._pre()
        self._maybe_fail_before()
        v = super().get(key)
        self._post(die)
        return v

    def create(self, key: str, value: bytes) -> bytes:
        die = self._pre()
        self._maybe_fail_before()
        v = super().create(key, value)
        self._post(die)
        return v

    def delete(self, key: str) -> None:
        die = self._pre()
        self._maybe_fail_before()
        super().delete(key)
        self._post(die)

    def add(self, key: str, amount: int) -> int:
        die = self._pre()
        v = super().add(key, amount)
        self._post(die)
        return v


class SimLink:
    """The head's ordered broadcast: FIFO per worker, each message delayed."""

    def __init__(self, sim: Simulation, gen: SimGen) -> None:
        self.sim = sim
        self.gen = gen
        self.ops: dict[int, list[tuple[float, ServingOp]]] = {}
        self.rings: dict[int, list[float]] = {}
        self.op_pos: dict[int, int] = {}
        self.ring_pos: dict[int, int] = {}
        self.last: dict[int, float] = {}

    def _deliver_at(self, w: int, extra: float = 0.0) -> float:
        t = self.sim.clock_now() + self.sim.rng.uniform(0.1, 1.0) * self.sim.sc.link_delay + extra
        t = max(t, self.last.get(w, 0.0))
        self.last[w] = t
        self.sim.push_time(t)
        return t

    # head side
    def send(self, op: ServingOp) -> None:
        self.sim.version += 1
        for w in range(1, self.gen.world):
            extra = 0.0
            ls = self.sim.sc.late_start
            if ls and op.kind is OpKind.START and ls[0] == w and self.sim.job_index(op.data.get("name")) == ls[1]:
                extra = ls[2]
                t = self.sim.clock_now()
                self.sim.delays.setdefault(w, []).append((t, t + extra))
            self.ops.setdefault(w, []).append((self._deliver_at(w, extra), op))

    def ring(self, n: int) -> None:
        self.sim.version += 1
        for w in range(1, self.gen.world):
            self.rings.setdefault(w, []).append(self._deliver_at(w))

    # worker side, bound to a rank
    def view(self, w: int) -> _WorkerView:
        return _WorkerView(self, w)


class _WorkerView:
    """One worker's end of the SimLink (the WorkerLink interface)."""

    def __init__(self, link: SimLink, w: int) -> None:
        self.link = link
        self.w = w

    def _check(self) -> None:
        if self.link.gen.head_dead:
            raise LinkClosed("the head is gone")

    def poll(self) -> ServingOp | None:
        lst = self.link.ops.get(self.w, [])
        i = self.link.op_pos.get(self.w, 0)
        if i < len(lst) and lst[i][0] <= self.link.sim.clock_now():
            self.link.op_pos[self.w] = i + 1
            self.link.sim.version += 1
            return lst[i][1]
        self._check()
        return None

    def rung(self) -> bool:
        lst = self.link.rings.get(self.w, [])
        i = self.link.ring_pos.get(self.w, 0)
        if i < len(lst) and lst[i] <= self.link.sim.clock_now():
            self.link.ring_pos[self.w] = i + 1
            self.link.sim.version += 1
            return True
        self._check()
        return False

    def wait_keys(self, ring: bool) -> tuple[str, ...]:
        return ()


class SimFS(MemoryFileSystem):
    """Shared files; a rank can be made to read different staged bytes, and
    a crash can land between a temporary file and its rename."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__(before_replace=self._before_replace)
        self.sim = sim

    def read_bytes(self, path: str) -> bytes | None:
        data = super().read_bytes(path)
        sim = self.sim
        if data is not None and sim.sc.hot_differ is not None and sim.current == sim.sc.hot_differ and "/staged/" in path:
            return data + b"# this rank's copy differs\n"
        return data

    def _before_replace(self, path: str) -> None:
        sim = self.sim
        cc = sim.sc.ckpt_crash
        if cc is None or sim.current != cc[0] or sim.ckpt_crashed:
            return
        if (cc[1] == "shard" and path.endswith(".bin")) or (cc[1] == "manifest" and path.endswith("LAST_GOOD.json")):
            sim.ckpt_crashed = True
            sim.fired.append(f"ckpt_crash:{cc[1]}")
            raise _Killed()


class SimClock:
    """A rank's clock: virtual time, plus what its current tick has spent."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def now(self) -> float:
        return self.sim.clock_now()


class SupervisorClock:
    """The recovery lock's clock: virtual time plus the time a stalled
    supervisor lost (only locks read it)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def now(self) -> float:
        return self.sim.now + self.sim.sup_offset


class _Blocked(BaseException):
    """The calling rank is inside a collective its peers have not reached:
    the sim unwinds its tick (before any state change: the step is the last
    thing a machine does before moving on) and ticks it again later."""


class SimBody:
    """A job body: steps are recorded collectives, the frozen weights are a
    string per rank, the trained block a digest chain."""

    def __init__(self, sim: Simulation, gen: SimGen, rank: int, spec: JobSpec) -> None:
        self.sim = sim
        self.gen = gen
        self.rank = rank
        self.spec = spec
        self.steps = 0
        self.trained: str | None = None
        self.entered: int | None = None  # collective index of a step still waiting for peers

    def fingerprint(self) -> dict[str, str]:
        self.sim.charge(0.001)
        return {"frozen": self.gen.frozen[self.rank], "watch": "w" + self.gen.frozen[self.rank][-4:]}

    def step(self, index: int) -> dict[str, float]:
        """A step blocks until every peer has entered the same collective
        (index in the group's collective sequence); a dead peer fails it, as
        a closed connection fails a gloo or NCCL collective."""
        sim, gen = self.sim, self.gen
        tag = ("T", self.spec.name, index)
        mine = gen.coll[self.rank]
        if self.entered is None:
            mine.append((tag, sim.clock_now()))
            self.entered = len(mine) - 1
            sim.version += 1
        k = self.entered
        for peer in gen.ranks:
            if peer.rank == self.rank:
                continue
            theirs = gen.coll[peer.rank]
            if len(theirs) > k:
                if theirs[k][0] != tag:
                    self.entered = None
                    sim.mismatches.append(f"generation {gen.number}: collective {k}: rank {self.rank} entered {tag}, rank {peer.rank} {theirs[k][0]}")
                    raise PeerLost(f"collective {k} mismatched")
                continue
            if peer.dead or peer.lost_at is not None:
                self.entered = None
                raise PeerLost(f"rank {peer.rank} is gone")
            raise _Blocked()
        self.entered = None
        sim.charge(sim.rng.uniform(0.3, 1.0) * STEP_MAX)
        c = sim.sc.corrupt
        if c and c[0] == self.rank and sim.job_index(self.spec.name) == c[1] and c[2] == index:
            gen.frozen[self.rank] = gen.frozen[self.rank] + "!"
            sim.corrupted.append((gen.number, self.rank, self.spec.name))
        self.steps += 1
        return {"loss": 1.0 / (1 + self.steps)}

    def checkpoint(self) -> bytes:
        self.sim.charge(0.002)
        self.trained = hashlib.sha256(f"{self.gen.block[self.rank]}|{self.spec.name}|{self.steps}".encode()).hexdigest()[:16]
        return ("block:" + self.trained).encode()

    def publish(self) -> None:
        assert self.trained is not None
        self.gen.block[self.rank] = self.trained

    def discard(self) -> None:
        self.trained = None


class SimBackend:
    """A serving op as a collective: recorded in the rank's sequence."""

    def __init__(self, sim: Simulation, gen: SimGen, rank: int) -> None:
        self.sim, self.gen, self.rank = sim, gen, rank

    def execute(self, op: ServingOp) -> None:
        self.gen.coll[self.rank].append((("S", op.msg), self.sim.clock_now()))
        self.gen.serve_times.setdefault(op.msg, {})[self.rank] = self.sim.clock_now()


class SimChats:
    """The head's chat source: the scheduler appends arrivals."""

    def __init__(self) -> None:
        self.new: list[Chat] = []
        self.done: dict[int, int] = {}

    def take(self) -> list[Chat]:
        out, self.new = self.new, []
        return out

    def finished(self, chat: Chat, msg: int) -> None:
        self.done[chat.id] = msg


# --- deliberately broken variants: the checker must catch each ---------------------------------


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
        if self.state == "wait" and self.b >= 0 and self.ctx.budget.breach():
            self.outcome = Outcome(Verdict.ABORT, self.b, (f"rank {self.rank}: aborted alone",))
            self.state = "finish"
        return super()._advance()


class _DeafHeadJob(HeadJob):
    """BROKEN: ignores the workers' abort votes at step boundaries."""

    def _propose(self):
        if not 0 <= self.b < self.spec.steps:
            return super()._propose()
        kept = self.reports
        self.reports = {r: {**rep, "abort": None} for r, rep in kept.items()}
        try:
            return super()._propose()
        finally:
            self.reports = kept


class _SimWorker(WorkerServer):
    """The production worker loop, plus the 'never joins' fault: a worker
    whose trainer side ignores one START op."""

    def __init__(self, sim: Simulation, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.sim = sim

    def _handle(self, op: ServingOp) -> None:
        nj = self.sim.sc.never_join
        if op.kind is OpKind.START and nj and nj[0] == self.ctx.rank and self.sim.job_index(op.data.get("name")) == nj[1]:
            self.ctx.log.phase(op.data.get("name"), "ignored_start", serial=op.job, msg=op.msg)
            return
        super()._handle(op)


class _SelfishWorker(_SimWorker):
    job_class = _SelfishJob


class _LoneAbortWorker(_SimWorker):
    job_class = _LoneAbortJob


class _StallingWorker(_SimWorker):
    """BROKEN: always waits for the doorbell after a job, even when the
    job's last RESUME left chats live."""

    def after_job(self, job):
        super().after_job(job)
        self.need_ring = True


class _DeafHead(HeadServer):
    job_class = _DeafHeadJob


# --- generations, ranks, the scheduler ---------------------------------------------------------


@dataclass
class SimRank:
    rank: int
    server: Any
    ctx: RankContext
    monitor: BudgetMonitor
    dead: bool = False
    dead_at: float | None = None
    lost_at: float | None = None
    refused: bool = False
    admitted: bool = False
    ready_at: float = 0.0
    wake_at: float | None = 0.0
    seen: int = -1  # change counter when last ticked

    @property
    def gone_at(self) -> float | None:
        """When this rank stopped taking part: it left a lost group or was
        killed, whichever came first."""
        times = [t for t in (self.dead_at, self.lost_at) if t is not None]
        return min(times) if times else None


@dataclass
class SimGen:
    """One generation of the rank group: its own store (hosted by its head),
    link, ranks and records."""

    number: int
    token: int
    world: int
    store: SimStore | None = None
    link: SimLink | None = None
    ranks: list[SimRank] = field(default_factory=list)
    chats: SimChats = field(default_factory=SimChats)
    coll: dict[int, list] = field(default_factory=dict)
    serve_times: dict[int, dict[int, float]] = field(default_factory=dict)
    frozen: dict[int, str] = field(default_factory=dict)
    block: dict[int, str] = field(default_factory=dict)
    modules: dict[int, dict] = field(default_factory=dict)
    started_at: float = 0.0
    head_dead: bool = False
    head_dead_at: float | None = None
    killed_at: float | None = None

    @property
    def group(self) -> str:
        return f"g{self.number}"

    @property
    def refused(self) -> bool:
        return any(r.refused for r in self.ranks)


@dataclass
class SimResult:
    seed: int
    world: int
    variant: str | None
    violations: list[str]
    digest: str
    stats: dict[str, Any]
    coverage: collections.Counter = field(default_factory=collections.Counter)

    @property
    def ok(self) -> bool:
        return not self.violations

    def replay_hint(self) -> str:
        v = f" --variant {self.variant}" if self.variant else ""
        return f"python -m resident_trainer.protocol.sim --seed {self.seed} --world {self.world}{v}"


@dataclass
class SweepReport:
    """A sweep's failing runs (seed, world, violations), what it exercised,
    and how long it took."""

    failures: list[tuple[int, int, list[str]]]
    coverage: collections.Counter
    runs: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.runs / self.seconds if self.seconds > 0 else float("inf")


class Simulation:
    def __init__(self, seed: int, world: int | None = None, variant: str | None = None) -> None:
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS} or None, got {variant!r}")
        if world is not None and world not in (2, 3):
            raise ValueError(f"world must be 2, 3 or None, got {world!r}")
        self.sc = Scenario.generate(seed, world)
        self.variant = variant
        self.rng = random.Random(seed)
        self.now = 0.0
        self.current: int | None = None
        self._charge = 0.0
        self.version = 0
        self.times: list[float] = []
        self.ops: dict[int, int] = {}
        self.gens: list[SimGen] = []
        self.fs = SimFS(self)
        self.config = ProtocolConfig(authority=AUTHORITY, receipts_dir="/receipts", checkpoints_dir="/ckpt",
                                     state_dir="/state", hotload=True, timeouts=TIMEOUTS)
        self.sup_offset = 0.0
        self.delays: dict[int, list[tuple[float, float]]] = {}
        self.corrupted: list[tuple[int, int, str]] = []
        self.mismatches: list[str] = []
        self.ckpt_crashed = False
        self.crashes: list[str] = []
        self.recoveries: list[dict] = []
        self.chat_gen: dict[int, int] = {}
        self.chat_objs: dict[int, Chat] = {}
        self.job_gen: dict[str, int] = {}
        self.load_errors: list[str] = []
        self.stale_done = False
        self.fired: list[str] = []  # the kill triggers that fired, in order
        self._parsed: dict[int, tuple] = {}
        self.lock = FencedLock(self.fs, "/state", SupervisorClock(self), lease_seconds=2.0)

    # --- time and charges ---------------------------------------------------------------------

    def clock_now(self) -> float:
        return self.now + (self._charge if self.current is not None else 0.0)

    def charge(self, dt: float) -> None:
        if self.current is not None:
            self._charge += dt

    def delay(self, rank: int, dt: float) -> None:
        t = self.clock_now()
        self.delays.setdefault(rank, []).append((t, t + dt))

    def push_time(self, t: float) -> None:
        heapq.heappush(self.times, t)

    def job_index(self, name: object) -> int:
        if isinstance(name, str) and name.startswith("job"):
            return int(name[3:])
        return -1

    @property
    def gen(self) -> SimGen:
        """The newest generation (the one recovery started last)."""
        return self._gen

    # --- generations ----------------------------------------------------------------------------

    def _on_phase(self, gen: SimGen, rank: int):
        d = self.sc.death
        if not (d and d["how"] == "phase" and d["rank"] == rank and gen.number == 1):
            return None

        def hook(line: dict) -> None:
            if (self.job_index(line.get("job")) == d["job"] and line.get("phase") == d["phase"]
                    and (line.get("b") is None or line.get("b") >= d["b"])):
                self.fired.append(f"death:{d['phase']}")
                raise _Killed()
        return hook

    def start_gen(self, number: int, token: int) -> SimGen:
        world = self.sc.world
        gen = SimGen(number, token, world, started_at=self.now)
        gen.store = SimStore(self, gen)
        gen.link = SimLink(self, gen)
        ckpts = CheckpointStore(self.fs, "/ckpt")
        variant_worker = {"selfish_pause": _SelfishWorker, "doorbell_stall": _StallingWorker,
                          "lone_abort": _LoneAbortWorker}.get(self.variant or "", _SimWorker)
        for r in range(world):
            gen.coll[r] = []
            gen.frozen[r] = f"base-r{r}"
            gen.block[r] = "zero"
            gen.modules[r] = {HOT_MODULE: {"__name__": HOT_MODULE, "LOADED": []}}
            try:
                loaded = ckpts.load(r)
                if loaded is not None:
                    gen.block[r] = loaded[1].decode().split(":", 1)[1]
            except CorruptCheckpoint as exc:
                self.load_errors.append(f"generation {number} rank {r}: {exc}")
            clock = SimClock(self)
            log = RecordLog(self.fs, "/receipts", rank=r, group=gen.group, clock=clock,
                            stack_dumper=lambda: "(simulated stacks)\n", on_phase=self._on_phase(gen, r))
            monitor = BudgetMonitor(MemoryBudget(floor=100, ceiling=1000), self._sampler(r))
            ctx = RankContext(rank=r, world=world, group=gen.group,
                              channel=TrainerChannel(gen.store, group=gen.group, world=world),
                              clock=clock, fs=self.fs, log=log, config=self.config, budget=monitor,
                              checkpoints=ckpts, modules=gen.modules[r])
            factory = self._factory(gen)
            if r == 0:
                cls = _DeafHead if self.variant == "deaf_head" else HeadServer
                server = cls(ctx, link=gen.link, backend=SimBackend(self, gen, r), chats=gen.chats, body_factory=factory)
            else:
                server = variant_worker(self, ctx, link=gen.link.view(r), backend=SimBackend(self, gen, r), body_factory=factory)
            gen.ranks.append(SimRank(r, server, ctx, monitor, ready_at=self.now, wake_at=self.now))
        self.gens.append(gen)
        if not self.gens or number >= max(g.number for g in self.gens):
            self._gen = gen
        self.push_time(self.now)
        return gen

    def _factory(self, gen: SimGen):
        def make(spec: JobSpec, ctx: RankContext) -> SimBody:
            return SimBody(self, gen, ctx.rank, spec)
        return make

    def _sampler(self, rank: int):
        def sample() -> MemorySample:
            b = self.sc.breach
            free = 50 if (b and b[0] == rank and b[1] <= self.now < b[2]) else 500
            return MemorySample(free, 10)
        return sample

    def kill(self, gen: SimGen, rank: SimRank) -> None:
        if rank.dead:
            return
        rank.dead = True
        rank.dead_at = self.clock_now() if self.current == rank.rank else self.now
        self.version += 1
        if rank.rank == 0:
            gen.head_dead = True
            gen.head_dead_at = rank.dead_at

    # --- recovery -----------------------------------------------------------------------------

    def _healthy(self, gen: SimGen | None) -> bool:
        return gen is not None and all(not r.dead and r.lost_at is None and not r.refused for r in gen.ranks)

    def _recover(self, owner: str, stall_at: str | None = None) -> None:
        sim = self

        class Control:
            def healthy(self, state: GroupState) -> bool:
                if stall_at == "healthy":
                    sim._stale_interlude()
                return sim._healthy(next((g for g in sim.gens if g.number == state.generation), None))

            def stop(self, state: GroupState) -> None:
                if stall_at == "stop":
                    sim._stale_interlude()
                for g in sim.gens:
                    if g.number == state.generation or (state.generation == -1 and g.token == state.token):
                        if g.killed_at is None:
                            g.killed_at = sim.now
                        for r in g.ranks:
                            if not r.admitted and not r.refused and not r.dead:
                                # A launched process checks its admission on start,
                                # before a stop can reach it.
                                sim._admit(g, r)
                            sim.kill(g, r)

            def start(self, generation: int, token: int) -> tuple[int, tuple[int, ...]]:
                if stall_at == "start":
                    sim._stale_interlude()
                g = sim.start_gen(generation, token)
                return generation, tuple(generation * 100 + r.rank for r in g.ranks)

        before = self.fs.read_bytes("/state/group.json")
        healthy = bool(self.gens) and self._healthy(self.gen)
        res = Recovery(self.lock, Control(), owner=owner).run()
        after = self.fs.read_bytes("/state/group.json")
        self.recoveries.append({"owner": owner, "t": self.now, "action": res.action, "healthy": healthy,
                                "changed": before != after, "generation": res.generation, "token": res.token,
                                "stalled": stall_at})

    def _stale_interlude(self) -> None:
        """Supervisor A stalls past its lease; B takes the lock and recovers."""
        self.sup_offset += self.lock.lease_seconds + 0.5
        self._recover("B")

    # --- events ----------------------------------------------------------------------------------

    def _events(self) -> list[tuple[float, int, str, Any]]:
        sc = self.sc
        ev: list[tuple[float, int, str, Any]] = []
        for i, (t, tokens) in enumerate(sc.chats):
            ev.append((t, 0, "chat", (i, tokens)))
        for j in sc.jobs:
            ev.append((j["t"], 1, "job", j))
        if sc.death and sc.death["how"] == "time":
            ev.append((sc.death["t"], 2, "death", sc.death["rank"]))
        if sc.stop:
            ev.append((sc.stop[1], 3, "stop", sc.stop[0]))
        if sc.hot_change is not None:
            ev.append((sc.hot_change, 4, "hot_change", None))
        if sc.stall:
            ev.append((sc.stall[1], 5, "stall", sc.stall))
        for k, t in enumerate(sc.recovery_times):
            ev.append((t, 6, "recover", k))
        for t in (sc.breach[1:] if sc.breach else ()) + (sc.outage or ()):
            ev.append((t, 7, "tick", None))
        return sorted(ev, key=lambda e: (e[0], e[1]))

    def _fire(self, kind: str, arg: Any) -> None:
        gen = self.gen
        head = gen.ranks[0]
        head_ok = not head.dead and not head.refused and head.lost_at is None
        if kind == "chat":
            i, tokens = arg
            if head_ok:
                chat = Chat(i, tokens, self.now)
                gen.chats.new.append(chat)
                self.chat_gen[i] = gen.number
                self.chat_objs[i] = chat
                self.version += 1
        elif kind == "job":
            spec = JobSpec(arg["name"], JobKind(arg["kind"]), arg["steps"], f"/jobs/{arg['name']}", arg["authority"],
                           (HOT_MODULE,) if arg["kind"] == "hotload" else ())
            if spec.kind is JobKind.HOTLOAD:
                self.fs.files[staged_path(spec.root, HOT_MODULE)] = _hot_source(spec.name)
            if head_ok:
                head.server.submit(spec)
                self.job_gen[spec.name] = gen.number
                self.version += 1
        elif kind == "death":
            if gen.number == 1 and not gen.ranks[arg].dead:
                self.fired.append("death:time")
                self.kill(gen, gen.ranks[arg])
        elif kind == "stop":
            self.fs.files[f"/jobs/job{arg}/STOP"] = b""
        elif kind == "hot_change":
            for p in list(self.fs.files):
                if "/staged/" in p:
                    self.fs.files[p] = self.fs.files[p] + b"# changed after staging\n"
        elif kind == "stall":
            rank, at, d = arg
            r = gen.ranks[rank]
            r.ready_at = max(r.ready_at, at + d)
            self.delays.setdefault(rank, []).append((at, at + d))
            self.push_time(at + d)
        elif kind == "recover":
            stall = None
            if self.sc.stale_owner and not self.stale_done and not self._healthy(gen):
                stall, self.stale_done = self.sc.stale_owner, True
            self._recover("A", stall)

    # --- the scheduler ---------------------------------------------------------------------------

    def _admit(self, gen: SimGen, r: SimRank) -> bool:
        """A process's start-up check: recovery's current state must name its
        generation and token, or it refuses to run."""
        if admits(self.fs, "/state", gen.number, gen.token):
            r.admitted = True
        else:
            r.refused = True
            r.ctx.log.phase(None, "refused_generation", generation=gen.number, token=gen.token)
        return r.admitted

    def _tick(self, gen: SimGen, r: SimRank) -> None:
        self.current = r.rank
        self._charge = 0.0
        try:
            if not r.admitted and not self._admit(gen, r):
                return
            wake = r.server.tick()
            r.wake_at = wake.at
            if r.server.lost is not None and r.lost_at is None:
                r.lost_at = self.clock_now()
                self.version += 1
        except _Blocked:
            r.wake_at = None
        except _Killed:
            self.kill(gen, r)
        except Exception:
            self.crashes.append(f"generation {gen.number} rank {r.rank} raised:\n{traceback.format_exc()}")
            self.kill(gen, r)
        finally:
            r.ready_at = max(r.ready_at, self.now + self._charge)
            if r.wake_at is not None:
                self.push_time(max(r.wake_at, r.ready_at))
            r.seen = self.version + gen.store.version
            self.current = None
            self._charge = 0.0

    def run(self, horizon: float = 60.0) -> None:
        self._recover("A")
        events = self._events()
        for e in events:
            self.push_time(e[0])
        ei = 0
        steps = 0
        while True:
            while ei < len(events) and events[ei][0] <= self.now:
                self._fire(events[ei][2], events[ei][3])
                ei += 1
            gen = self.gen
            b = self.sc.breach
            if b and b[1] <= self.now < b[2]:
                # Outside the breach window every reading is the same
                # healthy one; sampling there changes nothing.
                for r in gen.ranks:
                    if not r.dead:
                        r.monitor.sample()
            for _ in range(500):
                v0 = (self.version, gen.store.version)
                ranks = [r for r in gen.ranks
                         if not r.dead and not r.refused and r.lost_at is None and r.ready_at <= self.now]
                self.rng.shuffle(ranks)
                for r in ranks:
                    self._tick(gen, r)
                if self.gen is not gen:
                    gen = self.gen
                    continue
                if (self.version, gen.store.version) == v0:
                    break
            else:
                self.crashes.append(f"t={self.now:.3f}: the ranks kept changing the store without settling")
            for r in gen.ranks:
                # A rank busy past now that missed a change gets a tick when it is free.
                if r.ready_at > self.now and r.seen != self.version + gen.store.version:
                    self.push_time(r.ready_at)
            nxt = math.inf
            while self.times:
                t = heapq.heappop(self.times)
                if t > self.now:
                    nxt = t
                    break
            if nxt > horizon:
                break
            self.now = nxt
            steps += 1
            if steps > 100000:
                self.crashes.append("the scheduler did not settle in 100000 steps")
                break

    # --- invariants -----------------------------------------------------------------------------

    def _overlap(self, t0: float, t1: float) -> float:
        """Injected delay (stalls, slow store operations, outages) inside [t0, t1]."""
        total = 0.0
        for spans in self.delays.values():
            for a, b in spans:
                total += max(0.0, min(b, t1) - max(a, t0))
        o = self.sc.outage
        if o:
            total += max(0.0, min(o[1], t1) - max(o[0], t0))
        return total

    def _records(self, gen: SimGen) -> tuple[dict[int, list], dict[int, list]]:
        """Each rank's receipts and phase lines for `gen`, parsed once per
        file state (the checker and the coverage both read them)."""
        # Every write to a MemoryFileSystem file stores a new bytes object.
        key = [self.fs.files.get(path) for r in gen.ranks for path in (r.ctx.log.receipts_path, r.ctx.log.phases_path)]
        cached = self._parsed.get(gen.number)
        if cached is not None and len(cached[0]) == len(key) and all(a is b for a, b in zip(cached[0], key)):
            return cached[1]
        receipts = {r.rank: [x for x in read_jsonl(self.fs, r.ctx.log.receipts_path) if x["group"] == gen.group]
                    for r in gen.ranks}
        phases = {r.rank: [x for x in read_jsonl(self.fs, r.ctx.log.phases_path) if x["group"] == gen.group]
                  for r in gen.ranks}
        self._parsed[gen.number] = (key, (receipts, phases))
        return receipts, phases

    def check(self) -> list[str]:
        """Every violated invariant, as a sentence (empty: the run is correct)."""
        v: list[str] = list(self.crashes) + list(self.mismatches)
        v += [f"last good checkpoint unreadable at a restart: {e}" for e in self.load_errors]
        published: set[tuple[str, str]] = set()
        for gen in self.gens:
            if gen.refused:
                if any(gen.coll[r.rank] for r in gen.ranks):
                    v.append(f"generation {gen.number} was refused (stale token) yet ran collectives")
                continue
            receipts, phases = self._records(gen)
            v += self._check_lockstep(gen)
            by_job: dict[str, dict[int, dict]] = {}
            for rank, rs in receipts.items():
                for x in rs:
                    by_job.setdefault(x["job"], {})[rank] = x
            for name, per in by_job.items():
                v += self._check_job(gen, name, per, phases)
            # Decided PUBLISH: the only jobs LAST_GOOD may name (the head can
            # die between its manifest and its receipt).
            published |= {(gen.group, p["job"]) for ps in phases.values() for p in ps
                          if p["phase"] == "decided" and p.get("v") == "publish"}
            v += self._check_authority(gen, by_job, phases)
            v += self._check_serving(gen)
            v += self._check_publish(gen)
            v += self._check_hangs(gen, phases)
        v += self._check_checkpoint(published)
        v += self._check_recovery()
        return v

    def _check_lockstep(self, gen: SimGen) -> list[str]:
        """No rank trains (or serves) alone: collective k is the same op on
        every rank that reached it, and a rank that never reached it is gone."""
        seqs = gen.coll
        longest = max(seqs.values(), key=len)
        for k, (tag, t) in enumerate(longest):
            for r in gen.ranks:
                s = seqs[r.rank]
                if k < len(s):
                    if s[k][0] != tag:
                        return [f"generation {gen.number}: collective {k} is {s[k][0]} on rank {r.rank} but {tag} on another"]
                elif r.gone_at is None and gen.killed_at is None:
                    what = "trained" if tag[0] == "T" else "served"
                    return [f"generation {gen.number}: a rank {what} alone ({tag} at t={t:.3f}); rank {r.rank} is alive and never joined"]
        return []

    def _check_job(self, gen: SimGen, name: str, per: dict[int, dict], phases: dict[int, list]) -> list[str]:
        """All ranks end a job alike, at the same boundary; aborts follow any
        rank's reason; nothing publishes over a changed base; STOP stops it."""
        v: list[str] = []
        head = per.get(0)
        if head is None or head["outcome"] == "refused":
            return v
        for rank, x in per.items():
            if rank == 0 or x["outcome"] == "group_lost" or head["outcome"] == "group_lost":
                continue
            if x["outcome"] == "abandoned":
                if x["boundary"] != head["boundary"] or head["outcome"] == "publish":
                    v.append(f"job {name}: rank {rank} abandoned at boundary {x['boundary']}, the head ended {head['outcome']} at {head['boundary']}")
            elif (x["outcome"], x["boundary"]) != (head["outcome"], head["boundary"]):
                v.append(f"job {name}: rank {rank} ended {x['outcome']} at boundary {x['boundary']}, the head {head['outcome']} at {head['boundary']}")
        for r in gen.ranks[1:]:
            if r.rank not in per and r.gone_at is None and gen.killed_at is None and (head["outcome"], head["boundary"]) != ("cancel", -1):
                v.append(f"job {name}: rank {r.rank} is alive but has no receipt (the head: {head['outcome']} at {head['boundary']})")
        # Any rank's abort reason at boundary b ends the job at b at the latest.
        if head["outcome"] != "group_lost":
            for rank, ps in phases.items():
                for p in ps:
                    if p["job"] == name and p["phase"] == "reported" and p.get("abort") and p["b"] < head["boundary"]:
                        v.append(f"job {name}: rank {rank} reported an abort at boundary {p['b']}, the job went on to {head['boundary']}")
                        break
        corrupted = any(c[0] == gen.number and c[2] == name for c in self.corrupted)
        for rank, x in per.items():
            before, after = x.get("fingerprint_before"), x.get("fingerprint_after")
            if before is not None and after is not None and before != after and not corrupted:
                v.append(f"job {name}: rank {rank}'s frozen fingerprint changed without an injected corruption")
            if before is not None and after is None and x["outcome"] not in ("group_lost",):
                v.append(f"job {name}: rank {rank} has no fingerprint after the job")
        if head["outcome"] == "publish":
            for rank, x in per.items():
                if x.get("fingerprint_before") != x.get("fingerprint_after"):
                    v.append(f"job {name}: published although rank {rank}'s frozen fingerprint changed")
            if any(c[0] == gen.number and c[2] == name for c in self.corrupted):
                v.append(f"job {name}: published although the frozen weights changed during it")
        stop = self.sc.stop
        if stop and self.job_index(name) == stop[0]:
            after = [t for (tag, t) in gen.coll[0] if tag[0] == "T" and tag[1] == name and t > stop[1]]
            if len(after) > 1:
                v.append(f"job {name}: {len(after)} steps started after the STOP file appeared (t={stop[1]})")
        if head.get("kind") == "hotload":
            loaded = sorted(rank for rank, x in per.items() if x.get("loaded"))
            digests = {p["digest"] for ps in phases.values() for p in ps if p["phase"] == "load" and p["job"] == name}
            if self.sc.hot_differ is not None and loaded:
                v.append(f"hot-load {name}: ranks {loaded} loaded although rank {self.sc.hot_differ}'s staged bytes differ")
            if len(digests) > 1:
                v.append(f"hot-load {name}: ranks executed different digests {sorted(digests)}")
            src = _hot_source(name)
            genuine = {code_digest([(HOT_MODULE, b)])[:16] for b in (src, src + b"# changed after staging\n")}
            if digests - genuine:
                v.append(f"hot-load {name}: the agreed digest {sorted(digests)} is not of any staged version")
            for r in gen.ranks:
                ran = gen.modules[r.rank][HOT_MODULE]["LOADED"].count(name)
                if r.rank not in per:
                    # Gone before its receipt: it may have loaded the agreed bytes once.
                    if ran > 1 or (ran and not digests):
                        v.append(f"hot-load {name}: rank {r.rank} executed it {ran} times without an agreement")
                elif ran != (1 if r.rank in loaded else 0):
                    v.append(f"hot-load {name}: rank {r.rank} executed it {ran} times, its receipt says {'loaded' if r.rank in loaded else 'not loaded'}")
        return v

    def _check_authority(self, gen: SimGen, by_job: dict, phases: dict[int, list]) -> list[str]:
        v: list[str] = []
        for j in self.sc.jobs:
            if j["authority"] == AUTHORITY or self.job_gen.get(j["name"]) != gen.number:
                continue
            if any(p["phase"] == "start" and p["job"] == j["name"] for ps in phases.values() for p in ps):
                v.append(f"job {j['name']}: started without the authority")
            h = by_job.get(j["name"], {}).get(0)
            if h is not None and h["outcome"] != "refused":
                v.append(f"job {j['name']}: ran without the authority")
        return v

    def _check_serving(self, gen: SimGen) -> list[str]:
        """A chat waits at most one microbatch: at most one step starts
        between its arrival and its first serving iteration, and that
        iteration completes (on every live rank) within one step plus the
        boundary exchanges, plus any delay the scenario injected."""
        v: list[str] = []
        head_steps = [t for (tag, t) in gen.coll[0] if tag[0] == "T"]
        for cid, g in self.chat_gen.items():
            if g != gen.number:
                continue
            chat = self.chat_objs[cid]
            end_of_gen = min(x for x in (gen.ranks[0].gone_at, gen.killed_at, math.inf) if x is not None)
            if chat.first_served is None:
                if end_of_gen == math.inf:
                    v.append(f"chat {cid} (arrived t={chat.arrived:.3f}) was never served")
                continue
            done = chat.first_served
            missed = [r for r in gen.ranks[1:] if gen.serve_times.get(chat.first_msg, {}).get(r.rank) is None]
            if missed and gen.ranks[0].gone_at is not None:
                continue  # the head died before every rank ran the op: the chat died with the server
            for r in gen.ranks[1:]:
                t = gen.serve_times.get(chat.first_msg, {}).get(r.rank)
                if t is not None:
                    done = max(done, t)
                elif r.gone_at is None and gen.killed_at is None:
                    done = math.inf
                else:
                    done = max(done, min(x for x in (r.gone_at, gen.killed_at) if x is not None))
            started = sum(1 for t in head_steps if chat.arrived < t < chat.first_served)
            if started > 1:
                v.append(f"chat {cid} waited through {started} microbatches (arrived t={chat.arrived:.3f})")
            bound = STEP_MAX + 2 * TIMEOUTS.exchange + TIMEOUTS.pause + 0.2 + self._overlap(chat.arrived, min(done, chat.arrived + 1e3))
            if done - chat.arrived > bound:
                v.append(f"chat {cid} waited {done - chat.arrived:.3f}s (bound {bound:.3f}s, arrived t={chat.arrived:.3f})")
        return v

    def _check_publish(self, gen: SimGen) -> list[str]:
        """Serving sees a job's block only when it publishes: the same jobs
        at the same serving messages on every rank."""
        v: list[str] = []
        head = gen.ranks[0].server.published
        for r in gen.ranks[1:]:
            mine = r.server.published
            n = min(len(head), len(mine))
            short = len(mine) < len(head) and r.gone_at is None and gen.killed_at is None
            if head[:n] != mine[:n] or len(mine) > len(head) or short:
                v.append(f"generation {gen.number}: rank {r.rank} published {mine}, the head {head}")
        return v

    def _check_hangs(self, gen: SimGen, phases: dict[int, list]) -> list[str]:
        """Nothing waits past its timeout; workers leave a group whose head
        died; at the end every live rank is idle and no job key is left."""
        v: list[str] = []
        for rank, ps in phases.items():
            for p in ps:
                if p["phase"] == "timeout":
                    slack = 0.05 + self._overlap(p["deadline"], p["deadline"] + p["late"] + 1e-9)
                    if p["late"] > slack:
                        v.append(f"rank {rank}: a wait ran {p['late']:.3f}s past its deadline (slack {slack:.3f}s)")
        if gen.head_dead_at is not None and gen.killed_at is None:
            for r in gen.ranks[1:]:
                limit = TIMEOUTS.group + TIMEOUTS.decision + 0.5 + self._overlap(gen.head_dead_at, gen.head_dead_at + 60)
                if r.gone_at is None:
                    v.append(f"generation {gen.number}: rank {r.rank} still running after its head died")
                elif r.gone_at - gen.head_dead_at > limit:
                    v.append(f"generation {gen.number}: rank {r.rank} left {r.gone_at - gen.head_dead_at:.3f}s after its head died")
        if gen is self.gen and gen.killed_at is None:
            for r in gen.ranks:
                if r.gone_at is not None or r.refused:
                    continue
                s = r.server
                if isinstance(s, HeadServer) and (s.job is not None or s.queue or s.closing or s.outbox or s.live or s.waiting):
                    state = s.job.state if s.job is not None else "-"
                    v.append(f"the head is still busy at the end (job state {state}, {len(s.closing)} closing, {len(s.live)} live chats)")
                if isinstance(s, WorkerServer) and s.job is not None:
                    v.append(f"rank {r.rank} is still in job {s.job.spec.name} (state {s.job.state}) at the end")
            if gen.ranks[0].gone_at is None:
                left = [k for k in gen.store.keys() if k.startswith("rt/") and not k.endswith("/closed")]
                if left:
                    v.append(f"generation {gen.number}: keys of finished jobs remain: {left[:4]}")
        return v

    def _check_checkpoint(self, published: set[tuple[str, str]]) -> list[str]:
        """The last good checkpoint is intact and names a published job."""
        store = CheckpointStore(self.fs, "/ckpt")
        m = store.last_good()
        if m is None:
            return []
        v = []
        for r in range(self.sc.world):
            try:
                store.load(r)
            except CorruptCheckpoint as exc:
                v.append(f"the last good checkpoint is broken: {exc}")
        if (m.group, m.name) not in published and not self.sc.ckpt_crash:
            v.append(f"the last good checkpoint names job {m.name} of {m.group}, which was not published")
        return v

    def _check_recovery(self) -> list[str]:
        """A healthy group is left alone; a fenced owner changes nothing;
        generations run with increasing tokens."""
        v = []
        for rec in self.recoveries:
            if rec["action"] == "none" and rec["changed"]:
                v.append(f"recovery ({rec['owner']}, t={rec['t']:.3f}) found the group healthy yet changed its state")
            if rec["action"] == "restarted" and rec["healthy"] and rec["owner"] == "A" and rec["stalled"] is None:
                v.append(f"recovery ({rec['owner']}, t={rec['t']:.3f}) restarted a healthy group")
        live = [g for g in self.gens if not g.refused]
        tokens = [g.token for g in sorted(live, key=lambda g: g.number)]
        if tokens != sorted(set(tokens)):
            v.append(f"generations ran with tokens {tokens}, not strictly increasing")
        return v

    def coverage(self) -> collections.Counter:
        """What this run exercised: injected faults, kills that fired (and on
        which side), job outcomes by boundary kind, notable phases, recovery
        actions. Sweeps add these up to show every case was reached."""
        c: collections.Counter = collections.Counter()
        sc = self.sc
        for name in ("never_join", "late_start", "breach", "stop", "outage", "corrupt", "ckpt_crash", "stall",
                     "stale_owner", "hot_differ", "hot_change"):
            if getattr(sc, name) is not None:
                c[f"fault:{name}"] += 1
        if sc.store_err_p:
            c["fault:store_errors"] += 1
        if sc.store_slow_p:
            c["fault:store_timeouts"] += 1
        for fired in self.fired:
            kind, what = fired.split(":")
            rank = sc.ckpt_crash[0] if kind == "ckpt_crash" else sc.death["rank"]
            c[f"{kind}:{'head' if rank == 0 else 'worker'}:{what}"] += 1
        for g in self.gens:
            receipts, phases = self._records(g)
            for rs in receipts.values():
                for x in rs:
                    c[f"outcome:{x['outcome']}:{boundary_kind_of(x)}"] += 1
            for ps in phases.values():
                for p in ps:
                    if p["phase"] in COVERED_PHASES:
                        c[f"phase:{p['phase']}"] += 1
        for rec in self.recoveries:
            c[f"recovery:{rec['action']}"] += 1
        return c

    def digest(self) -> str:
        """A digest of everything observable: equal digests mean equal runs."""
        h = hashlib.sha256()
        for path in sorted(self.fs.files):
            h.update(path.encode() + b"\0" + self.fs.files[path] + b"\0")
        for gen in self.gens:
            h.update(repr(sorted(gen.coll.items())).encode())
            h.update(repr(sorted(gen.store.data.items())).encode())
        return h.hexdigest()


def boundary_kind_of(receipt: dict) -> str:
    """The kind of boundary a receipt's job ended at (see job.boundary_kind)."""
    b, last = receipt.get("boundary"), receipt.get("last")
    if b is None or last is None:
        return "-"
    if b == -1:
        return "seal"
    if receipt.get("kind") == "hotload":
        return "load" if b == 0 else "loaded"
    return "step" if b < last - 1 else ("verify" if b == last - 1 else "commit")


def run_seed(seed: int, world: int | None = None, variant: str | None = None) -> SimResult:
    """Run one seed and check it."""
    sim = Simulation(seed, world, variant)
    sim.run()
    violations = sim.check()
    stats = {
        "generations": len(sim.gens),
        "virtual_seconds": round(sim.now, 3),
        "recoveries": [r["action"] for r in sim.recoveries],
    }
    return SimResult(seed, sim.sc.world, variant, violations, sim.digest(), stats, sim.coverage())


def _sweep_chunk(args: tuple[int, int, int | None, str | None]) -> tuple[list[tuple[int, int, list[str]]], dict[str, int]]:
    start, stop, world, variant = args
    bad, cov = [], collections.Counter()
    for seed in range(start, stop):
        r = run_seed(seed, world, variant)
        cov.update(r.coverage)
        if not r.ok:
            bad.append((r.seed, r.world, r.violations))
    return bad, dict(cov)


def parallel_sweep(start: int, count: int, worlds: Sequence[int | None] = (None,), variant: str | None = None,
                   processes: int = 2) -> SweepReport:
    """Run seeds [start, start+count) for each world size in `worlds` over
    `processes` worker processes."""
    t0 = time.perf_counter()
    tasks = []
    chunk = max(1, count // (max(processes, 1) * 8))
    for world in worlds:
        tasks += [(s, min(s + chunk, start + count), world, variant) for s in range(start, start + count, chunk)]
    bad: list[tuple[int, int, list[str]]] = []
    cov: collections.Counter = collections.Counter()
    if processes <= 1:
        results = map(_sweep_chunk, tasks)
        for b, c in results:
            bad.extend(b)
            cov.update(c)
    else:
        import multiprocessing as mp

        # spawn: the caller may hold threads (a fork could copy a held lock).
        with mp.get_context("spawn").Pool(processes) as pool:
            for b, c in pool.imap_unordered(_sweep_chunk, tasks):
                bad.extend(b)
                cov.update(c)
    return SweepReport(sorted(bad), cov, count * len(worlds), time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resident_trainer.protocol.sim",
                                description="Seeded simulation of the coordination protocol.")
    p.add_argument("--seed", type=int, help="replay one seed: print its scenario and violations")
    p.add_argument("--seeds", type=int, default=1000, help="sweep this many seeds, from --start")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--world", type=int, choices=(2, 3), default=None, help="ranks (default: chosen by the seed)")
    p.add_argument("--variant", choices=VARIANTS, default=None, help="run a deliberately broken variant")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--coverage", action="store_true", help="print what the sweep exercised")
    a = p.parse_args(argv)
    if a.seed is not None:
        sim = Simulation(a.seed, a.world, a.variant)
        for k, val in sim.sc.__dict__.items():
            print(f"{k}: {json.dumps(val, default=str)}")
        sim.run()
        violations = sim.check()
        print(f"seed {a.seed} world {sim.sc.world}: {len(violations)} violation(s); digest {sim.digest()[:16]}")
        for line in violations:
            print(" -", line)
        return 1 if violations else 0
    rep = parallel_sweep(a.start, a.seeds, (a.world,), a.variant, a.processes)
    print(f"{rep.runs} seeds in {rep.seconds:.1f}s ({rep.rate:.0f} seeds/s), {len(rep.failures)} failing")
    if a.coverage:
        for key in sorted(rep.coverage):
            print(f"  {key}: {rep.coverage[key]}")
    for seed, world, vs in rep.failures[:20]:
        print(f"seed {seed} world {world}: {vs[0]}")
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
