"""Hot-load: replace code inside the running server without a restart.

Each rank reads the staged files once into memory (`stage`) and hashes that
snapshot; the ranks exchange digests at a boundary and the head decides LOAD
only if every digest is equal. Each rank then executes exactly its snapshot
(`execute` re-hashes it and refuses on any mismatch), never re-reading the
files, into the module objects that already exist, so references other code
holds to those modules see the new definitions. Any disagreement refuses the
load on every rank. Hot-load is off unless the configuration allows it and
the job carries the authority.

Staged layout under a job root: ``staged/<module.name>.py``.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from types import ModuleType

from resident_trainer.protocol.errors import HotLoadRefused
from resident_trainer.protocol.fs import FileSystem

_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class StagedCode:
    """An in-memory snapshot of staged sources: (module name, bytes), sorted."""

    files: tuple[tuple[str, bytes], ...]

    @property
    def digest(self) -> str:
        return code_digest(self.files)


def code_digest(files: Sequence[tuple[str, bytes]]) -> str:
    """SHA-256 over length-prefixed module names and sources, in name order
    (length prefixes keep name/source boundaries unambiguous)."""
    h = hashlib.sha256(b"resident-trainer hotload v1\n")
    for name, src in sorted(files):
        n = name.encode()
        h.update(len(n).to_bytes(8, "little") + n + len(src).to_bytes(8, "little") + src)
    return h.hexdigest()


def check_modules(modules: Sequence[str]) -> tuple[str, ...]:
    if isinstance(modules, str) or not modules:
        raise ValueError(f"modules must be a non-empty sequence of module names, got {modules!r}")
    for m in modules:
        if not isinstance(m, str) or not _MODULE_RE.match(m):
            raise ValueError(f"module name {m!r} is not a dotted Python identifier")
    if len(set(modules)) != len(modules):
        raise ValueError(f"modules must not repeat, got {list(modules)!r}")
    return tuple(sorted(modules))


def staged_path(root: str, module: str) -> str:
    return posixpath.join(root, "staged", module + ".py")


def stage(fs: FileSystem, root: str, modules: Sequence[str]) -> StagedCode:
    """Read each module's staged source once; raise HotLoadRefused if any is missing."""
    files = []
    for m in check_modules(modules):
        data = fs.read_bytes(staged_path(root, m))
        if data is None:
            raise HotLoadRefused(f"staged source for {m!r} is missing ({staged_path(root, m)})")
        files.append((m, data))
    return StagedCode(tuple(files))


def execute(
    code: StagedCode,
    agreed: str,
    modules: Mapping[str, ModuleType | MutableMapping] | None = None,
) -> list[str]:
    """Execute `code` into existing modules, only if its digest is `agreed`.

    modules: where to find each module object (default ``sys.modules``); a
    missing module is refused rather than created, because only existing
    objects are what the running server references. Returns the names loaded.
    """
    if code.digest != agreed:
        raise HotLoadRefused(f"snapshot digest {code.digest[:16]} is not the agreed {str(agreed)[:16]}")
    table = sys.modules if modules is None else modules
    targets = []
    for name, _ in code.files:
        mod = table.get(name)
        if mod is None:
            raise HotLoadRefused(f"module {name!r} is not loaded; hot-load only replaces existing modules")
        targets.append(mod)
    # Compile everything before executing anything, so a syntax error loads nothing.
    compiled = [compile(src, f"<hotload {name} {agreed[:12]}>", "exec") for name, src in code.files]
    for obj, mod in zip(compiled, targets):
        namespace = mod.__dict__ if isinstance(mod, ModuleType) else mod
        exec(obj, namespace)
    return [name for name, _ in code.files]
