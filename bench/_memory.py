"""Peak memory of one step, measured the same way by every benchmark: in a
fresh process, after a warm-up step, the high-water mark of the step above
what was resident before it (CPU: VmHWM reset through /proc/self/clear_refs,
after malloc_trim gives freed heap pages back; GPU:
torch.cuda.max_memory_allocated)."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable

import torch


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_bytes_of(step: Callable[[], None], device: str = "cpu") -> int:
    """Bytes the high-water mark rises above the resident size during `step()`
    (call it once first to warm up)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    return _status_kib("VmHWM") * 1024 - base
