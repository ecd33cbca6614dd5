"""A minimal serving group on one machine: the protocol live, in real
processes, over torch.distributed (a TCPStore and gloo).

Rank 0 hosts the rendezvous TCPStore on a socket it binds itself
(RESIDENT_TRAINER_HOST, loopback unless set; port 0 picks a free one, which
it publishes in ``<state dir>/g<generation>.port``). All ranks join a gloo
process group on that store; trainer steps all-reduce their gradients over a
separate gloo group whose timeout is the exchange timeout. The serving op
sequence travels over the store (`StoreServingLink`), the trainer channel over
its own keys, and a client talks to the head through ``ctl/`` keys:

    ctl/chat/<i>   {"tokens": k}                   a chat (ids from counter ctr/ctl/chats)
    ctl/reply/<i>  {"msg", "version", "generation"} its reply
    ctl/job/<j>    a JobSpec, authority included   (ids from counter ctr/ctl/jobs)

The head answers chats itself and workers mirror each serving op: the stand
in for a tensor-parallel forward, enough to host the protocol. The job body
(`PairBody`) trains a small added matrix on a tiny frozen model and proves
the model unchanged with ``resident_trainer.fingerprint_tensors``.

Run a rank: ``python -m resident_trainer.integrations.torchdist.pair --rank R --world W
--generation G --token T [--port P]``; `ProcessGroupControl` does this for
recovery (control.py); `PairClient` (client.py) is the client side.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from resident_trainer.integrations.torchdist.control import port_path
from resident_trainer.integrations.torchdist.drive import drive
from resident_trainer.integrations.torchdist.memory import system_sampler
from resident_trainer.integrations.torchdist.procs import die_with_parent, exit_now
from resident_trainer.integrations.torchdist.store import TorchKVStore
from resident_trainer.models.adapter import layer_index
from resident_trainer.protocol.budget import BudgetMonitor, MemoryBudget
from resident_trainer.protocol.channel import TrainerChannel
from resident_trainer.protocol.checkpoint import CheckpointStore
from resident_trainer.protocol.clock import MonotonicClock
from resident_trainer.protocol.config import ProtocolConfig
from resident_trainer.protocol.errors import PeerLost
from resident_trainer.protocol.fs import LocalFileSystem
from resident_trainer.protocol.job import JobKind, JobSpec, RankContext
from resident_trainer.protocol.records import RecordLog
from resident_trainer.protocol.recovery import admits
from resident_trainer.protocol.server import HeadServer, WorkerServer
from resident_trainer.protocol.serving import Chat, ServingOp, StoreServingLink
from resident_trainer.protocol.store import KVStore
from resident_trainer.train.frozen import FrozenFingerprint

EXIT_REFUSED = 3  # the group state names another generation or token
EXIT_LOST = 4  # the group was lost (store or link silent past the group timeout)

DIM = 16
DEPTH = 6


class TinyModel(torch.nn.Module):
    """A frozen stack of DEPTH linear+tanh layers (deterministic weights)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(20251129)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(DEPTH))
        with torch.no_grad():
            for lin in self.layers:
                lin.weight.copy_(torch.randn(DIM, DIM, generator=g) / DIM**0.5)
                lin.bias.copy_(torch.randn(DIM, generator=g) * 0.1)
        self.requires_grad_(False)

    def hidden(self, x: torch.Tensor, upto: int) -> torch.Tensor:
        for lin in self.layers[:upto]:
            x = torch.tanh(lin(x))
        return x


@dataclass
class PairState:
    """What serving uses: the published added block and its version."""

    block: torch.Tensor
    version: str


def block_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().numpy().tobytes()


def block_version(t: torch.Tensor) -> str:
    return hashlib.sha256(block_bytes(t)).hexdigest()[:16]


class PairBody:
    """A job that trains the added matrix `block` at layer `layer`: the
    hidden state h gets ``h @ block.T`` added, fitted to a fixed target by
    SGD whose gradient is all-reduced over the trainer group."""

    def __init__(
        self,
        model: TinyModel,
        state: PairState,
        spec: JobSpec,
        group,
        *,
        rank: int,
        world: int,
        layer: int,
        watch_layer: int,
    ) -> None:
        self.model = model
        self.state = state
        self.spec = spec
        self.group = group
        self.rank = rank
        self.world = world
        self.layer = layer
        self.fp = FrozenFingerprint(model, model.layers[watch_layer])
        self.trained: torch.Tensor | None = state.block.clone()

    def fingerprint(self) -> dict[str, str]:
        return self.fp()

    def step(self, index: int) -> dict[str, float]:
        import torch.distributed as dist

        seed = int(hashlib.sha256(f"{self.spec.name}/{index}/{self.rank}".encode()).hexdigest()[:8], 16)
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            h = self.model.hidden(x, self.layer)
        w = self.trained.clone().requires_grad_(True)
        loss = ((h + h @ w.T - 0.5 * x) ** 2).mean()
        loss.backward()
        grad = w.grad.detach()
        try:
            dist.all_reduce(grad, group=self.group)
        except RuntimeError as exc:
            # gloo raises RuntimeError for a closed peer and for its timeout.
            raise PeerLost(f"trainer all-reduce failed: {str(exc).splitlines()[0][:200]}") from exc
        self.trained = (w - 0.1 * grad / self.world).detach()
        return {"loss": float(loss.detach())}

    def checkpoint(self) -> bytes:
        return block_bytes(self.trained)

    def publish(self) -> None:
        self.state.block = self.trained
        self.state.version = block_version(self.trained)

    def discard(self) -> None:
        self.trained = None


class StoreChats:
    """Chats from ``ctl/chat/<i>``, replies to ``ctl/reply/<i>`` (head side)."""

    def __init__(self, kv: KVStore, state: PairState, clock: MonotonicClock, generation: int) -> None:
        self.kv = kv
        self.state = state
        self.clock = clock
        self.generation = generation
        self.next = 0

    def take(self) -> list[Chat]:
        out = []
        while True:
            raw = self.kv.get(f"ctl/chat/{self.next}")
            if raw is None:
                return out
            d = json.loads(raw)
            out.append(Chat(self.next, max(1, int(d.get("tokens", 1))), self.clock.now()))
            self.kv.delete(f"ctl/chat/{self.next}")
            self.next += 1

    def finished(self, chat: Chat, msg: int) -> None:
        reply = {"msg": msg, "version": self.state.version, "generation": self.generation}
        self.kv.set(f"ctl/reply/{chat.id}", json.dumps(reply).encode())


class MirrorBackend:
    """Serving ops as the pair executes them: the head computes replies (in
    StoreChats), every rank counts the ops it ran."""

    def __init__(self) -> None:
        self.executed = 0

    def execute(self, op: ServingOp) -> None:
        self.executed += 1


class _JobIntake:
    def __init__(self, kv: KVStore, head: HeadServer) -> None:
        self.kv = kv
        self.head = head
        self.next = 0

    def poll(self) -> None:
        while True:
            raw = self.kv.get(f"ctl/job/{self.next}")
            if raw is None:
                return
            d = json.loads(raw)
            self.kv.delete(f"ctl/job/{self.next}")
            self.next += 1
            try:
                spec = JobSpec(
                    d["name"],
                    JobKind(d["kind"]),
                    int(d["steps"]) or 1,
                    d["root"],
                    d.get("authority", ""),
                    tuple(d.get("modules", ())),
                )
            except (ValueError, TypeError, KeyError) as exc:
                print(f"resident-trainer pair: ignoring malformed job {d!r}: {exc}", file=sys.stderr, flush=True)
                continue
            self.head.submit(spec)


def _make_store(cfg: ProtocolConfig, rank: int, world: int, port: int, generation: int, fs: LocalFileSystem):
    import socket

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=cfg.timeouts.group)
    if rank != 0:
        return dist.TCPStore(cfg.host, port, world, False, timeout=timeout), None
    # Bind the listening socket here: TCPStore would listen on every
    # interface, and a port chosen by the kernel cannot race with anyone.
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, port))
    sock.listen(128)
    store = dist.TCPStore(
        cfg.host,
        sock.getsockname()[1],
        world,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    fs.write_atomic(port_path(cfg.state_dir, generation), str(sock.getsockname()[1]).encode())
    # The caller keeps the socket object: its fd must stay open as long as the store.
    return store, sock


def rank_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resident_trainer.integrations.torchdist.pair")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--generation", type=int, required=True)
    p.add_argument("--token", type=int, required=True)
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="the store's port (default RESIDENT_TRAINER_MASTER_PORT; 0 on rank 0: any free port)",
    )
    a = p.parse_args(argv)
    die_with_parent()
    cfg = ProtocolConfig.from_env()
    layer = layer_index(cfg.layer, DEPTH, "RESIDENT_TRAINER_LAYER")
    watch_layer = (
        DEPTH - 1 if cfg.watch_layer is None else layer_index(cfg.watch_layer, DEPTH, "RESIDENT_TRAINER_WATCH_LAYER")
    )
    if a.port is None:
        a.port = cfg.master_port
    fs = LocalFileSystem()
    if not admits(fs, cfg.state_dir, a.generation, a.token):
        print(
            f"rank {a.rank}: generation {a.generation} token {a.token} is not current; refusing to run",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_REFUSED
    torch.set_num_threads(1)
    if cfg.host in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    store, listen_socket = _make_store(cfg, a.rank, a.world, a.port, a.generation, fs)
    t = cfg.timeouts
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg/", store),
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=t.group),
    )
    trainer_group = dist.new_group(list(range(a.world)), timeout=datetime.timedelta(seconds=t.exchange))
    kv = TorchKVStore(store)
    clock = MonotonicClock()
    group = f"g{a.generation}"
    ckpts = CheckpointStore(fs, cfg.checkpoints_dir)
    model = TinyModel()
    block = torch.zeros(DIM, DIM)
    loaded = ckpts.load(a.rank)
    if loaded is not None:
        block = torch.frombuffer(bytearray(loaded[1]), dtype=torch.float32).reshape(DIM, DIM).clone()
    state = PairState(block, block_version(block))
    log = RecordLog(fs, cfg.receipts_dir, rank=a.rank, group=group, clock=clock)
    monitor = BudgetMonitor(
        MemoryBudget(cfg.memory_floor, cfg.workspace_ceiling), system_sampler(lambda: DIM * DIM * 4 * 3)
    )
    ctx = RankContext(
        rank=a.rank,
        world=a.world,
        group=group,
        channel=TrainerChannel(kv, group=group, world=a.world),
        clock=clock,
        fs=fs,
        log=log,
        config=cfg,
        budget=monitor,
        checkpoints=ckpts,
    )

    def factory(spec: JobSpec, ctx: RankContext) -> PairBody:
        return PairBody(
            model, state, spec, trainer_group, rank=a.rank, world=a.world, layer=layer, watch_layer=watch_layer
        )

    link = StoreServingLink(kv, group=group, rank=a.rank, world=a.world)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    monitor.start(0.02)
    log.phase(None, "rank_started", generation=a.generation, token=a.token, pid=os.getpid(), version=state.version)
    if a.rank == 0:
        chats = StoreChats(kv, state, clock, a.generation)
        head = HeadServer(ctx, link=link, backend=MirrorBackend(), chats=chats, body_factory=factory)
        intake = _JobIntake(kv, head)
        drive(head, kv, clock, stop, t.poll, intake.poll, lambda: (f"ctl/chat/{chats.next}",))
        server: HeadServer | WorkerServer = head
    else:
        server = WorkerServer(ctx, link=link, backend=MirrorBackend(), body_factory=factory)
        drive(server, kv, clock, stop, t.poll)
    monitor.stop()
    if server.lost is not None:
        print(server.lost, file=sys.stderr, flush=True)
        return EXIT_LOST
    return 0


if __name__ == "__main__":
    exit_now(rank_main())  # skip interpreter teardown: gloo can abort in it
