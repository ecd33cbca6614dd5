"""Processes of a rank group: workers that leave cleanly, that die with
their parent, and a liveness probe.

A gloo process that has finished its work can still die with SIGABRT while
the interpreter shuts down ("terminate called without an active exception":
a C++ thread destroyed while joinable), seen about once in ten runs of the
two-rank example on torch 2.13. The work is done by then, but the parent sees
a failed child. `gloo_worker` waits for every rank, tears the group down, and
on success leaves with os._exit so no static destructor runs; an exception
still propagates as usual.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gloo_worker(rank: int, world: int, init_method: str, *, timeout_s: float = 300.0) -> Iterator[object]:
    """Join a gloo group for the body of the `with`; exit the process on success."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
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


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits, so a
    crashed supervisor (or test run) leaves no rank behind."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not reaped, is not alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
