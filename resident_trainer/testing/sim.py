"""The seeded fault simulation of the protocol: sweeps and the command line.

One seed fixes everything: the world size (when not given), the chat and job
arrivals, and the faults (delayed and reordered messages, a worker that never
joins or joins late, a rank dying in a chosen phase or at its k-th store
operation, the head dying with the store it hosts, store errors, slow
operations and outages, a budget breach on one rank, a STOP file mid-job,
hot-load bytes differing on one rank or changing after they were hashed, a
trainer that corrupts the frozen weights, a crash between a checkpoint's
temporary file and its rename, a stalled process, a stale recovery-lock
owner). The machines under test are the production classes of
`resident_trainer.protocol`, given an in-memory store, link, filesystem and
virtual clock.

Scheduling: every rank's `tick()` runs to the point where it waits; its
store operations take effect at the tick's virtual time and their latency
delays the rank's next tick; ranks that can run at the same instant run in a
seeded random order, repeatedly, until none changes the store or the link.
A training step blocks until every peer has entered the same collective (a
dead peer fails it, as a closed connection fails a gloo all-reduce); serving
ops and steps are recorded per rank and compared afterwards.

After the run, `check()` verifies the invariants of docs/ARCHITECTURE.md; a failing seed
replays exactly: ``python -m resident_trainer.testing.sim --seed N --world W``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Sequence

from resident_trainer.testing.scenario import VARIANTS
from resident_trainer.testing.simulation import Simulation, SweepReport, run_seed


def _sweep_chunk(
    args: tuple[int, int, int | None, str | None],
) -> tuple[list[tuple[int, int, list[str]]], dict[str, int]]:
    start, stop, world, variant = args
    bad, cov = [], collections.Counter()
    for seed in range(start, stop):
        r = run_seed(seed, world, variant)
        cov.update(r.coverage)
        if not r.ok:
            bad.append((r.seed, r.world, r.violations))
    return bad, dict(cov)


def parallel_sweep(
    start: int, count: int, worlds: Sequence[int | None] = (None,), variant: str | None = None, processes: int = 2
) -> SweepReport:
    """Run seeds [start, start+count) for each world size in `worlds` over
    `processes` worker processes."""
    t0 = time.perf_counter()
    tasks = []
    chunk = max(1, count // (max(processes, 1) * 8))
    for world in worlds:
        tasks += [(s, min(s + chunk, start + count), world, variant) for s in range(start, start + count, chunk)]
    bad: list[tuple[int, int, list[str]]] = []
    cov: collections.Counter = collections.Counter()
    if processes <= 1:
        results = map(_sweep_chunk, tasks)
        for b, c in results:
            bad.extend(b)
            cov.update(c)
    else:
        import multiprocessing as mp

        # spawn: the caller may hold threads (a fork could copy a held lock).
        with mp.get_context("spawn").Pool(processes) as pool:
            for b, c in pool.imap_unordered(_sweep_chunk, tasks):
                bad.extend(b)
                cov.update(c)
    return SweepReport(sorted(bad), cov, count * len(worlds), time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m resident_trainer.testing.sim", description="Seeded simulation of the coordination protocol."
    )
    p.add_argument("--seed", type=int, help="replay one seed: print its scenario and violations")
    p.add_argument("--seeds", type=int, default=1000, help="sweep this many seeds, from --start")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--world", type=int, choices=(2, 3), default=None, help="ranks (default: chosen by the seed)")
    p.add_argument("--variant", choices=VARIANTS, default=None, help="run a deliberately broken variant")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--coverage", action="store_true", help="print what the sweep exercised")
    a = p.parse_args(argv)
    if a.seed is not None:
        sim = Simulation(a.seed, a.world, a.variant)
        for k, val in sim.sc.__dict__.items():
            print(f"{k}: {json.dumps(val, default=str)}")
        sim.run()
        violations = sim.check()
        print(f"seed {a.seed} world {sim.sc.world}: {len(violations)} violation(s); digest {sim.digest()[:16]}")
        for line in violations:
            print(" -", line)
        return 1 if violations else 0
    rep = parallel_sweep(a.start, a.seeds, (a.world,), a.variant, a.processes)
    print(f"{rep.runs} seeds in {rep.seconds:.1f}s ({rep.rate:.0f} seeds/s), {len(rep.failures)} failing")
    if a.coverage:
        for key in sorted(rep.coverage):
            print(f"  {key}: {rep.coverage[key]}")
    for seed, world, vs in rep.failures[:20]:
        print(f"seed {seed} world {world}: {vs[0]}")
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
