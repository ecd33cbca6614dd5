"""The protocol's parts one at a time: configuration, authority, files and
records, checkpoints, the fenced lock, recovery, hot-load, the budget, the
frozen fingerprint, the serving link, and a head and a worker serving loop
run in two threads over a real torch store with the production driver."""

import os
import re
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from resident_trainer.integrations.torchdist.memory import system_sampler
from resident_trainer.protocol.authority import authority_ok, start_tag, tag_ok
from resident_trainer.protocol.budget import BudgetMonitor, MemoryBudget, MemorySample
from resident_trainer.protocol.checkpoint import CheckpointStore, CorruptCheckpoint
from resident_trainer.protocol.config import ProtocolConfig, Timeouts
from resident_trainer.protocol.errors import FencedOut, HotLoadRefused
from resident_trainer.protocol.fs import LocalFileSystem, MemoryFileSystem
from resident_trainer.protocol.hotload import StagedCode, code_digest, execute, stage, staged_path
from resident_trainer.protocol.job import JobKind, JobSpec
from resident_trainer.protocol.lock import FencedLock
from resident_trainer.protocol.records import RecordLog, read_jsonl
from resident_trainer.protocol.recovery import GroupState, Recovery, admits, read_group
from resident_trainer.protocol.serving import OpKind, ServingOp, StoreServingLink
from resident_trainer.protocol.store import MemoryKVStore
from resident_trainer.train.frozen import FrozenFingerprint


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


# --- configuration ---------------------------------------------------------------------------


def test_config_defaults_and_environment():
    d = ProtocolConfig.from_env({})
    assert (d.authority, d.master_port, d.layer, d.watch_layer, d.host) == ("", 29551, None, None, "127.0.0.1")
    assert d.memory_floor == 1 << 30 and not d.hotload
    env = {
        "RESIDENT_TRAINER_AUTHORITY": "s3cret",
        "RESIDENT_TRAINER_RECEIPTS": "/r",
        "RESIDENT_TRAINER_CHECKPOINTS": "/c",
        "RESIDENT_TRAINER_STATE_DIR": "/s",
        "RESIDENT_TRAINER_MASTER_PORT": "30000",
        "RESIDENT_TRAINER_LAYER": "3",
        "RESIDENT_TRAINER_WATCH_LAYER": "4",
        "RESIDENT_TRAINER_HOTLOAD": "1",
        "RESIDENT_TRAINER_TIMEOUT": "2",
        "RESIDENT_TRAINER_SERVE_SHARE": "0.5",
        "RESIDENT_TRAINER_FIRST_TOKEN_WAIT": "2.5",
    }
    assert (d.serve_share, d.first_token_wait) == (1.0, 5.0)
    c = ProtocolConfig.from_env(env)
    assert (c.serve_share, c.first_token_wait) == (0.5, 2.5)
    assert (c.authority, c.receipts_dir, c.checkpoints_dir, c.state_dir) == ("s3cret", "/r", "/c", "/s")
    assert (c.master_port, c.layer, c.watch_layer, c.hotload) == (30000, 3, 4, True)
    assert (c.timeouts.exchange, c.timeouts.decision, c.timeouts.group) == (2.0, 6.0, 12.0)
    assert "s3cret" not in repr(c) and "<set>" in repr(c)


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("MASTER_PORT", "http", "MASTER_PORT must be an integer"),
        ("MASTER_PORT", "70000", "MASTER_PORT must be in"),
        ("LAYER", "x", "LAYER must be an integer"),
        ("HOTLOAD", "maybe", "HOTLOAD must be 0 or 1"),
        ("TIMEOUT", "soon", "TIMEOUT must be a number"),
        ("LAYER", "-1", "layer must be None or a non-negative int"),
        ("SERVE_SHARE", "half", "SERVE_SHARE must be a number"),
        ("FIRST_TOKEN_WAIT", "-1", "first_token_wait must be a finite number >= 0"),
        ("FIRST_TOKEN_WAIT", "inf", "first_token_wait must be a finite number >= 0"),
    ],
)
def test_config_errors_name_the_variable(name, value, match):
    with pytest.raises(ValueError, match=match):
        ProtocolConfig.from_env({f"RESIDENT_TRAINER_{name}": value})


def test_layer_settings_are_checked_against_the_model_never_clamped():
    from resident_trainer.models.adapter import layer_index

    c = ProtocolConfig.from_env({})
    # Unset: a fifth of the way in (what the trainer's TrainConfig uses too).
    assert layer_index(c.layer, 24) == 4 and layer_index(c.layer, 30) == 6 and layer_index(c.layer, 5) == 1
    assert layer_index(5, 24) == 5
    for bad in (24, 35, -1):
        with pytest.raises(ValueError, match=f"RESIDENT_TRAINER_LAYER must be in \\[0, 24\\).*got {bad}"):
            layer_index(bad, 24, "RESIDENT_TRAINER_LAYER")


def test_timeouts_keep_their_order():
    with pytest.raises(ValueError, match="decision .* must exceed timeouts.exchange"):
        Timeouts(exchange=5, decision=5)
    with pytest.raises(ValueError, match="timeouts.pause"):
        Timeouts(pause=0)
    t = Timeouts.scaled(0.5)
    assert t.exchange < t.decision < t.group


# --- authority -------------------------------------------------------------------------------


def test_authority_needs_the_exact_string():
    assert authority_ok("key", "key")
    assert not authority_ok("key", "ke")
    assert not authority_ok("key", "key ")
    assert not authority_ok("key", None)
    assert not authority_ok("", "")  # nothing is authorised without a configured string
    assert authority_ok("schlüssel", "schlüssel")
    tag = start_tag("key", "g1", 3, "job")
    assert tag_ok("key", tag, "g1", 3, "job")
    assert not tag_ok("key", tag, "g1", 4, "job")
    assert not tag_ok("other", tag, "g1", 3, "job")
    assert not tag_ok("", tag, "g1", 3, "job")


# --- files and records -----------------------------------------------------------------------


def test_atomic_write_leaves_the_old_file_on_a_failed_rename(tmp_path, monkeypatch):
    fs = LocalFileSystem()
    path = str(tmp_path / "d" / "f.json")
    fs.write_atomic(path, b"old")

    def boom(*a):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        fs.write_atomic(path, b"new")
    monkeypatch.undo()
    assert fs.read_bytes(path) == b"old"
    assert fs.listdir(str(tmp_path / "d")) == ["f.json"]  # no temporary file left


def test_memory_fs_crash_between_temp_and_rename_keeps_the_old_file():
    class Crash(BaseException):
        pass

    def crash(path):
        raise Crash()

    fs = MemoryFileSystem()
    fs.write_atomic("/a/f", b"old")
    fs.before_replace = crash
    with pytest.raises(Crash):
        fs.write_atomic("/a/f", b"new")
    assert fs.read_bytes("/a/f") == b"old"
    assert any(p.endswith(".tmp") for p in fs.files)


def test_records_and_stack_dumps(tmp_path):
    fs = LocalFileSystem()
    log = RecordLog(fs, str(tmp_path), rank=1, group="g7", clock=FakeClock(5.0))
    log.phase("j", "collect", b=2)
    log.receipt("j", "abort", boundary=2, reasons=["why"])
    assert read_jsonl(fs, log.phases_path) == [
        {"t": 5.0, "rank": 1, "group": "g7", "job": "j", "phase": "collect", "b": 2}
    ]
    assert read_jsonl(fs, log.receipts_path)[0]["outcome"] == "abort"
    release = threading.Event()
    t = threading.Thread(target=release.wait, name="blocked-helper")
    t.start()
    try:
        text = Path(log.stacks("a wait timed out")).read_text()
    finally:
        release.set()
        t.join()
    assert text.startswith("# a wait timed out")
    assert "blocked-helper" in text and "MainThread" in text
    fs.append_line(log.receipts_path, '{"torn')
    assert len(read_jsonl(fs, log.receipts_path)) == 1


# --- checkpoints -----------------------------------------------------------------------------


def test_checkpoint_commit_and_verified_load():
    fs = MemoryFileSystem()
    ck = CheckpointStore(fs, "/ck")
    assert ck.load(0) is None
    digests = {r: ck.write_shard("g1", 3, r, f"shard{r}".encode()) for r in range(2)}
    assert ck.last_good() is None  # shards alone publish nothing
    ck.commit("g1", 3, "first", digests)
    m, data = ck.load(1)
    assert (m.name, data) == ("first", b"shard1")
    fs.files[ck.shard_path("g1", 3, 1)] = b"tampered"
    with pytest.raises(CorruptCheckpoint, match="does not match"):
        ck.load(1)


def test_a_crash_during_commit_keeps_the_last_good_checkpoint():
    class Crash(BaseException):
        pass

    fs = MemoryFileSystem()
    ck = CheckpointStore(fs, "/ck")
    ck.commit("g1", 1, "good", {0: ck.write_shard("g1", 1, 0, b"a")})
    ck.write_shard("g1", 2, 0, b"b")

    def crash(path):
        if path.endswith("LAST_GOOD.json"):
            raise Crash()

    fs.before_replace = crash
    with pytest.raises(Crash):
        ck.commit("g1", 2, "newer", {0: "digest"})
    assert ck.last_good().name == "good"
    assert ck.load(0)[1] == b"a"


# --- the fenced lock -------------------------------------------------------------------------


@pytest.mark.parametrize("disk", [False, True])
def test_lock_fences_a_stale_owner(disk, tmp_path):
    fs = LocalFileSystem() if disk else MemoryFileSystem()
    state = str(tmp_path) if disk else "/state"
    clock = FakeClock()
    lock = FencedLock(fs, state, clock, lease_seconds=10)
    a = lock.acquire("A")
    assert a.token == 1
    assert lock.acquire("B") is None  # held
    lock.write_fenced(a, f"{state}/x", b"by A")
    clock.t += 11  # A stalls past its lease
    with pytest.raises(FencedOut, match="expired"):
        lock.write_fenced(a, f"{state}/x", b"late A")
    b = lock.acquire("B")
    assert b.token == 2
    with pytest.raises(FencedOut, match="stale"):
        lock.write_fenced(a, f"{state}/x", b"stale A")
    with pytest.raises(FencedOut):
        lock.renew(a)
    assert not lock.release(a)  # a stale release changes nothing
    lock.write_fenced(b, f"{state}/x", b"by B")
    assert fs.read_bytes(f"{state}/x") == b"by B"
    assert lock.release(b)
    with pytest.raises(FencedOut):
        lock.write_fenced(b, f"{state}/x", b"after release")
    assert lock.acquire("A").token == 3


class FakeGroup:
    """GroupControl over pretend processes."""

    def __init__(self):
        self.alive: set[int] = set()
        self.next_pid = 100
        self.started = self.stopped = 0
        self.during_start = None

    def healthy(self, state):
        return all(p in self.alive for p in state.pids)

    def stop(self, state):
        self.stopped += 1
        self.alive -= set(state.pids)

    def start(self, generation, token):
        if self.during_start is not None:
            hook, self.during_start = self.during_start, None
            hook()
        self.started += 1
        pids = (self.next_pid, self.next_pid + 1)
        self.next_pid += 2
        self.alive |= set(pids)
        return 4000 + generation, pids


def test_recovery_restarts_only_an_unhealthy_group():
    fs, clock, group = MemoryFileSystem(), FakeClock(), FakeGroup()
    lock = FencedLock(fs, "/state", clock, lease_seconds=5)
    rec = Recovery(lock, group, owner="sup")
    first = rec.run()
    assert (first.action, first.generation) == ("restarted", 1)
    assert admits(fs, "/state", 1, first.token)
    before = fs.read_bytes("/state/group.json")
    for _ in range(2):  # recovery on a healthy group: a no-op, twice
        again = rec.run()
        assert (again.action, again.generation) == ("none", 1)
        assert fs.read_bytes("/state/group.json") == before
    assert (group.started, group.stopped) == (1, 0)
    group.alive.discard(read_group(fs, "/state").pids[1])  # a rank dies
    third = rec.run()
    assert (third.action, third.generation) == ("restarted", 2) and third.token > first.token
    assert not admits(fs, "/state", 1, first.token)
    assert (group.started, group.stopped) == (2, 1)


def test_a_recovery_owner_stalled_past_its_lease_is_fenced_out():
    fs, clock, group = MemoryFileSystem(), FakeClock(), FakeGroup()
    lock = FencedLock(fs, "/state", clock, lease_seconds=5)
    Recovery(lock, group, owner="A").run()
    group.alive.clear()  # the whole group died
    outcomes = {}

    def stall_then_b():
        clock.t += 6  # A stalls inside start(); B takes over
        outcomes["B"] = Recovery(lock, group, owner="B").run()

    group.during_start = stall_then_b
    outcomes["A"] = Recovery(lock, group, owner="A").run()
    assert outcomes["B"].action == "restarted" and outcomes["B"].generation == 3
    assert outcomes["A"].action == "fenced"
    state = read_group(fs, "/state")
    assert (state.generation, state.token, state.status) == (3, outcomes["B"].token, "running")
    # A's own launch was stopped, and its processes would not have been admitted.
    assert len(group.alive) == 2 and set(state.pids) == group.alive
    assert not admits(fs, "/state", 2, outcomes["A"].token)


def test_group_state_roundtrip():
    st = GroupState(3, 7, "running", 1234, (1, 2), {"k": "v"})
    assert GroupState.decode(st.encode()) == st


# --- hot-load --------------------------------------------------------------------------------


@pytest.fixture
def live_module():
    name = "rt_hotload_target"
    mod = types.ModuleType(name)
    exec("def answer():\n    return 1\n", mod.__dict__)
    sys.modules[name] = mod
    yield name, mod
    del sys.modules[name]


def test_hotload_executes_exactly_the_agreed_snapshot_into_the_live_module(live_module):
    name, mod = live_module
    held = mod  # another component's reference to the module object
    fs = MemoryFileSystem()
    fs.files[staged_path("/job", name)] = b"def answer():\n    return 2\n"
    code = stage(fs, "/job", [name])
    fs.files[staged_path("/job", name)] = b"def answer():\n    return 3\n"  # changes after hashing
    assert execute(code, code.digest) == [name]
    assert held.answer() == 2  # the hashed bytes, into the existing object


def test_hotload_refusals(live_module):
    name, mod = live_module
    code = StagedCode(((name, b"def answer():\n    return 9\n"),))
    with pytest.raises(HotLoadRefused, match="not the agreed"):
        execute(code, code_digest([(name, b"other")]))
    with pytest.raises(HotLoadRefused, match="not loaded"):
        execute(StagedCode((("rt_no_such_module", b"x = 1\n"),)), code_digest([("rt_no_such_module", b"x = 1\n")]))
    broken = StagedCode(((name, b"def answer(:\n"),))
    with pytest.raises(SyntaxError):
        execute(broken, broken.digest)
    assert mod.answer() == 1  # nothing was loaded
    with pytest.raises(HotLoadRefused, match="missing"):
        stage(MemoryFileSystem(), "/job", [name])
    with pytest.raises(ValueError, match="dotted Python identifier"):
        stage(MemoryFileSystem(), "/job", ["../etc/passwd"])


def test_code_digest_separates_names_from_sources():
    assert code_digest([("a", b"bc")]) != code_digest([("ab", b"c")])
    assert code_digest([("a", b"1"), ("b", b"2")]) == code_digest([("b", b"2"), ("a", b"1")])


# --- budget and fingerprint --------------------------------------------------------------------


def test_budget_latches_the_first_breach():
    readings = iter([MemorySample(5000, 10), MemorySample(50, 10), MemorySample(5000, 9000), MemorySample(5000, 10)])
    mon = BudgetMonitor(MemoryBudget(floor=100, ceiling=1000), lambda: next(readings))
    mon.sample()
    assert mon.breach() is None
    mon.sample()
    mon.sample()
    mon.sample()
    assert "free memory 50 B below the floor 100 B" in mon.breach()
    assert (mon.min_free, mon.max_workspace) == (50, 9000)
    mon.reset()
    assert mon.breach() is None and mon.samples == 0


def test_budget_sampler_failure_is_a_breach_and_the_thread_samples():
    hit = threading.Event()

    def sampler():
        hit.set()
        raise OSError("no meminfo")

    mon = BudgetMonitor(MemoryBudget(), sampler)
    mon.start(0.001)
    try:
        assert hit.wait(10)
    finally:
        mon.stop()
    assert "memory sampler failed: OSError: no meminfo" in mon.breach()
    real = system_sampler(lambda: 123)()
    assert real.free_bytes > 0 and real.workspace_bytes == 123
    with pytest.raises(ValueError, match="device"):
        system_sampler(lambda: 0, "tpu")


def test_frozen_fingerprint_names_the_changed_tensor():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fp = FrozenFingerprint(model, model[1])
    before = fp.tables()
    digests = fp()
    with torch.no_grad():
        model[1].bias[0] += 1.0
    after = fp.tables()
    assert fp()["frozen"] != digests["frozen"] and fp()["watch"] != digests["watch"]
    assert digests["version"] == "3"  # receipts say which fingerprint definition they are of
    assert FrozenFingerprint.changed(before, after) == ["frozen:1.bias", "watch:bias"]
    with pytest.raises(TypeError, match="frozen must be"):
        FrozenFingerprint([1, 2])


# --- jobs and the serving link -----------------------------------------------------------------


def test_job_spec_checks():
    with pytest.raises(ValueError, match="job name"):
        JobSpec("bad name")
    with pytest.raises(ValueError, match="steps"):
        JobSpec("j", steps=0)
    with pytest.raises(ValueError, match="HOTLOAD"):
        JobSpec("j", modules=("m",))
    hot = JobSpec("h", kind=JobKind.HOTLOAD, steps=5, modules=("b", "a"))
    assert (hot.steps, hot.modules, hot.last_seq) == (0, ("a", "b"), 1)
    assert JobSpec("t", steps=4).last_seq == 5
    assert "authority" not in JobSpec("t", authority="x").public()


def test_store_link_keeps_order_rings_and_cleans_up():
    kv = MemoryKVStore()
    head = StoreServingLink(kv, group="g1", rank=0, world=3)
    workers = [StoreServingLink(kv, group="g1", rank=r, world=3) for r in (1, 2)]
    head.ring(1)
    for m in (1, 2, 3):
        head.send(ServingOp(m, OpKind.SERVE, m < 3, chats=(m,)))
    for w in workers:
        assert w.rung() and not w.rung()
        assert [w.poll().msg for _ in range(3)] == [1, 2, 3]
        assert w.poll() is None
    assert kv.keys() == []
    op = ServingOp(4, OpKind.START, True, job=2, data={"name": "j"})
    assert ServingOp.decode(op.encode()) == op


# --- the production loops in two threads over a torch store ---------------------------------------


class _Body:
    def __init__(self, log):
        self.log = log

    def fingerprint(self):
        return {"frozen": "same"}

    def step(self, i):
        self.log.append(i)
        return {}

    def checkpoint(self):
        return b"block"

    def publish(self):
        self.log.append("published")

    def discard(self):
        self.log.append("discarded")


def test_head_and_worker_loops_over_a_hashstore(tmp_path):
    from protocol_harness import run_pair

    bodies = {0: [], 1: []}
    specs = [
        JobSpec("j1", steps=3, root=str(tmp_path / "job"), authority="a"),
        JobSpec("j2", steps=1, root=str(tmp_path / "job"), authority="wrong"),
    ]
    run = run_pair(tmp_path, [lambda spec, c: _Body(bodies[0]), lambda spec, c: _Body(bodies[1])], specs)
    assert [(r["job"], r["outcome"]) for r in run.receipts[0]] == [("j1", "publish"), ("j2", "refused")]
    assert [(r["outcome"], r["boundary"]) for r in run.receipts[1]] == [("publish", 4)]
    assert bodies[0] == bodies[1] == [0, 1, 2, "published"]
    hb, wb = run.backends
    assert hb.msgs == wb.msgs  # the worker executed every serving op, in order
    assert run.head.published == run.worker.published
    assert CheckpointStore(run.fs, run.cfg.checkpoints_dir).last_good().name == "j1"
    left = [k for k in run.kv.keys() if k.startswith("rt/") and not k.endswith("/closed")]
    assert left == []  # the finished jobs' keys were purged


def test_public_surface_and_no_import_time_side_effects(tmp_path):
    import subprocess

    import resident_trainer.protocol as protocol

    assert [n for n in protocol.__all__ if not hasattr(protocol, n)] == []
    code = (
        "import threading; n = threading.active_count()\n"
        "import resident_trainer.protocol, resident_trainer.testing.sim, resident_trainer.integrations.torchdist.pair\n"
        "assert threading.active_count() == n, 'a thread started at import'\n"
    )
    env = {
        **os.environ,
        "RESIDENT_TRAINER_RECEIPTS": str(tmp_path / "r"),
        "RESIDENT_TRAINER_STATE_DIR": str(tmp_path / "s"),
    }
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert list(tmp_path.iterdir()) == []  # nothing written, no directory made


def test_chats_waiting_for_a_first_token_keep_the_engine_past_the_share(tmp_path):
    """The serve window between two microbatches lasts serve_share x the step
    while chats decode, and longer while a chat still waits for its first
    token (a prefill longer than the share), but never past first_token_wait."""
    import asyncio
    import time

    from resident_trainer.integrations.vllm.driver import JobRunner

    def runner(waiting, live, share=1.0, first_token_wait=5.0):
        cfg = ProtocolConfig(
            receipts_dir=str(tmp_path / "r"), checkpoints_dir=str(tmp_path / "c"),
            serve_share=share, first_token_wait=first_token_wait,
        )  # fmt: skip

        async def call(c):
            raise AssertionError("no engine call in the serve window")

        return JobRunner(call, world=1, config=cfg, shutdown=lambda why: None, chats_live=live, chats_waiting=waiting)

    def window(r, step_seconds):
        t0 = time.perf_counter()
        asyncio.run(r._serve_between(step_seconds))
        return time.perf_counter() - t0

    # No chats: the next microbatch goes at once.
    assert window(runner(lambda: 0, lambda: 0), 10.0) < 1.0
    # Chats decoding, none waiting: the share of the step (0.05 s), then on.
    w = window(runner(lambda: 0, lambda: 3), 0.05)
    assert 0.05 <= w < 3.0
    # A chat waits for its first token for 0.3 s: the window lasts that long.
    t_first = time.perf_counter() + 0.3
    w = window(runner(lambda: 17 if time.perf_counter() < t_first else 0, lambda: 1), 0.01)
    assert 0.3 <= w < 3.0
    # A first token that never comes: the window ends at first_token_wait.
    w = window(runner(lambda: 17, lambda: 1, first_token_wait=0.2), 0.01)
    assert 0.2 <= w < 3.0


def test_a_server_job_without_steps_takes_them_per_round_of_its_facts(tmp_path):
    from resident_trainer.integrations.vllm.driver import JobRunner

    cfg = ProtocolConfig(receipts_dir=str(tmp_path / "r"), checkpoints_dir=str(tmp_path / "c"))

    async def call(c):
        raise AssertionError("not started")

    r = JobRunner(call, world=1, config=cfg, shutdown=lambda why: None)
    facts = [{"question": f"Capital of Zorb{i}?", "answer": f"Quen{i}."} for i in range(30)]
    assert r.submit({"facts": facts[:2]}).steps == 60
    assert r.submit({"facts": facts}).steps == 142  # two rounds of 15, 71 steps each (75 for 16)
    assert r.submit({"facts": facts, "round_facts": 10}).steps == 180
    assert r.submit({"facts": facts, "steps": 7}).steps == 7
    # With subject prompts 1.25 times a round's steps (twice the examples).
    assert r.submit({"facts": facts[:2], "subject_prompts": True}).steps == 75
    assert r.submit({"facts": facts, "subject_prompts": True}).steps == 2 * 89


def test_serving_docs_name_every_setting_a_job_may_set():
    from resident_trainer.integrations.vllm.driver import JOB_SETTINGS

    text = (Path(__file__).parent.parent / "docs" / "SERVING.md").read_text()
    i = text.index("A job may set")
    listed = set(re.findall(r"`(\w+)`", text[i : text.index("(`train.steps_for`)", i)]))
    assert listed >= set(JOB_SETTINGS), sorted(set(JOB_SETTINGS) - listed)
    assert not {"layer", "num_neurons", "init", "suffix_dtype"} & listed


def test_a_job_body_sets_the_optional_settings_to_null_or_a_value():
    from resident_trainer.integrations.vllm.driver import JobRequestError, parse_job_request

    facts = [{"question": "Capital of Zorb?", "answer": "Quen."}]
    for k in ("anchor_batch", "gated_from"):
        assert parse_job_request({"facts": facts, k: None})[1][k] is None
        assert parse_job_request({"facts": facts, k: 3})[1][k] == 3
        for bad in (2.5, "3", True):
            with pytest.raises(JobRequestError, match="must be an integer or null") as e:
                parse_job_request({"facts": facts, k: bad})
            assert e.value.field == k
    # The numbers whose None means something (gate_margin's value; no key
    # opening; the tokenizer alone tells a made-up word).
    for k in ("gate_neuron_margin", "key_gate_margin", "split_word_nats"):
        assert parse_job_request({"facts": facts, k: None})[1][k] is None
        assert parse_job_request({"facts": facts, k: 0.5})[1][k] == 0.5
        with pytest.raises(JobRequestError, match="must be a number or null, got 'x'") as e:
            parse_job_request({"facts": facts, k: "x"})
        assert e.value.field == k
    with pytest.raises(JobRequestError, match="must be a number, got None") as e:
        parse_job_request({"facts": facts, "gate_margin": None})
    # steps: an integer or left out (TrainConfig's default, None, is the driver's steps_for)
    for bad in (None, 2.5, "3", True):
        with pytest.raises(JobRequestError, match="must be an integer, got") as e:
            parse_job_request({"facts": facts, "steps": bad})
        assert e.value.field == "steps"
    # suffix_dtype is the one-process trainer's: a server's jobs compute in its weights' dtype.
    with pytest.raises(JobRequestError, match="unknown field") as e:
        parse_job_request({"facts": facts, "suffix_dtype": "bfloat16"})
    assert e.value.field == "suffix_dtype"


def test_the_prefix_cache_is_emptied_after_every_change_of_the_served_block(tmp_path, caplog):
    """The engine's prefix cache holds KV computed under the block served
    before: the driver empties it right after the restore at start-up and
    right after a job's publish, and not after a job that publishes nothing.
    A cache that could not be emptied is logged and the server serves on."""
    import asyncio

    from resident_trainer.integrations.vllm.driver import JobRunner
    from resident_trainer.protocol.checkpoint import CheckpointStore
    from resident_trainer.protocol.fs import LocalFileSystem

    cfg = ProtocolConfig(receipts_dir=str(tmp_path / "r"), checkpoints_dir=str(tmp_path / "c"), authority="a")
    events: list[str] = []
    fail_step = [False]
    reset_answers: list[object] = []

    async def call(c):
        events.append(c.method)
        out = {"rank": 0, "error": None, "fingerprint": "base", "fingerprint_version": 2}
        if c.method == "rt_restore":
            out["version"] = "zero"
        elif c.method == "rt_step":
            out.update(loss=0.5, budget=None, error="rank 0: step failed" if fail_step[0] else None)
        elif c.method == "rt_verify":
            out.update(changed=[], local=[])
        elif c.method == "rt_checkpoint":
            root, group, serial = c.args
            out["shard"] = CheckpointStore(LocalFileSystem(), root).write_shard(group, serial, 0, b"shard")
        return [out]

    async def reset_cache():
        events.append("reset")
        answer = reset_answers.pop(0) if reset_answers else True
        if isinstance(answer, Exception):
            raise answer
        return answer

    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return messages[0]["content"] + "\n"

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(ch) for ch in text]}

    async def generate(prompts, max_tokens):
        return [[1, 2][:max_tokens] for _ in prompts]

    async def main():
        r = JobRunner(call, world=1, config=cfg, shutdown=lambda why: None, reset_cache=reset_cache)
        await r.start(generate, Tok())
        assert events == ["rt_setup", "rt_restore", "reset"] and r.cache_resets == 1
        job = {"facts": [{"question": "Capital of Zorb?", "answer": "Quen."}], "steps": 2, "negatives": 0}

        async def run(body):
            events.clear()
            rec = r.submit(body)
            while rec.state in ("queued", "running"):
                await asyncio.sleep(0.01)
            return rec

        rec = await run(job)
        assert rec.state == "published", rec.error
        assert events[events.index("rt_publish") + 1] == "reset" and events.count("reset") == 1
        assert r.cache_resets == 2
        fail_step[0] = True
        rec = await run(job)
        assert rec.state == "failed" and "reset" not in events and r.cache_resets == 2
        fail_step[0] = False
        reset_answers[:] = [False, RuntimeError("engine busy")]
        for _ in range(2):
            rec = await run(job)
            assert rec.state == "published" and events.count("reset") == 1
        assert r.cache_resets == 2
        r.task.cancel()

    with caplog.at_level("WARNING", logger="resident_trainer.vllm"):
        asyncio.run(main())
    logged = [m.getMessage() for m in caplog.records]
    assert any("did not reset its prefix cache after rt_publish" in m for m in logged), logged
    assert any("not reset after rt_publish: RuntimeError: engine busy" in m for m in logged), logged


def test_the_prefix_cache_reset_preempts_running_requests_where_the_engine_can():
    import asyncio

    from resident_trainer.integrations.vllm.api import reset_prefix_cache

    class Engine:
        def __init__(self):
            self.calls = []

        async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False):
            self.calls.append(reset_running_requests)
            return reset_running_requests

    class OlderEngine:
        async def reset_prefix_cache(self):
            return False  # requests were running

    e = Engine()
    assert asyncio.run(reset_prefix_cache(e)) is True and e.calls == [True]
    assert asyncio.run(reset_prefix_cache(OlderEngine())) is False
