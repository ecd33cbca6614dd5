"""Clocks. The state machines read time only through a `Clock`, so the
simulation can run them on virtual time."""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds, monotonic within one run."""


class MonotonicClock:
    """``time.monotonic``: deadlines inside one process."""

    def now(self) -> float:
        return time.monotonic()


class WallClock:
    """``time.time``: lease expiries that several processes compare."""

    def now(self) -> float:
        return time.time()
