"""The key-value store the trainer channel runs on.

`KVStore` is the small, non-blocking interface the state machines use. Two
implementations: `MemoryKVStore` here (a dict: unit tests and the simulation)
and `resident_trainer.integrations.torchdist.store.TorchKVStore`, an adapter
over any ``torch.distributed.Store`` (TCPStore in production, HashStore and
FileStore in tests).

The contract is shaped by TCPStore's sharp edges (verified on torch 2.13 by
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

import re
import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from resident_trainer.protocol.errors import RecordTooLarge

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


def check_plain_key(key: str) -> str:
    check_key(key)
    if key.startswith(COUNTER_PREFIX):
        raise ValueError(f"key {key!r} is a counter (prefix {COUNTER_PREFIX!r}); only add() may write it")
    return key


def check_counter_key(key: str) -> str:
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
        value = check_value(check_plain_key(key), value)
        with self._lock:
            self.data[key] = value
            self.version += 1

    def get(self, key: str) -> bytes | None:
        return self.data.get(check_key(key))

    def create(self, key: str, value: bytes) -> bytes:
        value = check_value(check_plain_key(key), value)
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
        check_counter_key(key)
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
