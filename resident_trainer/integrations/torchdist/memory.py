"""Memory samples of a real process for the protocol's budget monitor: free
memory of the device (MemAvailable on the CPU, ``torch.cuda.mem_get_info``
on a GPU) and the job's workspace."""

from __future__ import annotations

from collections.abc import Callable

import torch

from resident_trainer.protocol.budget import MemorySample


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def system_sampler(workspace: Callable[[], int], device: str = "cpu") -> Callable[[], MemorySample]:
    """A sampler for a real process: free memory of `device` (MemAvailable on
    the CPU, ``torch.cuda.mem_get_info`` on a GPU) and `workspace()` bytes."""
    if device == "cpu":
        free = _mem_available
    elif device.startswith("cuda"):

        def free() -> int:
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda[:n]', got {device!r}")
    return lambda: MemorySample(free(), int(workspace()))
