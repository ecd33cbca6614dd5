"""Process-group workers that leave cleanly.

A gloo process that has finished its work can still die with SIGABRT while
the interpreter shuts down ("terminate called without an active exception":
a C++ thread destroyed while joinable), seen about once in ten runs of the
two-rank example on torch 2.13. The work is done by then, but the parent sees
a failed child. `gloo_worker` waits for every rank, tears the group down, and
on success leaves with os._exit so no static destructor runs; an exception
still propagates as usual.
"""

from __future__ import annotations

import datetime
import os
import sys
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gloo_worker(rank: int, world: int, init_method: str, *, timeout_s: float = 300.0) -> Iterator[object]:
    """Join a gloo group for the body of the `with`; exit the process on success."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    yield dist.group.WORLD
    # Rank 0 hosts the rendezvous store: leaving before the others are done
    # tears it down under them, so wait for everyone first.
    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)


def exit_now(code: int) -> None:
    """Flush stdio and end the process without interpreter teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
