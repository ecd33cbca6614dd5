"""Test machinery for the protocol, kept out of the runtime package: the
seeded fault simulation (`python -m resident_trainer.testing.sim`).

| module | what |
|---|---|
| `scenario` | every random choice of a run, made up front from its seed |
| `fakes` | the simulated store, serving link, files, clocks, job body, chats |
| `variants` | deliberately broken machines the checker must catch |
| `simulation` | the scheduler: generations, events, recovery, ticking on virtual time |
| `checker` | the invariants checked after a run, and its coverage |
| `sim` | sweeps over many seeds (in parallel) and the command line |
"""

from resident_trainer.testing.scenario import COVERED_PHASES, DEATH_PHASES, FAULTS, VARIANTS, Scenario
from resident_trainer.testing.sim import parallel_sweep
from resident_trainer.testing.simulation import SimResult, Simulation, SweepReport, run_seed

__all__ = [
    "COVERED_PHASES",
    "DEATH_PHASES",
    "FAULTS",
    "Scenario",
    "SimResult",
    "Simulation",
    "SweepReport",
    "VARIANTS",
    "parallel_sweep",
    "run_seed",
]
