"""A two-rank serving pair on loopback: train while chatting, kill a rank, recover.

    python examples/protocol_pair.py [--steps 400] [--chats 40]

Starts the pair of resident_trainer.integrations.torchdist.pair under the recovery lock in
a temporary directory, then measures and prints:
  * start: recovery's restart of an empty state dir until the first reply
  * chat round trip with the server idle
  * a job of --steps microbatches alone: time per microbatch (each one is a
    full boundary exchange over the TCPStore plus a gloo all-reduce)
  * the same job with chats arriving throughout: chat latency while training
  * kill -9 of the worker mid-job: time until the head's receipt cancels the job
  * recovery: time to restart the pair, and a second recovery (a no-op)
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import threading
import time

from resident_trainer.integrations.torchdist.client import PairClient
from resident_trainer.integrations.torchdist.control import ProcessGroupControl
from resident_trainer.protocol.clock import WallClock
from resident_trainer.protocol.fs import LocalFileSystem
from resident_trainer.protocol.job import JobSpec
from resident_trainer.protocol.lock import FencedLock
from resident_trainer.protocol.records import read_jsonl
from resident_trainer.protocol.recovery import Recovery

AUTH = "example-authority"


def wait_for(pred, timeout: float):
    tick = threading.Event()
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise TimeoutError("gave up waiting")
        tick.wait(0.005)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--chats", type=int, default=40)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="rt-pair-")
    env = {
        **os.environ,
        "RESIDENT_TRAINER_AUTHORITY": AUTH,
        "RESIDENT_TRAINER_STATE_DIR": f"{root}/state",
        "RESIDENT_TRAINER_RECEIPTS": f"{root}/receipts",
        "RESIDENT_TRAINER_CHECKPOINTS": f"{root}/checkpoints",
        "RESIDENT_TRAINER_TIMEOUT": "1.0",
        "RESIDENT_TRAINER_LAYER": "3",
        "RESIDENT_TRAINER_WATCH_LAYER": "5",
    }
    control = ProcessGroupControl(env=env)
    recovery = Recovery(FencedLock(LocalFileSystem(), f"{root}/state", WallClock()), control, owner="example")

    def receipt(rank: int, job: str):
        path = f"{root}/receipts/rank{rank}/receipts.jsonl"
        return next((r for r in read_jsonl(LocalFileSystem(), path) if r["job"] == job), None)

    try:
        t0 = time.monotonic()
        assert recovery.run().action == "restarted"
        state = recovery.state()
        client = PairClient("127.0.0.1", state.port)
        client.reply(client.chat(), 60)
        print(f"start (two ranks, first reply): {time.monotonic() - t0:.2f} s   [{root}]")

        rtts = []
        for _ in range(20):
            t = time.monotonic()
            client.reply(client.chat(), 10)
            rtts.append(time.monotonic() - t)
        print(f"chat round trip, idle: median {1e3 * statistics.median(rtts):.1f} ms")

        t = time.monotonic()
        client.submit(JobSpec("alone", steps=a.steps, root=f"{root}/job", authority=AUTH))
        r = wait_for(lambda: receipt(0, "alone"), 300)
        dt = time.monotonic() - t
        print(
            f"job of {a.steps} microbatches, no chats: {dt:.2f} s = {1e3 * dt / a.steps:.2f} ms per microbatch "
            f"({r['outcome']}; fingerprint before == after: {r['fingerprint_before'] == r['fingerprint_after']})"
        )

        client.submit(JobSpec("chatty", steps=a.steps, root=f"{root}/job", authority=AUTH))
        lat = []
        while receipt(0, "chatty") is None and len(lat) < a.chats:
            t = time.monotonic()
            client.reply(client.chat(2), 30)
            lat.append(time.monotonic() - t)
        r = wait_for(lambda: receipt(0, "chatty"), 300)
        print(
            f"chat round trip during a job: median {1e3 * statistics.median(lat):.1f} ms, "
            f"max {1e3 * max(lat):.1f} ms over {len(lat)} chats (job: {r['outcome']})"
        )

        client.submit(JobSpec("doomed", steps=10**6, root=f"{root}/job", authority=AUTH))
        steps = f"{root}/receipts/rank1/phases.jsonl"
        wait_for(
            lambda: any(x["job"] == "doomed" and x["phase"] == "step" for x in read_jsonl(LocalFileSystem(), steps)), 60
        )
        os.kill(state.pids[1], signal.SIGKILL)
        t = time.monotonic()
        r = wait_for(lambda: receipt(0, "doomed"), 60)
        print(
            f"kill -9 of the worker mid-job: the head cancelled it {r['t'] - t:.3f} s later "
            f"({r['outcome']} at boundary {r['boundary']}: {r['reasons'][0][:80]})"
        )
        client.reply(client.chat(), 10)
        print("  ... and still answers chats")

        t = time.monotonic()
        res = recovery.run()
        state = recovery.state()
        PairClient("127.0.0.1", state.port).reply(PairClient("127.0.0.1", state.port).chat(), 60)
        print(
            f"recovery: {res.action} generation {res.generation} (token {res.token}), "
            f"serving again after {time.monotonic() - t:.2f} s"
        )
        t = time.monotonic()
        again = recovery.run()
        print(f"second recovery on the healthy pair: {again.action} ({1e3 * (time.monotonic() - t):.1f} ms)")
    finally:
        control.close()


if __name__ == "__main__":
    main()
