"""The scenario of one seeded run: every random choice (world size, chat and
job arrivals, every injected fault), made up front from the seed, and the
simulation's fixed settings."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from resident_trainer.protocol.config import Timeouts
from resident_trainer.protocol.job import JobKind

AUTHORITY = "sim-authority"
STEP_MAX = 0.2  # longest simulated microbatch, seconds
SLOW_OP = 0.25  # a store operation that times out takes this long
TIMEOUTS = Timeouts(exchange=0.5, decision=1.5, pause=0.5, group=3.0, poll=0.02)
HOT_MODULE = "simhot"
#: Phases a rank can be killed in (logged by the machines).
DEATH_PHASES = ("start", "collect", "reported", "decided", "pause", "resume", "step", "load", "published")
VARIANTS = ("selfish_pause", "doorbell_stall", "lone_abort", "deaf_head")
#: The injected faults a scenario can carry (its attributes), as sweeps count them.
FAULTS = (
    "never_join",
    "late_start",
    "breach",
    "stop",
    "outage",
    "corrupt",
    "ckpt_crash",
    "stall",
    "stale_owner",
    "hot_differ",
    "hot_change",
)
#: Phases a sweep counts (they show a fault path was taken).
COVERED_PHASES = ("adopted", "timeout", "store_error", "group_lost", "refused_generation", "ignored_start", "pause")


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
            sc.jobs.append(
                {
                    "t": round(rng.uniform(0.0, 2.5), 4),
                    "name": f"job{i}",
                    "kind": kind.value,
                    "steps": rng.randint(1, 4),
                    "authority": auth,
                }
            )
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
                sc.death = {
                    "rank": rank,
                    "how": how,
                    "job": rng.randrange(njobs),
                    "phase": rng.choice(phases),
                    "b": rng.choice((-1, -1, 0, 1, 2)),
                }
                # The job must run, and reach the phase, for the rank to die there.
                job = sc.jobs[sc.death["job"]]
                job["authority"] = AUTHORITY
                if sc.death["phase"] == "load":
                    job["kind"] = JobKind.HOTLOAD.value
                    sc.death["b"] = min(sc.death["b"], 0)  # a hot-load loads at boundary 0
                if sc.death["phase"] in ("pause", "resume"):
                    job["kind"] = JobKind.TRAIN.value
                    sc.chats = sorted(
                        sc.chats + [(round(job["t"] + rng.uniform(0.01, 0.4), 4), rng.randint(1, 3)) for _ in range(3)]
                    )
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
