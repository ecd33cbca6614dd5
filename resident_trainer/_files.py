"""Files written whole or not at all: the one atomic write every layer uses
(checkpoints of the trainer, the protocol's receipts, manifests and lock)."""

from __future__ import annotations

import contextlib
import os
import tempfile


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data` all at once: a temporary file in the same
    directory, flushed to disk, renamed over the target, and the directory
    entry flushed too. A reader (or a crash) sees the old file or the new
    one, never a torn one."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # The rename itself is durable only once the directory entry is.
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
