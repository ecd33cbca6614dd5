"""Hypothesis state machines: the trainer channel, the fenced lock and the
memory budget, each run against a plain model of what it must do."""

import torch.distributed as dist
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from resident_trainer.integrations.torchdist.store import TorchKVStore
from resident_trainer.protocol.budget import BudgetMonitor, MemoryBudget, MemorySample
from resident_trainer.protocol.channel import ACK, DECISION, REPORT, SEAL, Record, TrainerChannel
from resident_trainer.protocol.errors import FencedOut
from resident_trainer.protocol.fs import MemoryFileSystem
from resident_trainer.protocol.lock import FencedLock
from resident_trainer.protocol.store import MemoryKVStore

LAST = 4  # last boundary of every job in the channel machine
jobs = st.integers(1, 3)
seqs = st.integers(SEAL, LAST)
workers = st.integers(1, 2)
bodies = st.dictionaries(
    st.sampled_from(["abort", "msg", "digest"]), st.none() | st.integers(0, 9) | st.text(max_size=3), max_size=2
)


class ChannelMachine(RuleBasedStateMachine):
    """Posts, claims, reads, deletes and purges in any order: the store holds
    exactly the model's records, claims keep their first writer, and a purged
    job leaves no key behind."""

    def make_store(self):
        return MemoryKVStore()

    def store_keys(self):
        return self.store.keys()

    def __init__(self):
        super().__init__()
        self.store = self.make_store()
        self.ch = TrainerChannel(self.store, group="g1", world=3)
        self.model: dict[str, Record] = {}

    @rule(job=jobs, seq=seqs, name=st.sampled_from([REPORT, ACK]), rank=workers, body=bodies)
    def post(self, job, seq, name, rank, body):
        rec = Record(job, seq, name, rank, body)
        self.model[self.ch.post(rec)] = rec

    @rule(job=jobs, seq=seqs, by=st.integers(0, 2), body=bodies)
    def claim(self, job, seq, by, body):
        rec = Record(job, seq, DECISION, 0, {**body, "by": by})
        key = self.ch.key(job, seq, DECISION, 0)
        won = self.ch.claim(rec)
        expected = self.model.setdefault(key, rec)
        assert won == expected

    @rule(job=jobs, seq=seqs, name=st.sampled_from([REPORT, ACK, DECISION]), rank=st.integers(0, 2))
    def read(self, job, seq, name, rank):
        key = self.ch.key(job, seq, name, rank)
        assert self.ch.read(job, seq, name, rank) == self.model.get(key)

    @rule(job=jobs, seq=seqs, name=st.sampled_from([REPORT, ACK]), rank=workers)
    def delete(self, job, seq, name, rank):
        self.ch.delete(job, seq, name, rank)
        self.model.pop(self.ch.key(job, seq, name, rank), None)

    @rule(job=jobs)
    def purge(self, job):
        self.ch.purge(job, LAST)
        self.model = {k: r for k, r in self.model.items() if r.job != job}
        assert not [k for k in self.store_keys() if k.startswith(f"rt/g1/j{job}/")]

    @invariant()
    def store_matches_model(self):
        assert self.store_keys() == sorted(self.model)


class ChannelOverHashStore(ChannelMachine):
    """The same machine through the torch adapter (compare_set reads and creates)."""

    def make_store(self):
        return TorchKVStore(dist.HashStore())

    def store_keys(self):
        return self.store.keys()


class LockMachine(RuleBasedStateMachine):
    """Owners acquire, renew, release and write while the clock moves: at most
    one lease is valid at a time, tokens only grow, and only the current,
    unexpired lease's writes land."""

    owners = st.sampled_from(["A", "B", "C"])

    def __init__(self):
        super().__init__()
        self.t = 1000.0
        self.fs = MemoryFileSystem()
        self.lock = FencedLock(self.fs, "/state", self, lease_seconds=10.0)
        self.leases = {}  # owner -> every lease it was ever granted
        self.token, self.holder, self.expires = 0, None, 0.0
        self.written = None

    def now(self):
        return self.t

    def valid(self, lease):
        return lease.token == self.token and self.holder == lease.owner and self.expires > self.t

    @rule(dt=st.floats(0.0, 15.0))
    def advance(self, dt):
        self.t += dt

    @rule(owner=owners)
    def acquire(self, owner):
        lease = self.lock.acquire(owner)
        free = self.holder is None or self.expires <= self.t
        assert (lease is not None) == free
        if lease is not None:
            assert lease.token == self.token + 1
            self.token, self.holder, self.expires = lease.token, owner, lease.expires
            self.leases.setdefault(owner, []).append(lease)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def write(self, data):
        owner = data.draw(st.sampled_from(sorted(self.leases)))
        lease = data.draw(st.sampled_from(self.leases[owner]))
        payload = f"{lease.owner}:{lease.token}".encode()
        ok = self.valid(lease)
        try:
            self.lock.write_fenced(lease, "/state/group.json", payload)
            assert ok, f"a stale lease {lease} wrote"
            self.written = payload
        except FencedOut:
            assert not ok, f"the current lease {lease} was refused"

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def renew(self, data):
        lease = data.draw(st.sampled_from([x for ls in self.leases.values() for x in ls]))
        ok = self.valid(lease)
        try:
            renewed = self.lock.renew(lease)
            assert ok
            self.expires = renewed.expires
            self.leases[lease.owner].append(renewed)
        except FencedOut:
            assert not ok

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lease = data.draw(st.sampled_from([x for ls in self.leases.values() for x in ls]))
        current = lease.token == self.token and self.holder == lease.owner
        assert self.lock.release(lease) == current
        if current:
            self.holder, self.expires = None, 0.0

    @invariant()
    def agrees_with_model(self):
        st_ = self.lock.state()
        assert st_["token"] == self.token
        assert st_["owner"] == self.holder
        assert self.fs.read_bytes("/state/group.json") == self.written
        valid = [x for ls in self.leases.values() for x in ls if self.valid(x)]
        assert len({x.owner for x in valid}) <= 1


class BudgetMachine(RuleBasedStateMachine):
    """Samples in any order: the first breach is latched until reset, and the
    extremes are tracked."""

    @initialize(floor=st.integers(0, 1000), ceiling=st.integers(0, 1000))
    def setup(self, floor, ceiling):
        self.budget = MemoryBudget(floor, ceiling)
        self.next = MemorySample(10**6, 0)
        self.mon = BudgetMonitor(self.budget, lambda: self.next)
        self.first = None
        self.min_free = self.max_ws = None

    @rule(free=st.integers(0, 2000), ws=st.integers(0, 2000))
    def sample(self, free, ws):
        self.next = MemorySample(free, ws)
        self.mon.sample()
        if self.first is None and (free < self.budget.floor or ws > self.budget.ceiling):
            self.first = "free" if free < self.budget.floor else "workspace"
        self.min_free = free if self.min_free is None else min(self.min_free, free)
        self.max_ws = ws if self.max_ws is None else max(self.max_ws, ws)

    @rule()
    def reset(self):
        self.mon.reset()
        self.first = self.min_free = self.max_ws = None

    @invariant()
    def latched(self):
        if not hasattr(self, "mon"):
            return
        got = self.mon.breach()
        assert (got is None) == (self.first is None)
        if got is not None:
            assert got.startswith("free memory" if self.first == "free" else "workspace")
        assert (self.mon.min_free, self.mon.max_workspace) == (self.min_free, self.max_ws)


quick = settings(max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestChannel = ChannelMachine.TestCase
TestChannel.settings = quick
TestChannelOverHashStore = ChannelOverHashStore.TestCase
TestChannelOverHashStore.settings = settings(quick, max_examples=20)
TestLock = LockMachine.TestCase
TestLock.settings = settings(quick, max_examples=100)
TestBudget = BudgetMachine.TestCase
TestBudget.settings = quick
