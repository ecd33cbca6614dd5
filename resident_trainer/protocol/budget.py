"""Memory budget: a free-memory floor and a private-workspace ceiling.

A `BudgetMonitor` samples continuously (a background thread in a real process,
every scheduler step in the simulation) and latches the first breach. It never
aborts anything itself: the rank reports the latched breach at the next
microbatch boundary and the head's decision makes every rank abort there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class MemorySample:
    """One reading: free memory on the device the job uses, and the bytes the
    job's private workspace holds."""

    free_bytes: int
    workspace_bytes: int


@dataclass(frozen=True)
class MemoryBudget:
    """floor: abort when free memory is below this many bytes; ceiling: abort
    when the workspace is above this many bytes."""

    floor: int = 1 << 30
    ceiling: int = 2 << 30

    def __post_init__(self) -> None:
        for name in ("floor", "ceiling"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"budget {name} must be a non-negative int of bytes, got {v!r}")

    def breach(self, s: MemorySample) -> str | None:
        """Why `s` breaks the budget, or None."""
        if s.free_bytes < self.floor:
            return f"free memory {s.free_bytes} B below the floor {self.floor} B"
        if s.workspace_bytes > self.ceiling:
            return f"workspace {s.workspace_bytes} B above the ceiling {self.ceiling} B"
        return None


class BudgetMonitor:
    """Samples `sampler` and latches the first breach until `reset`.

    Thread-safe: a sampling thread and the rank's state machine share it."""

    def __init__(self, budget: MemoryBudget, sampler: Callable[[], MemorySample]) -> None:
        if not isinstance(budget, MemoryBudget):
            raise TypeError(f"budget must be a MemoryBudget, got {type(budget).__name__}")
        if not callable(sampler):
            raise TypeError("sampler must be callable")
        self.budget = budget
        self.sampler = sampler
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.reset()

    def reset(self) -> None:
        """Forget the latched breach and the extremes (at a job's start)."""
        with self._lock:
            self._breach: str | None = None
            self.samples = 0
            self.min_free: int | None = None
            self.max_workspace: int | None = None

    def sample(self) -> MemorySample | None:
        """Take one reading; a sampler that fails counts as a breach (the
        memory state is then unknown). Returns the reading, if any."""
        try:
            s = self.sampler()
            why = self.budget.breach(s)
        except Exception as exc:  # any sampler failure leaves memory unknown
            s, why = None, f"memory sampler failed: {type(exc).__name__}: {exc}"
        with self._lock:
            self.samples += 1
            if s is not None:
                self.min_free = s.free_bytes if self.min_free is None else min(self.min_free, s.free_bytes)
                self.max_workspace = (
                    s.workspace_bytes if self.max_workspace is None else max(self.max_workspace, s.workspace_bytes)
                )
            if why is not None and self._breach is None:
                self._breach = why
        return s

    def breach(self) -> str | None:
        """The first breach since the last reset, or None."""
        with self._lock:
            return self._breach

    def start(self, interval: float = 0.01) -> None:
        """Sample every `interval` seconds on a daemon thread until `stop`."""
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval):
                self.sample()

        self._thread = threading.Thread(target=loop, name="resident-trainer-budget", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
