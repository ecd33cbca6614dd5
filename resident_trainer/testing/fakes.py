"""The simulated world the production machines run in: a store hosted by
the head with latency and injected faults, the ordered serving broadcast,
files with crash points, virtual clocks, a job body whose steps are
collectives, the serving backend and the chat source."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from resident_trainer.protocol.errors import LinkClosed, PeerLost, StoreTimeout, StoreUnavailable
from resident_trainer.protocol.fs import MemoryFileSystem
from resident_trainer.protocol.job import JobSpec
from resident_trainer.protocol.serving import Chat, OpKind, ServingOp
from resident_trainer.protocol.store import MemoryKVStore
from resident_trainer.testing.scenario import SLOW_OP, STEP_MAX, TIMEOUTS

if TYPE_CHECKING:
    from resident_trainer.testing.simulation import SimGen, Simulation


class Killed(BaseException):
    """A simulated kill -9: not an Exception, so no handler in the code under
    test can catch it."""


def hot_source(job: str) -> bytes:
    """The staged hot-load source of `job`: it records its own execution."""
    return f"LOADED.append({job!r})\n".encode()


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
                raise Killed()
            return True
        return False

    def _post(self, die: bool) -> None:
        sim = self.sim
        if sim.current is None:
            return
        if die:
            raise Killed()
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
        if (
            data is not None
            and sim.sc.hot_differ is not None
            and sim.current == sim.sc.hot_differ
            and "/staged/" in path
        ):
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
            raise Killed()


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


class Blocked(BaseException):
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
                    sim.mismatches.append(
                        f"generation {gen.number}: collective {k}: rank {self.rank} entered {tag}, rank {peer.rank} {theirs[k][0]}"
                    )
                    raise PeerLost(f"collective {k} mismatched")
                continue
            if peer.dead or peer.lost_at is not None:
                self.entered = None
                raise PeerLost(f"rank {peer.rank} is gone")
            raise Blocked()
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
        self.trained = hashlib.sha256(
            f"{self.gen.block[self.rank]}|{self.spec.name}|{self.steps}".encode()
        ).hexdigest()[:16]
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
