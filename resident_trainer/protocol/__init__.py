"""Coordination protocol: training jobs that start, pause, abort and recover
together on every rank of a tensor-parallel serving group.

The state machines (`HeadServer`/`WorkerServer` and the `HeadJob`/`WorkerJob`
they run) take their store, clock, serving link, filesystem and job body as
arguments and never block, so the seeded simulation in
`resident_trainer.protocol.sim` drives the same code that runs over a real
TCPStore (`resident_trainer.protocol.pair` runs it in real processes).
docs/ARCHITECTURE.md walks one job through both ranks and lists every
failure and its handling.

Submodules not imported here: ``sim`` (the simulation and its checker) and
``pair`` (a minimal serving pair over TCPStore and gloo).
"""

from resident_trainer.protocol.authority import authority_ok
from resident_trainer.protocol.budget import BudgetMonitor, MemoryBudget, MemorySample, system_sampler
from resident_trainer.protocol.channel import Record, TrainerChannel
from resident_trainer.protocol.checkpoint import CheckpointStore, CorruptCheckpoint, Manifest
from resident_trainer.protocol.clock import Clock, MonotonicClock, WallClock
from resident_trainer.protocol.config import ProtocolConfig, Timeouts
from resident_trainer.protocol.errors import (
    ChannelError,
    FencedOut,
    HotLoadRefused,
    LinkClosed,
    PeerLost,
    ProtocolError,
    RecordTooLarge,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from resident_trainer.protocol.frozen import FrozenFingerprint
from resident_trainer.protocol.fs import FileSystem, LocalFileSystem, MemoryFileSystem
from resident_trainer.protocol.hotload import StagedCode
from resident_trainer.protocol.job import (
    GroupLost,
    HeadJob,
    JobBody,
    JobKind,
    JobSpec,
    Outcome,
    RankContext,
    Verdict,
    Wake,
    WorkerJob,
)
from resident_trainer.protocol.lock import FencedLock, Lease
from resident_trainer.protocol.records import RecordLog, dump_all_stacks
from resident_trainer.protocol.recovery import GroupControl, GroupState, Recovery, RecoveryResult, admits
from resident_trainer.protocol.server import HeadServer, WorkerServer
from resident_trainer.protocol.serving import Chat, OpKind, ServingOp, StoreServingLink
from resident_trainer.protocol.store import MAX_VALUE_BYTES, KVStore, MemoryKVStore, TorchKVStore

__all__ = [
    "MAX_VALUE_BYTES",
    "BudgetMonitor",
    "ChannelError",
    "Chat",
    "CheckpointStore",
    "Clock",
    "CorruptCheckpoint",
    "FencedLock",
    "FencedOut",
    "FileSystem",
    "FrozenFingerprint",
    "GroupControl",
    "GroupLost",
    "GroupState",
    "HeadJob",
    "HeadServer",
    "HotLoadRefused",
    "JobBody",
    "JobKind",
    "JobSpec",
    "KVStore",
    "Lease",
    "LinkClosed",
    "LocalFileSystem",
    "Manifest",
    "MemoryBudget",
    "MemoryFileSystem",
    "MemoryKVStore",
    "MemorySample",
    "MonotonicClock",
    "OpKind",
    "Outcome",
    "PeerLost",
    "ProtocolConfig",
    "ProtocolError",
    "RankContext",
    "Record",
    "RecordLog",
    "RecordTooLarge",
    "Recovery",
    "RecoveryResult",
    "ServingOp",
    "StagedCode",
    "StoreError",
    "StoreServingLink",
    "StoreTimeout",
    "StoreUnavailable",
    "Timeouts",
    "TorchKVStore",
    "TrainerChannel",
    "Verdict",
    "Wake",
    "WallClock",
    "WorkerJob",
    "WorkerServer",
    "admits",
    "authority_ok",
    "dump_all_stacks",
    "system_sampler",
]
