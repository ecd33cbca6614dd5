"""The filesystem as the protocol sees it: receipts, checkpoints, the lock,
STOP files and staged hot-load code all go through a `FileSystem`, so the
simulation can run the same code against memory and cut a write short.

Paths are POSIX strings. `write_atomic` is the only way a file is replaced:
the bytes go to a temporary file in the same directory, are flushed to disk,
and then renamed over the target, so a reader sees the old file or the new
one, never a torn one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from resident_trainer._files import write_atomic


@runtime_checkable
class FileSystem(Protocol):
    def read_bytes(self, path: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""

    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace `path` with `data` all at once (temp file + rename)."""

    def append_line(self, path: str, line: str) -> None:
        """Append one line (a newline is added) in a single write."""

    def exists(self, path: str) -> bool: ...

    def remove(self, path: str) -> None:
        """Delete `path` if it exists."""

    def listdir(self, path: str) -> list[str]:
        """Sorted names in directory `path` ([] when missing)."""

    def guard(self, path: str) -> AbstractContextManager[None]:
        """An exclusive section shared by every process using `path`."""


class LocalFileSystem:
    """The real filesystem. `guard` is an ``flock`` on `path`, released by the
    kernel if the holder dies."""

    def read_bytes(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write_atomic(self, path: str, data: bytes) -> None:
        write_atomic(path, data)

    def append_line(self, path: str, line: str) -> None:
        if "\n" in line:
            raise ValueError(f"line for {path!r} must not contain a newline")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # O_APPEND makes each single write land whole at the end, even with
        # several writers.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    @contextlib.contextmanager
    def guard(self, path: str) -> Iterator[None]:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


class MemoryFileSystem:
    """Files in a dict, for unit tests and the simulation.

    `before_replace(path)`, when given, runs after a write_atomic's temporary
    file exists and before the rename, so a simulated crash there leaves the
    temporary file and the old target, exactly as a real crash would.
    """

    def __init__(self, before_replace: Callable[[str], None] | None = None) -> None:
        self.files: dict[str, bytes] = {}
        self.before_replace = before_replace
        self._tmp = 0

    def read_bytes(self, path: str) -> bytes | None:
        return self.files.get(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        self._tmp += 1
        tmp = posixpath.join(posixpath.dirname(path), f".{posixpath.basename(path)}.{self._tmp}.tmp")
        self.files[tmp] = bytes(data)
        if self.before_replace is not None:
            self.before_replace(path)
        self.files[path] = self.files.pop(tmp)

    def append_line(self, path: str, line: str) -> None:
        if "\n" in line:
            raise ValueError(f"line for {path!r} must not contain a newline")
        self.files[path] = self.files.get(path, b"") + (line + "\n").encode()

    def exists(self, path: str) -> bool:
        return path in self.files

    def remove(self, path: str) -> None:
        self.files.pop(path, None)

    def listdir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        return sorted({p[len(prefix) :].split("/", 1)[0] for p in self.files if p.startswith(prefix)})

    @contextlib.contextmanager
    def guard(self, path: str) -> Iterator[None]:
        # One simulated process runs at a time; nothing to exclude.
        yield
