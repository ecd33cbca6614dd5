"""Coordination protocol: training jobs that start, pause, abort and recover
together on every rank of a tensor-parallel serving group.

The state machines (`HeadServer`/`WorkerServer` and the `HeadJob`/`WorkerJob`
they run) take their store, clock, serving link, filesystem and job body as
arguments and never block, so the seeded simulation in
`resident_trainer.testing` drives the same code that runs over a real
TCPStore (`resident_trainer.integrations.torchdist.pair` runs it in real
processes). Nothing here imports torch or the training code: an engine
integration brings the job body, the store and the serving link.
docs/ARCHITECTURE.md walks one job through both ranks and lists every
failure and its handling.
"""

from resident_trainer.protocol.authority import authority_ok
from resident_trainer.protocol.budget import BudgetMonitor, MemoryBudget, MemorySample
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
from resident_trainer.protocol.store import MAX_VALUE_BYTES, KVStore, MemoryKVStore

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
    "TrainerChannel",
    "Verdict",
    "Wake",
    "WallClock",
    "WorkerJob",
    "WorkerServer",
    "admits",
    "authority_ok",
    "dump_all_stacks",
]
