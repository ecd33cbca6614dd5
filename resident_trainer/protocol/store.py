"""The key-value store the trainer channel runs on.

`KVStore` is the small, non-blocking interface the state machines use. Two
implementations: `MemoryKVStore` (a dict: unit tests and the simulation) and
`TorchKVStore`, an adapter over any ``torch.distributed.Store`` (TCPStore in
production, HashStore/FileStore in tests).

The adapter is shaped by TCPStore's sharp edges (verified on torch 2.13 by
tests/test_protocol_store.py):

* ``get`` on an absent key blocks until the client timeout, and ``check`` then
  ``get`` races with a concurrent delete. A non-blocking read is therefore one
  ``compare_set(key, SENTINEL, SENTINEL)``: on an absent key compare_set
  returns the expected value and sets nothing, on a present key it returns the
  stored value. No stored value may equal the sentinel.
* ``compare_set(key, b"", value)`` creates an absent key and returns the stored
  value otherwise, so it is an atomic create-once whose return value names the
  winner, provided values are never empty and every writer's value is unique.
* ``add`` on a key written by ``set`` breaks that client's connection for good,
  so counters live under their own prefix, which ``set`` refuses, and ``add``
  refuses every other key.
* A payload over 8 MiB makes the server drop the connection: sizes are checked
  before sending.
* There is no expiry and ``num_keys`` is not per prefix: keys are enumerable
  from the protocol and deleted explicitly, never counted.
* A client is not safe to share between threads: each thread gets a clone.
"""

from __future__ import annotations

import datetime
import re
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from resident_trainer.protocol.errors import RecordTooLarge, StoreTimeout, StoreUnavailable

#: Largest value TCPStore accepts (libuv backend, torch 2.13); one byte more
#: and the server resets the connection.
MAX_VALUE_BYTES = 8 << 20

#: Keys under this prefix are counters: only ``add`` may touch them.
COUNTER_PREFIX = "ctr/"

#: Returned by compare_set for an absent key when passed as the expected
#: value; no stored value may equal it.
SENTINEL = b"\x00resident-trainer:absent\x00"


@runtime_checkable
class KVStore(Protocol):
    """What the protocol needs from a store. Every call returns promptly; a
    missing key is ``None``, never a wait."""

    def set(self, key: str, value: bytes) -> None:
        """Write `value` under `key` (not a counter key)."""

    def get(self, key: str) -> bytes | None:
        """The value under `key`, or None when absent."""

    def create(self, key: str, value: bytes) -> bytes:
        """Write `value` only if `key` is absent; return the stored value
        (equal to `value` exactly when this call, or an earlier identical one,
        created it)."""

    def delete(self, key: str) -> None:
        """Remove `key` if present."""

    def add(self, key: str, amount: int) -> int:
        """Add to the counter `key` (under COUNTER_PREFIX); return the new value."""

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Block until every key exists or `timeout` seconds pass; True when
        they all exist. Only the real-process driver calls this."""


_BAD_KEY_CHAR = re.compile(r"[\s\x00]")


def check_key(key: object) -> str:
    """Validate a store key: a non-empty str without whitespace or NUL."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"store key must be a non-empty str, got {key!r}")
    if _BAD_KEY_CHAR.search(key):
        raise ValueError(f"store key must not contain whitespace or NUL, got {key!r}")
    return key


def check_value(key: str, value: object) -> bytes:
    """Validate a value for `key`: non-empty bytes, not the sentinel, at most
    MAX_VALUE_BYTES."""
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"value for {key!r} must be bytes, got {type(value).__name__}")
    value = bytes(value)
    if not value:
        # An empty value would read as absent to create() (compare_set with
        # expected b"" swaps it).
        raise ValueError(f"value for {key!r} must not be empty")
    if value == SENTINEL:
        raise ValueError(f"value for {key!r} equals the store's absence sentinel")
    if len(value) > MAX_VALUE_BYTES:
        raise RecordTooLarge(
            f"value for {key!r} is {len(value)} bytes; the store accepts at most {MAX_VALUE_BYTES} "
            "(TCPStore drops the connection on larger payloads)"
        )
    return value


def _check_plain(key: str) -> str:
    check_key(key)
    if key.startswith(COUNTER_PREFIX):
        raise ValueError(f"key {key!r} is a counter (prefix {COUNTER_PREFIX!r}); only add() may write it")
    return key


def _check_counter(key: str) -> str:
    check_key(key)
    if not key.startswith(COUNTER_PREFIX):
        raise ValueError(
            f"add() needs a counter key under {COUNTER_PREFIX!r}, got {key!r} "
            "(add on a key written by set() breaks a TCPStore connection)"
        )
    return key


class MemoryKVStore:
    """A dict with the KVStore contract, for unit tests and the simulation.
    Single-threaded use, or guarded by its own lock."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.version = 0
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        value = check_value(_check_plain(key), value)
        with self._lock:
            self.data[key] = value
            self.version += 1

    def get(self, key: str) -> bytes | None:
        return self.data.get(check_key(key))

    def create(self, key: str, value: bytes) -> bytes:
        value = check_value(_check_plain(key), value)
        with self._lock:
            current = self.data.get(key)
            if current is None:
                self.data[key] = value
                self.version += 1
                return value
            return current

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            if self.data.pop(key, None) is not None:
                self.version += 1

    def add(self, key: str, amount: int) -> int:
        _check_counter(key)
        with self._lock:
            value = int(self.data.get(key, b"0")) + int(amount)
            self.data[key] = str(value).encode()
            self.version += 1
            return value

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        return all(check_key(k) in self.data for k in keys)

    def keys(self) -> list[str]:
        """Every key, sorted (tests and the simulation's checker)."""
        return sorted(self.data)


def _classify(exc: BaseException, what: str) -> Exception:
    import torch.distributed as dist

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
        import torch.distributed as dist

        if not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
        self._root = store
        self._use_clones = use_clones and hasattr(store, "clone")
        self._local = threading.local()

    def _client(self):
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
        import socket

        host, port = getattr(self._root, "host", None), getattr(self._root, "port", None)
        if not host or not port:
            return
        try:
            socket.create_connection((host, port), timeout=1.0).close()
        except OSError as exc:
            raise StoreUnavailable(f"store server {host}:{port} is not accepting connections: {exc}") from None

    def _call(self, what: str, fn: Callable):
        import torch.distributed as dist

        try:
            return fn(self._client())
        except StoreUnavailable:
            raise
        except (dist.DistError, RuntimeError) as exc:
            err = _classify(exc, what)
            if isinstance(err, StoreUnavailable):
                self._local.client = None
            raise err from exc

    def set(self, key: str, value: bytes) -> None:
        value = check_value(_check_plain(key), value)
        self._call(f"set({key!r})", lambda c: c.set(key, value))

    def get(self, key: str) -> bytes | None:
        check_key(key)
        got = self._call(f"get({key!r})", lambda c: c.compare_set(key, SENTINEL, SENTINEL))
        return None if got == SENTINEL else bytes(got)

    def create(self, key: str, value: bytes) -> bytes:
        value = check_value(_check_plain(key), value)
        return bytes(self._call(f"create({key!r})", lambda c: c.compare_set(key, b"", value)))

    def delete(self, key: str) -> None:
        check_key(key)
        # FileStore answers True even for an absent key, so the result is not used.
        self._call(f"delete({key!r})", lambda c: c.delete_key(key))

    def add(self, key: str, amount: int) -> int:
        _check_counter(key)
        return int(self._call(f"add({key!r})", lambda c: c.add(key, int(amount))))

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        keys = [check_key(k) for k in keys]
        if not keys:
            return True
        delta = datetime.timedelta(seconds=max(timeout, 0.001))
        try:
            self._call("wait", lambda c: c.wait(keys, delta))
            return True
        except StoreTimeout:
            return False
