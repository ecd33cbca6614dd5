"""Recovery's `GroupControl` for the serving pair: launch, probe and stop
its ranks as child processes (each ``python -m
resident_trainer.integrations.torchdist.pair``)."""

from __future__ import annotations

import contextlib
import os
import posixpath
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from resident_trainer.integrations.torchdist.procs import pid_alive
from resident_trainer.protocol.config import ProtocolConfig
from resident_trainer.protocol.fs import LocalFileSystem
from resident_trainer.protocol.recovery import GroupState


def port_path(state_dir: str, generation: int) -> str:
    return posixpath.join(state_dir, f"g{generation}.port")


class ProcessGroupControl:
    """`GroupControl` for recovery: launches, probes and stops the ranks of
    a pair as child processes of this one.

    env: the environment of the ranks (the RESIDENT_TRAINER_* settings);
    port: the store's port for every generation (0: a free one each time;
    None: RESIDENT_TRAINER_MASTER_PORT)."""

    def __init__(
        self,
        *,
        world: int = 2,
        env: Mapping[str, str] | None = None,
        port: int | None = 0,
        start_timeout: float = 60.0,
        stop_grace: float = 2.0,
    ) -> None:
        if world < 2:
            raise ValueError(f"world must be at least 2, got {world}")
        self.world = world
        self.env = dict(os.environ if env is None else env)
        # The serving loop blocks in TCPStore.wait with short timeouts, and
        # c10d logs a warning for every one that expires.
        self.env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        self.cfg = ProtocolConfig.from_env(self.env)
        self.port = self.cfg.master_port if port is None else port
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.procs: dict[int, subprocess.Popen] = {}

    def _spawn(self, rank: int, generation: int, token: int, port: int) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "resident_trainer.integrations.torchdist.pair",
            "--rank",
            str(rank),
            "--world",
            str(self.world),
            "--generation",
            str(generation),
            "--token",
            str(token),
            "--port",
            str(port),
        ]
        proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL)
        self.procs[proc.pid] = proc
        return proc

    def alive(self, pid: int) -> bool:
        proc = self.procs.get(pid)
        if proc is not None:
            return proc.poll() is None
        return pid_alive(pid)

    def healthy(self, state: GroupState) -> bool:
        return len(state.pids) == self.world and all(self.alive(pid) for pid in state.pids)

    def start(self, generation: int, token: int) -> tuple[int, tuple[int, ...]]:
        fs = LocalFileSystem()
        path = port_path(self.cfg.state_dir, generation)
        fs.remove(path)
        head = self._spawn(0, generation, token, self.port)
        deadline = time.monotonic() + self.start_timeout
        waiter = threading.Event()
        while (raw := fs.read_bytes(path)) is None:
            if head.poll() is not None:
                raise RuntimeError(f"rank 0 of generation {generation} exited with {head.returncode} before listening")
            if time.monotonic() > deadline:
                self._kill([head.pid])
                raise TimeoutError(f"rank 0 of generation {generation} did not listen within {self.start_timeout}s")
            waiter.wait(0.01)
        port = int(raw)
        pids = [head.pid] + [self._spawn(r, generation, token, port).pid for r in range(1, self.world)]
        return port, tuple(pids)

    def _kill(self, pids: Sequence[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            proc = self.procs.pop(pid, None)
            if proc is not None:
                proc.wait()

    def stop(self, state: GroupState) -> None:
        pids = [pid for pid in state.pids if self.alive(pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        for pid in pids:
            proc = self.procs.get(pid)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
        self._kill([pid for pid in pids if self.alive(pid)] + [pid for pid in pids if pid in self.procs])

    def close(self) -> None:
        """Kill every process this control started (idempotent)."""
        self._kill(list(self.procs))
