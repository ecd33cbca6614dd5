"""The client side of a running serving pair: chats and jobs through the
head's ``ctl/`` keys (the key layout is in pair.py)."""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch.distributed as dist

from resident_trainer.integrations.torchdist.store import TorchKVStore
from resident_trainer.protocol.job import JobSpec


class PairClient:
    """Talks to a running pair's head through the ``ctl/`` keys."""

    def __init__(self, host: str, port: int, *, timeout: float = 10.0) -> None:
        self.store = dist.TCPStore(host, port, 1, False, timeout=datetime.timedelta(seconds=timeout))
        self.kv = TorchKVStore(self.store)

    def chat(self, tokens: int = 1) -> int:
        i = self.kv.add("ctr/ctl/chats", 1) - 1
        self.kv.set(f"ctl/chat/{i}", json.dumps({"tokens": tokens}).encode())
        return i

    def reply(self, chat: int, timeout: float) -> dict[str, Any]:
        key = f"ctl/reply/{chat}"
        if not self.kv.wait([key], timeout):
            raise TimeoutError(f"no reply to chat {chat} within {timeout}s")
        return json.loads(self.kv.get(key))

    def submit(self, spec: JobSpec) -> None:
        j = self.kv.add("ctr/ctl/jobs", 1) - 1
        body = {**spec.public(), "authority": spec.authority}
        self.kv.set(f"ctl/job/{j}", json.dumps(body).encode())
