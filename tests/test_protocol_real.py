"""Real processes: a pair of ranks (gloo on loopback, a real TCPStore, the
minimal serving loop of resident_trainer.integrations.torchdist.pair) started and
restarted by recovery under the fenced lock, then killed with SIGKILL.

Every rank is a child of this test process, started with PR_SET_PDEATHSIG,
and the fixture kills whatever is left, so no process outlives a test even
when it fails. Timeouts below are upper bounds only."""

import os
import signal
import threading
import time

import pytest

from resident_trainer.integrations.torchdist.client import PairClient
from resident_trainer.integrations.torchdist.control import ProcessGroupControl
from resident_trainer.integrations.torchdist.pair import EXIT_LOST
from resident_trainer.integrations.torchdist.procs import pid_alive
from resident_trainer.protocol.checkpoint import CheckpointStore
from resident_trainer.protocol.clock import WallClock
from resident_trainer.protocol.config import ProtocolConfig
from resident_trainer.protocol.fs import LocalFileSystem
from resident_trainer.protocol.job import JobKind, JobSpec
from resident_trainer.protocol.lock import FencedLock
from resident_trainer.protocol.records import read_jsonl
from resident_trainer.protocol.recovery import Recovery

AUTH = "pair-test-authority"


def wait_for(pred, timeout, what):
    """Poll `pred` until it returns something truthy; fail after `timeout` s."""
    tick = threading.Event()
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        tick.wait(0.02)


@pytest.fixture
def pair(tmp_path):
    env = {
        **os.environ,
        "RESIDENT_TRAINER_AUTHORITY": AUTH,
        "RESIDENT_TRAINER_STATE_DIR": str(tmp_path / "state"),
        "RESIDENT_TRAINER_RECEIPTS": str(tmp_path / "receipts"),
        "RESIDENT_TRAINER_CHECKPOINTS": str(tmp_path / "checkpoints"),
        "RESIDENT_TRAINER_TIMEOUT": "1.0",
        "RESIDENT_TRAINER_LAYER": "3",
        "RESIDENT_TRAINER_WATCH_LAYER": "5",
        "RESIDENT_TRAINER_HOTLOAD": "1",
    }
    control = ProcessGroupControl(env=env)
    lock = FencedLock(LocalFileSystem(), env["RESIDENT_TRAINER_STATE_DIR"], WallClock(), lease_seconds=60)
    recovery = Recovery(lock, control, owner=f"test-{os.getpid()}")
    started: list[int] = []
    control_start = control.start

    def start(generation, token):
        port, pids = control_start(generation, token)
        started.extend(pids)
        return port, pids

    control.start = start
    try:
        yield type(
            "Pair",
            (),
            {
                "env": env,
                "control": control,
                "recovery": recovery,
                "tmp": tmp_path,
                "cfg": ProtocolConfig.from_env(env),
                "started": started,
            },
        )
    finally:
        control.close()
        assert not [pid for pid in started if pid_alive(pid)], "a rank outlived its test"


def _receipts(p, rank):
    return read_jsonl(LocalFileSystem(), str(p.tmp / "receipts" / f"rank{rank}" / "receipts.jsonl"))


def _phases(p, rank):
    return read_jsonl(LocalFileSystem(), str(p.tmp / "receipts" / f"rank{rank}" / "phases.jsonl"))


def _receipt(p, rank, job):
    return next((r for r in _receipts(p, rank) if r["job"] == job), None)


def test_worker_killed_mid_job_head_cancels_the_job_and_keeps_serving(pair):
    first = pair.recovery.run()
    assert (first.action, first.generation) == ("restarted", 1)
    state = pair.recovery.state()
    head_pid, worker_pid = state.pids
    client = PairClient("127.0.0.1", state.port)
    assert client.reply(client.chat(), 60)["generation"] == 1

    client.submit(JobSpec("long", steps=100_000, root=str(pair.tmp / "job"), authority=AUTH))
    wait_for(
        lambda: any(x["job"] == "long" and x["phase"] == "step" and x["b"] >= 3 for x in _phases(pair, 1)),
        60,
        "the worker to be training",
    )
    os.kill(worker_pid, signal.SIGKILL)
    killed_at = time.monotonic()

    receipt = wait_for(lambda: _receipt(pair, 0, "long"), 30, "the head's receipt")
    # The receipt's clock is the head's CLOCK_MONOTONIC, the same clock as ours.
    took = receipt["t"] - killed_at
    assert receipt["outcome"] == "abort", receipt
    # The protocol's bound is the exchange timeout (the head stops waiting for
    # the dead worker's report then); measured 14-22 ms when the kill lands in
    # a step (the all-reduce fails at once), 1.006 s between steps. The margin
    # is one more exchange timeout, for a step already running and for
    # scheduling: with both cores of a 2-core box kept busy by other processes
    # the worst of 8 runs was 1.007 s.
    bound = 2 * pair.cfg.timeouts.exchange
    print(f"head cancelled the job {took:.3f}s after the kill")
    assert 0 <= took <= bound, f"the head took {took:.2f}s to cancel the job (bound {bound}s)"
    assert any("rank 1" in why or "rank 0: step" in why for why in receipt["reasons"]), receipt["reasons"]
    assert 3 <= receipt["steps"] < 100_000

    # The head keeps serving, on its own, in the same process.
    reply = client.reply(client.chat(2), 30)
    assert reply["generation"] == 1 and pair.control.alive(head_pid)
    assert CheckpointStore(LocalFileSystem(), str(pair.tmp / "checkpoints")).last_good() is None

    # Recovery sees the dead worker and restarts the pair under the lock.
    again = pair.recovery.run()
    assert (again.action, again.generation) == ("restarted", 2) and again.token > first.token
    assert not pair.control.alive(head_pid)
    client2 = PairClient("127.0.0.1", pair.recovery.state().port)
    assert client2.reply(client2.chat(), 60)["generation"] == 2


def test_head_killed_recovery_restarts_the_pair_and_a_second_recovery_changes_nothing(pair):
    fs = LocalFileSystem()
    first = pair.recovery.run()
    assert first.action == "restarted"
    state = pair.recovery.state()
    head_pid, worker_pid = state.pids
    client = PairClient("127.0.0.1", state.port)
    before = client.reply(client.chat(), 60)["version"]

    client.submit(JobSpec("short", steps=5, root=str(pair.tmp / "job"), authority=AUTH))
    client.submit(JobSpec("unauthorised", steps=5, root=str(pair.tmp / "job"), authority="guess"))
    done = wait_for(lambda: _receipt(pair, 0, "unauthorised") and _receipt(pair, 0, "short"), 60, "both jobs")
    short, refused = _receipt(pair, 0, "short"), _receipt(pair, 0, "unauthorised")
    assert short["outcome"] == "publish" and refused["outcome"] == "refused", (short, refused)
    assert short["fingerprint_before"] == short["fingerprint_after"]
    assert _receipt(pair, 1, "short")["outcome"] == "publish" and _receipt(pair, 1, "unauthorised") is None
    published = wait_for(
        lambda: (r := client.reply(client.chat(), 30))["version"] != before and r,
        30,
        "replies from the published block",
    )["version"]
    manifest = CheckpointStore(fs, str(pair.tmp / "checkpoints")).last_good()
    assert manifest.name == "short" and manifest.shards[0].startswith(published)
    assert done

    # Hot-load into a module both ranks have loaded: executed on both, same digest.
    staged = pair.tmp / "hot" / "staged"
    staged.mkdir(parents=True)
    (staged / "resident_trainer.train.frozen.py").write_text("HOTLOADED = 'pair-test'\n")
    client.submit(
        JobSpec(
            "hot",
            kind=JobKind.HOTLOAD,
            root=str(pair.tmp / "hot"),
            authority=AUTH,
            modules=("resident_trainer.train.frozen",),
        )
    )
    hot = [wait_for(lambda r=r: _receipt(pair, r, "hot"), 60, f"rank {r}'s hot-load receipt") for r in (0, 1)]
    assert [(h["outcome"], h["loaded"]) for h in hot] == [("done", ["resident_trainer.train.frozen"])] * 2
    loads = [[x["digest"] for x in _phases(pair, r) if x["job"] == "hot" and x["phase"] == "load"] for r in (0, 1)]
    assert loads[0] == loads[1] and len(loads[0]) == 1

    os.kill(head_pid, signal.SIGKILL)
    lost_at = time.monotonic()
    # Without its head the worker gives up on the group by itself.
    wait_for(lambda: not pair.control.alive(worker_pid), pair.cfg.timeouts.group + 10, "the worker to leave")
    assert pair.control.procs[worker_pid].returncode == EXIT_LOST
    # The protocol's bound is the group timeout (the store silent that long);
    # measured 6.11-6.15 s with the 6 s group timeout. The margin is one
    # exchange timeout: with both cores kept busy the worst of 8 runs was
    # 6.19 s.
    left = time.monotonic() - lost_at
    print(f"worker left {left:.3f}s after its head died")
    assert left <= pair.cfg.timeouts.group + pair.cfg.timeouts.exchange, f"the worker left after {left:.2f}s"

    second = pair.recovery.run()
    assert (second.action, second.generation) == ("restarted", 2) and second.token > first.token
    restarted = pair.recovery.state()
    client = PairClient("127.0.0.1", restarted.port)
    reply = client.reply(client.chat(), 60)
    # The new pair serves the last good checkpoint.
    assert (reply["generation"], reply["version"]) == (2, published)

    group_file = fs.read_bytes(str(pair.tmp / "state" / "group.json"))
    for _ in range(2):
        noop = pair.recovery.run()
        assert (noop.action, noop.generation, noop.token) == ("none", 2, second.token)
        assert fs.read_bytes(str(pair.tmp / "state" / "group.json")) == group_file
        assert all(pair.control.alive(pid) for pid in restarted.pids)
    assert pair.recovery.state() == restarted
    reply = client.reply(client.chat(), 30)
    assert (reply["generation"], reply["version"]) == (2, published)
