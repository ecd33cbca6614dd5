"""Configuration from environment variables.

| variable | default | meaning |
|---|---|---|
| RESIDENT_TRAINER_AUTHORITY | "" | the string a job must carry; empty: nothing runs |
| RESIDENT_TRAINER_RECEIPTS | runs/receipts | per-rank receipts, phase logs, stack dumps |
| RESIDENT_TRAINER_CHECKPOINTS | runs/checkpoints | checkpoints of the added neurons |
| RESIDENT_TRAINER_STATE_DIR | runs/state | the recovery lock and the group's state |
| RESIDENT_TRAINER_MASTER_PORT | 29551 | the rendezvous store's port |
| RESIDENT_TRAINER_HOST | 127.0.0.1 | address servers bind (loopback unless set) |
| RESIDENT_TRAINER_LAYER | unset | layer the added neurons sit at (unset: the default layer, a fifth of the way in: num_layers // 5) |
| RESIDENT_TRAINER_WATCH_LAYER | unset | a layer fingerprinted separately (unset: the last layer) |
| RESIDENT_TRAINER_MEMORY_FLOOR | 1 GiB | abort when free device memory drops below this |
| RESIDENT_TRAINER_WORKSPACE_CEILING | 2 GiB | abort when the job's private workspace exceeds this |
| RESIDENT_TRAINER_HOTLOAD | 0 | 1 allows authorised hot-loads |
| RESIDENT_TRAINER_TIMEOUT | 10 | seconds the head waits for every rank at a boundary |
| RESIDENT_TRAINER_SERVE_SHARE | 1.0 | while chats are live, serve this many times the last microbatch's time between two microbatches (0: train back to back) |

The layers are checked against the model by the job body that uses them
(resident_trainer.models.layer_index): one outside the model is an error.
Reading the environment happens only in `from_env`, never at import.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

ENV_PREFIX = "RESIDENT_TRAINER_"


@dataclass(frozen=True)
class Timeouts:
    """How long each wait may last, in seconds.

    exchange: the head's wait for every worker's report at a boundary (the
        join timeout of a sealed start is the same).
    decision: a worker's wait for the head's decision before it claims an
        abort itself; longer than `exchange` plus the head's own boundary
        work, so a live head always decides first.
    pause: a worker's wait for the next serving op inside a pause.
    group: how long the store or the serving link may stay silent before a
        rank declares its group lost and leaves it to recovery.
    poll: the real-process driver's longest single block.
    """

    exchange: float = 10.0
    decision: float = 30.0
    pause: float = 10.0
    group: float = 60.0
    poll: float = 0.05

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"timeouts.{f.name} must be a positive number of seconds, got {v!r}")
        if not self.decision > self.exchange:
            raise ValueError(
                f"timeouts.decision ({self.decision}) must exceed timeouts.exchange ({self.exchange}): "
                "a worker must not give up before a live head has decided"
            )
        if not self.group > self.decision:
            raise ValueError(f"timeouts.group ({self.group}) must exceed timeouts.decision ({self.decision})")

    @classmethod
    def scaled(cls, exchange: float) -> Timeouts:
        """Timeouts in the default proportions for a given exchange timeout."""
        return cls(
            exchange=exchange, decision=3 * exchange, pause=exchange, group=6 * exchange, poll=min(0.05, exchange / 10)
        )


@dataclass(frozen=True)
class ProtocolConfig:
    """Everything the protocol reads from the environment."""

    authority: str = field(default="", repr=False)
    receipts_dir: str = "runs/receipts"
    checkpoints_dir: str = "runs/checkpoints"
    state_dir: str = "runs/state"
    master_port: int = 29551
    host: str = "127.0.0.1"
    layer: int | None = None
    watch_layer: int | None = None
    memory_floor: int = 1 << 30
    workspace_ceiling: int = 2 << 30
    hotload: bool = False
    timeouts: Timeouts = field(default_factory=Timeouts)
    serve_share: float = 1.0
    first_token_wait: float = 5.0

    def __post_init__(self) -> None:
        for name in ("serve_share", "first_token_wait"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.authority, str):
            raise TypeError(f"authority must be a str, got {type(self.authority).__name__}")
        for name in ("receipts_dir", "checkpoints_dir", "state_dir", "host"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name} must be a non-empty str, got {v!r}")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be an int in 1..65535, got {self.master_port!r}")
        for name in ("layer", "watch_layer"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be None or a non-negative int, got {v!r}")
        for name in ("memory_floor", "workspace_ceiling"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.name != "authority"
        )
        return f"ProtocolConfig(authority={'<set>' if self.authority else '<empty>'}, {shown})"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProtocolConfig:
        """Read the RESIDENT_TRAINER_* variables of `env` (default os.environ)."""
        env = os.environ if env is None else env
        d = cls()

        def text(name: str, default: str) -> str:
            return env.get(ENV_PREFIX + name, default)

        def integer(name: str, default: int | None) -> int | None:
            raw = env.get(ENV_PREFIX + name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}{name} must be an integer, got {raw!r}") from None

        def flag(name: str) -> bool:
            raw = env.get(ENV_PREFIX + name, "0").strip().lower()
            if raw in ("1", "true", "yes", "on"):
                return True
            if raw in ("", "0", "false", "no", "off"):
                return False
            raise ValueError(f"{ENV_PREFIX}{name} must be 0 or 1, got {raw!r}")

        raw_timeout = env.get(ENV_PREFIX + "TIMEOUT")
        if raw_timeout:
            try:
                exchange = float(raw_timeout)
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}TIMEOUT must be a number of seconds, got {raw_timeout!r}") from None
            timeouts = Timeouts.scaled(exchange)
        else:
            timeouts = d.timeouts

        def number(name: str, default: float) -> float:
            raw = env.get(ENV_PREFIX + name)
            try:
                return float(raw) if raw else default
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}{name} must be a number, got {raw!r}") from None

        share = number("SERVE_SHARE", d.serve_share)
        first_token_wait = number("FIRST_TOKEN_WAIT", d.first_token_wait)
        port = integer("MASTER_PORT", d.master_port)
        if not 0 < port < 65536:
            raise ValueError(f"{ENV_PREFIX}MASTER_PORT must be in 1..65535, got {port}")
        return cls(
            authority=text("AUTHORITY", ""),
            receipts_dir=text("RECEIPTS", d.receipts_dir) or d.receipts_dir,
            checkpoints_dir=text("CHECKPOINTS", d.checkpoints_dir) or d.checkpoints_dir,
            state_dir=text("STATE_DIR", d.state_dir) or d.state_dir,
            master_port=port,
            host=text("HOST", d.host) or d.host,
            layer=integer("LAYER", d.layer),
            watch_layer=integer("WATCH_LAYER", d.watch_layer),
            memory_floor=integer("MEMORY_FLOOR", d.memory_floor),
            workspace_ceiling=integer("WORKSPACE_CEILING", d.workspace_ceiling),
            hotload=flag("HOTLOAD"),
            timeouts=timeouts,
            serve_share=share,
            first_token_wait=first_token_wait,
        )
