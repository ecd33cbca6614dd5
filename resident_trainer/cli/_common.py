"""What every command shares: one-line argument errors, progress bars,
timing, and the extension check."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def progress(iterable, desc: str, total: int | None = None):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: what was wrong, with
    which argument, and where help is (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def bad(command: str, message: str) -> int:
    """Report a bad argument in one line; the exit status is 2."""
    print(f"resident-trainer {command}: error: {message}", file=sys.stderr)
    return 2


def have_extension() -> bool:
    from resident_trainer import HAS_C

    if not HAS_C:
        print("the compiled extension is missing; run `make test` or `pip install --no-build-isolation -e .` first")
    return HAS_C
