"""`TorchKVStore`: the protocol's KVStore over any ``torch.distributed.Store``
(TCPStore across processes, HashStore and FileStore in tests)."""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Callable, Sequence

import torch.distributed as dist

from resident_trainer.protocol.errors import StoreTimeout, StoreUnavailable
from resident_trainer.protocol.store import SENTINEL, check_counter_key, check_key, check_plain_key, check_value


def _classify(exc: BaseException, what: str) -> Exception:
    msg = f"store {what} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if isinstance(exc, dist.DistNetworkError):
        return StoreUnavailable(msg)
    if isinstance(exc, dist.DistStoreError) or "timeout" in str(exc).lower():
        return StoreTimeout(msg)
    return StoreUnavailable(msg)


class TorchKVStore:
    """KVStore over a ``torch.distributed.Store`` (TCPStore, HashStore,
    FileStore, PrefixStore).

    Each thread talks through its own ``clone()`` of `store` (a TCPStore client
    is not thread-safe); a clone whose connection broke is dropped and the next
    call clones afresh, because a broken TCPStore client never recovers.
    """

    def __init__(self, store, *, use_clones: bool = True) -> None:
        if not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
        self._root = store
        self._use_clones = use_clones and hasattr(store, "clone")
        self._local = threading.local()

    def client(self):
        """The torch store this thread talks through (its own clone of a
        TCPStore, made on first use)."""
        if not self._use_clones:
            return self._root
        client = getattr(self._local, "client", None)
        if client is None:
            self._probe()
            client = self._root.clone()
            self._local.client = client
        return client

    def _probe(self) -> None:
        """Before (re)connecting to a TCPStore server, check it still accepts
        connections: a TCPStore client retries a refused connect until its
        whole timeout expires, which would stall the caller that long."""
        host, port = getattr(self._root, "host", None), getattr(self._root, "port", None)
        if not host or not port:
            return
        try:
            socket.create_connection((host, port), timeout=1.0).close()
        except OSError as exc:
            raise StoreUnavailable(f"store server {host}:{port} is not accepting connections: {exc}") from None

    def call(self, what: str, fn: Callable):
        """``fn(client)`` on this thread's client, with torch's store errors
        turned into StoreTimeout / StoreUnavailable (a broken client is
        dropped and the next call reconnects)."""
        try:
            return fn(self.client())
        except StoreUnavailable:
            raise
        except (dist.DistError, RuntimeError) as exc:
            err = _classify(exc, what)
            if isinstance(err, StoreUnavailable):
                self._local.client = None
            raise err from exc

    @property
    def store(self):
        """The torch.distributed.Store this adapter was made over."""
        return self._root

    def keys(self) -> list[str]:
        """Every key, sorted (tests; TCPStore and HashStore list their keys)."""
        return sorted(self.call("list_keys", lambda c: c.list_keys()))

    def set(self, key: str, value: bytes) -> None:
        value = check_value(check_plain_key(key), value)
        self.call(f"set({key!r})", lambda c: c.set(key, value))

    def get(self, key: str) -> bytes | None:
        check_key(key)
        got = self.call(f"get({key!r})", lambda c: c.compare_set(key, SENTINEL, SENTINEL))
        return None if got == SENTINEL else bytes(got)

    def create(self, key: str, value: bytes) -> bytes:
        value = check_value(check_plain_key(key), value)
        return bytes(self.call(f"create({key!r})", lambda c: c.compare_set(key, b"", value)))

    def delete(self, key: str) -> None:
        check_key(key)
        # FileStore answers True even for an absent key, so the result is not used.
        self.call(f"delete({key!r})", lambda c: c.delete_key(key))

    def add(self, key: str, amount: int) -> int:
        check_counter_key(key)
        return int(self.call(f"add({key!r})", lambda c: c.add(key, int(amount))))

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        keys = [check_key(k) for k in keys]
        if not keys:
            return True
        delta = datetime.timedelta(seconds=max(timeout, 0.001))
        try:
            self.call("wait", lambda c: c.wait(keys, delta))
            return True
        except StoreTimeout:
            return False
