"""The production head and worker loops in two threads over a torch
HashStore: what tests use to drive real job bodies through the protocol."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch.distributed as dist

from resident_trainer.integrations.torchdist.store import TorchKVStore
from resident_trainer.protocol.budget import BudgetMonitor, MemoryBudget, MemorySample
from resident_trainer.protocol.channel import TrainerChannel
from resident_trainer.protocol.checkpoint import CheckpointStore
from resident_trainer.protocol.clock import MonotonicClock
from resident_trainer.protocol.config import ProtocolConfig, Timeouts
from resident_trainer.protocol.fs import LocalFileSystem
from resident_trainer.protocol.job import RankContext
from resident_trainer.protocol.records import RecordLog, read_jsonl
from resident_trainer.protocol.server import HeadServer, WorkerServer
from resident_trainer.protocol.serving import Chat, StoreServingLink


class Chats:
    def __init__(self):
        self.new, self.done = [], {}
        self.lock = threading.Lock()

    def take(self):
        with self.lock:
            out, self.new = self.new, []
        return out

    def finished(self, chat, msg):
        self.done[chat.id] = msg


class Backend:
    def __init__(self):
        self.msgs = []

    def execute(self, op):
        self.msgs.append(op.msg)


@dataclass
class PairRun:
    head: HeadServer
    worker: WorkerServer
    backends: tuple[Backend, Backend]
    chats: Chats
    kv: TorchKVStore
    fs: LocalFileSystem
    cfg: ProtocolConfig
    receipts: dict[int, list] = field(default_factory=dict)


def run_pair(tmp_path, factories, specs, *, chats: int = 1, authority: str = "a", polls: int = 4000) -> PairRun:
    """Run the jobs `specs` (submitted in order) on a head (rank 0) and a
    worker (rank 1) whose bodies come from factories[rank](spec, ctx), with
    `chats` chats waiting; returns once the worker has a receipt per
    authorised job and has published every job the head published, every
    chat is answered and the head is idle."""
    from resident_trainer.integrations.torchdist.drive import drive

    kv = TorchKVStore(dist.HashStore())
    fs = LocalFileSystem()
    cfg = ProtocolConfig(
        authority=authority,
        receipts_dir=str(tmp_path / "r"),
        checkpoints_dir=str(tmp_path / "c"),
        timeouts=Timeouts.scaled(2.0),
    )

    def ctx(rank):
        clock = MonotonicClock()
        return RankContext(
            rank,
            2,
            "g1",
            TrainerChannel(kv, group="g1", world=2),
            clock,
            fs,
            RecordLog(fs, cfg.receipts_dir, rank=rank, group="g1", clock=clock),
            cfg,
            BudgetMonitor(MemoryBudget(0, 1 << 40), lambda: MemorySample(1, 0)),
            CheckpointStore(fs, cfg.checkpoints_dir),
        )

    waiting = Chats()
    hb, wb = Backend(), Backend()
    head = HeadServer(
        ctx(0),
        link=StoreServingLink(kv, group="g1", rank=0, world=2),
        backend=hb,
        chats=waiting,
        body_factory=factories[0],
    )
    worker = WorkerServer(
        ctx(1), link=StoreServingLink(kv, group="g1", rank=1, world=2), backend=wb, body_factory=factories[1]
    )
    stop = threading.Event()
    threads = [threading.Thread(target=drive, args=(s, kv, MonotonicClock(), stop, 0.01)) for s in (head, worker)]
    with waiting.lock:
        waiting.new.extend(Chat(i, 3, 0.0) for i in range(chats))
    for spec in specs:
        head.submit(spec)
    authorised = sum(spec.authority == authority for spec in specs)
    worker_receipts = str(tmp_path / "r" / "rank1" / "receipts.jsonl")
    for t in threads:
        t.start()
    try:
        for _ in range(polls):  # bounded poll for the worker's receipts and the replies
            # The worker writes its receipt when its job ends and publishes
            # when the head's PUBLISH op reaches it, later: wait for both
            # (the head's own record of publishing may come after its idle).
            receipts = read_jsonl(fs, worker_receipts)
            to_publish = {r["serial"] for r in receipts if r.get("outcome") == "publish"}
            if (
                len(receipts) >= authorised
                and len(waiting.done) >= chats
                and not head.busy
                and to_publish <= {p[0] for p in worker.published}
            ):
                break
            stop.wait(0.01)
        else:
            raise AssertionError("the jobs did not finish")
    finally:
        stop.set()
        for t in threads:
            t.join()
    run = PairRun(head, worker, (hb, wb), waiting, kv, fs, cfg)
    run.receipts = {r: read_jsonl(fs, str(tmp_path / "r" / f"rank{r}" / "receipts.jsonl")) for r in (0, 1)}
    return run
