"""The real-process driver of a protocol serving loop: tick the machine, then
block in the store on the keys it named, never longer than the poll."""

from __future__ import annotations

import threading
from collections.abc import Callable

from resident_trainer.integrations.torchdist.store import TorchKVStore
from resident_trainer.protocol.clock import MonotonicClock
from resident_trainer.protocol.errors import StoreError
from resident_trainer.protocol.job import Wake
from resident_trainer.protocol.server import HeadServer, WorkerServer


def drive(
    server: HeadServer | WorkerServer,
    kv: TorchKVStore,
    clock: MonotonicClock,
    stop: threading.Event,
    poll: float,
    before_tick: Callable[[], None] | None = None,
    idle_keys: Callable[[], tuple[str, ...]] | None = None,
) -> None:
    """Run a serving loop until `stop` or until its group is lost: tick,
    then block for at most `poll` on the keys the tick named (or, when it
    named none, on `idle_keys()`: the head's next chat), or on `stop`."""
    while not stop.is_set() and server.lost is None:
        if before_tick is not None:
            try:
                before_tick()
            except StoreError:
                pass
        wake: Wake = server.tick()
        if server.lost is not None:
            return
        timeout = poll if wake.at is None else min(poll, wake.at - clock.now())
        if timeout <= 0:
            continue
        keys = wake.keys or (idle_keys() if idle_keys is not None else ())
        if keys:
            try:
                kv.wait(keys, timeout)
                continue
            except StoreError:
                pass
        stop.wait(timeout)
