"""The scheduler: generations of the rank group, the seeded event timeline,
recovery under the fenced lock, and ticking every rank's production machine
on virtual time until the run settles."""

from __future__ import annotations

import collections
import heapq
import math
import random
import traceback
from dataclasses import dataclass, field
from typing import Any

from resident_trainer.protocol.budget import BudgetMonitor, MemoryBudget, MemorySample
from resident_trainer.protocol.channel import TrainerChannel
from resident_trainer.protocol.checkpoint import CheckpointStore, CorruptCheckpoint
from resident_trainer.protocol.config import ProtocolConfig
from resident_trainer.protocol.hotload import staged_path
from resident_trainer.protocol.job import JobKind, JobSpec, RankContext
from resident_trainer.protocol.lock import FencedLock
from resident_trainer.protocol.records import RecordLog
from resident_trainer.protocol.recovery import GroupState, Recovery, admits
from resident_trainer.protocol.server import HeadServer
from resident_trainer.protocol.serving import Chat
from resident_trainer.testing.checker import InvariantChecks
from resident_trainer.testing.fakes import (
    Blocked,
    Killed,
    SimBackend,
    SimBody,
    SimChats,
    SimClock,
    SimFS,
    SimLink,
    SimStore,
    SupervisorClock,
    hot_source,
)
from resident_trainer.testing.scenario import AUTHORITY, HOT_MODULE, TIMEOUTS, VARIANTS, Scenario
from resident_trainer.testing.variants import BROKEN_WORKERS, DeafHead, SimWorker


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


class Simulation(InvariantChecks):
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
        self.config = ProtocolConfig(
            authority=AUTHORITY,
            receipts_dir="/receipts",
            checkpoints_dir="/ckpt",
            state_dir="/state",
            hotload=True,
            timeouts=TIMEOUTS,
        )
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
            if (
                self.job_index(line.get("job")) == d["job"]
                and line.get("phase") == d["phase"]
                and (line.get("b") is None or line.get("b") >= d["b"])
            ):
                self.fired.append(f"death:{d['phase']}")
                raise Killed()

        return hook

    def start_gen(self, number: int, token: int) -> SimGen:
        world = self.sc.world
        gen = SimGen(number, token, world, started_at=self.now)
        gen.store = SimStore(self, gen)
        gen.link = SimLink(self, gen)
        ckpts = CheckpointStore(self.fs, "/ckpt")
        variant_worker = BROKEN_WORKERS.get(self.variant or "", SimWorker)
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
            log = RecordLog(
                self.fs,
                "/receipts",
                rank=r,
                group=gen.group,
                clock=clock,
                stack_dumper=lambda: "(simulated stacks)\n",
                on_phase=self._on_phase(gen, r),
            )
            monitor = BudgetMonitor(MemoryBudget(floor=100, ceiling=1000), self._sampler(r))
            ctx = RankContext(
                rank=r,
                world=world,
                group=gen.group,
                channel=TrainerChannel(gen.store, group=gen.group, world=world),
                clock=clock,
                fs=self.fs,
                log=log,
                config=self.config,
                budget=monitor,
                checkpoints=ckpts,
                modules=gen.modules[r],
            )
            factory = self._factory(gen)
            if r == 0:
                cls = DeafHead if self.variant == "deaf_head" else HeadServer
                server = cls(
                    ctx, link=gen.link, backend=SimBackend(self, gen, r), chats=gen.chats, body_factory=factory
                )
            else:
                server = variant_worker(
                    self, ctx, link=gen.link.view(r), backend=SimBackend(self, gen, r), body_factory=factory
                )
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
        self.recoveries.append(
            {
                "owner": owner,
                "t": self.now,
                "action": res.action,
                "healthy": healthy,
                "changed": before != after,
                "generation": res.generation,
                "token": res.token,
                "stalled": stall_at,
            }
        )

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
            spec = JobSpec(
                arg["name"],
                JobKind(arg["kind"]),
                arg["steps"],
                f"/jobs/{arg['name']}",
                arg["authority"],
                (HOT_MODULE,) if arg["kind"] == "hotload" else (),
            )
            if spec.kind is JobKind.HOTLOAD:
                self.fs.files[staged_path(spec.root, HOT_MODULE)] = hot_source(spec.name)
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
        except Blocked:
            r.wake_at = None
        except Killed:
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
                ranks = [
                    r
                    for r in gen.ranks
                    if not r.dead and not r.refused and r.lost_at is None and r.ready_at <= self.now
                ]
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
        return f"python -m resident_trainer.testing.sim --seed {self.seed} --world {self.world}{v}"


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
