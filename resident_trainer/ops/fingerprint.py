"""Fingerprint: a deterministic 64-bit digest of tensors' exact contents.

Read bottom-up: the numpy oracle, the finalizer shared by every path, the
byte views, the dispatch to the kernels (C++ CPU, CUDA, Triton), then the
public functions.

Definition version 3 (also in docs/FINGERPRINT.md and csrc/fingerprint.h):
the tensor's row-major bytes are read as little-endian 32-bit words,
zero-padded at the end. Word w at 64-bit global word index g (a shard that
starts at global word g0 hashes its word i at g = g0 + i) has the position
key ``k = lo(g) * KEY_MUL + mum(hi(g) ^ HI_SEED, HI_MUL)`` and the odd
multiplier ``m = 2k + 1`` (mod 2^32); the exact 64-bit product
``p = (w ^ k) * m`` adds its low half to lane 0 and its high half to lane 1,
mod 2^32. ``mum(a, m)`` folds an exact 64-bit product: ``lo32(a*m) ^
hi32(a*m)``. The digest absorbs both lanes, the dtype, numel and the shape
into a splitmix64 chain. Because the lanes are plain sums, the digest is
identical for every tiling, grid, thread count and device, and shards hashed
at their global offsets add up to the whole tensor.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from resident_trainer import _ext
from resident_trainer.ops.fingerprint_version import FINGERPRINT_VERSION  # noqa: F401  (re-exported)

# --- constants (restated from csrc/fingerprint.h; a test parses the header) ---
KEY_MUL = 0x9E3779B1
HI_SEED = 0x27D4EB2F
HI_MUL = 0x165667B1

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN64 = 0x9E3779B97F4A7C15
# "RTTPFP", then the definition version and the kind (01 tensor, 02 table).
_TENSOR_TAG = 0x52545450_46500301
_TABLE_TAG = 0x52545450_46500302

IMPLS = ("auto", "cpu", "cuda", "triton", "reference")


# --- the oracle: plain numpy, any speed ---------------------------------------


def _mum_np(a: np.ndarray, m: int) -> np.ndarray:
    p = a.astype(np.uint64) * np.uint64(m)
    return ((p & np.uint64(MASK32)) ^ (p >> np.uint64(32))).astype(np.uint32)


def word_terms_reference(w: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two lane terms (uint64 arrays of 32-bit values) of 32-bit words `w`
    at 64-bit global word indices `g`: the halves of ``(w ^ k) * (2k + 1)``."""
    g = g.astype(np.uint64)
    lo = (g & np.uint64(MASK32)).astype(np.uint32)
    hi = (g >> np.uint64(32)).astype(np.uint32)
    k = lo * np.uint32(KEY_MUL) + _mum_np(hi ^ np.uint32(HI_SEED), HI_MUL)
    m = k * np.uint32(2) + np.uint32(1)
    p = (w.astype(np.uint32) ^ k).astype(np.uint64) * m.astype(np.uint64)
    return p & np.uint64(MASK32), p >> np.uint64(32)


def fingerprint_lanes_reference(data: np.ndarray | bytes, word_offset: int = 0) -> tuple[int, int]:
    """The two lane sums of a byte string whose first word has global index
    `word_offset`, computed word by word with numpy (the test oracle)."""
    buf = np.frombuffer(bytes(data), dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else data
    buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    pad = (-buf.size) % 4
    if pad:
        buf = np.concatenate([buf, np.zeros(pad, dtype=np.uint8)])
    words = buf.view("<u4")
    s0 = s1 = 0
    step = 1 << 22  # bound the temporaries to a few tens of MB
    for start in range(0, words.size, step):
        w = words[start : start + step]
        g = np.arange(w.size, dtype=np.uint64) + np.uint64(word_offset + start)
        t0, t1 = word_terms_reference(w, g)
        s0 += int(t0.sum())
        s1 += int(t1.sum())
    return s0 & MASK32, s1 & MASK32


# --- finalizer: shared by every path ------------------------------------------


def _mix64(z: int) -> int:
    # splitmix64 finalizer: a bijection on 64-bit integers.
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _absorb(values: Iterable[int]) -> int:
    h = 0
    for v in values:
        h = _mix64(((h ^ (v & MASK64)) + _GOLDEN64) & MASK64)
    return h


def _fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & MASK64
    return h


@functools.cache
def dtype_code(dtype: torch.dtype) -> int:
    """Stable 64-bit code of a dtype (FNV-1a of its name, e.g. 'torch.bfloat16')."""
    return _fnv1a64(str(dtype).encode())


@functools.lru_cache(maxsize=1 << 16)
def _name_code(name: str) -> int:
    # A model's names are hashed again on every check; the byte loop costs more
    # than the rest of a small tensor's finalization.
    return _fnv1a64(name.encode())


def finalize(lane0: int, lane1: int, dtype: torch.dtype, shape: Iterable[int]) -> int:
    """64-bit digest from a whole tensor's lane sums, dtype and shape."""
    shape = [int(s) for s in shape]
    numel = 1
    for s in shape:
        numel *= s
    return _absorb(
        [_TENSOR_TAG, (lane0 & MASK32) | ((lane1 & MASK32) << 32), dtype_code(dtype), numel, len(shape), *shape]
    )


# --- byte views -----------------------------------------------------------------

# Non-contiguous tensors are copied this many bytes at a time, never whole.
_CHUNK_BYTES = 64 << 20


def _check_tensor(t: object, name: str) -> torch.Tensor:
    """The tensor whose bits are hashed: dense, not on the meta device,
    detached, conjugate and negative views resolved."""
    t = _ext.check_tensor(t, name)
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device and has no contents to fingerprint")
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t


def _byte_chunks(t: torch.Tensor, chunk_bytes: int = _CHUNK_BYTES) -> Iterator[tuple[torch.Tensor, int]]:
    """(flat uint8 view or copy, byte offset within t's logical bytes), in order.
    Every chunk but the last has a length that is a multiple of 4 bytes."""
    if t.numel() == 0:
        return
    if t.is_contiguous():
        yield t.reshape(-1).view(torch.uint8), 0
        return
    rows = t.shape[0]
    row_bytes = (t.numel() // rows) * t.element_size()
    # A multiple of 4 rows keeps every chunk boundary on a word boundary.
    per = max(4, (chunk_bytes // max(row_bytes, 1)) // 4 * 4)
    for r in range(0, rows, per):
        yield t[r : r + per].contiguous().reshape(-1).view(torch.uint8), r * row_bytes


# --- dispatch -------------------------------------------------------------------


def cpu_isas() -> tuple[str, ...]:
    """The instruction sets the C++ CPU kernel runs on this machine, widest
    first ("avx512", "avx2", "scalar"); impl="cpu" uses the first. Every one
    gives the same lanes."""
    _ext.require_extension("fingerprint (impl='cpu')")
    return tuple(torch.ops.resident_trainer.fingerprint_cpu_isas().split(","))


PREFETCH_ENV = "RESIDENT_TRAINER_FINGERPRINT_PREFETCH"
PREFETCH_MODES = ("auto", "l1", "l2")


def cpu_prefetch() -> str:
    """The RESIDENT_TRAINER_FINGERPRINT_PREFETCH setting ("auto" when unset),
    checked: where the CPU loop's software prefetches put the lines it reads
    ahead, "l1" (prefetcht0) or "l2" (prefetcht1). "auto" measures both on the
    first call of at least 64 MiB and keeps the faster for the process. Every
    setting gives the same lanes."""
    value = os.environ.get(PREFETCH_ENV, "auto").strip().lower() or "auto"
    if value not in PREFETCH_MODES:
        raise ValueError(f"{PREFETCH_ENV} must be one of {PREFETCH_MODES} (unset means 'auto'), got {value!r}")
    return value


def cpu_choice() -> str:
    """What impl="cpu" runs on this machine: the instruction set, the prefetch
    target and what the run-time measurement found (for benchmark reports)."""
    _ext.require_extension("fingerprint (impl='cpu')")
    choice = torch.ops.resident_trainer.fingerprint_cpu_choice()
    setting = cpu_prefetch()
    return choice if setting == "auto" else f"{choice.split(',')[0]}, prefetch {setting} (set by {PREFETCH_ENV})"


def _cpu_lanes_many(datas: list[torch.Tensor], word_offsets: list[int]) -> torch.Tensor:
    """(len(datas), 2) int64 lane sums of flat contiguous uint8 CPU tensors, in
    one call into the extension (one parallel region)."""
    _ext.require_extension("fingerprint (impl='cpu')")
    return torch.ops.resident_trainer.fingerprint_lanes_many(datas, word_offsets, "auto", cpu_prefetch())


def _resolve_impl(impl: str, device: torch.device) -> str:
    gpu = "cuda" if _ext.has_kernel("fingerprint_lanes", "CUDA") else "triton"
    return _ext.resolve_impl("fingerprint", impl, IMPLS, device, gpu_auto=gpu)


def _aligned(data: torch.Tensor) -> torch.Tensor:
    # The GPU kernels read 32-bit words; a view at an odd byte offset is copied.
    return data if data.data_ptr() % 4 == 0 else data.clone()


def _chunk_lanes(data: torch.Tensor, word_offset: int, impl: str) -> torch.Tensor:
    """int64 tensor [lane0, lane1] of one flat uint8 chunk, on data's device."""
    if impl == "reference":
        l0, l1 = fingerprint_lanes_reference(data.cpu().numpy(), word_offset)
        return torch.tensor([l0, l1], dtype=torch.int64, device=data.device)
    if impl == "cpu":
        return _cpu_lanes_many([data], [word_offset])[0]
    if impl == "cuda":
        _ext.require_extension("fingerprint (impl='cuda')")
        if not _ext.has_kernel("fingerprint_lanes", "CUDA"):
            raise RuntimeError("impl='cuda': resident_trainer._C was built without CUDA kernels; " + _ext.BUILD_HINT)
        return torch.ops.resident_trainer.fingerprint_lanes(_aligned(data), word_offset)
    _ext.require_triton("fingerprint (impl='triton')")
    from resident_trainer.triton_kernels.fingerprint import fingerprint_lanes_triton

    data = _aligned(data)
    nfull = data.numel() // 4
    lanes = fingerprint_lanes_triton(data[: 4 * nfull].view(torch.int32), word_offset)
    rem = data.numel() - 4 * nfull
    if rem:
        tail = torch.zeros(4, dtype=torch.uint8, device=data.device)
        tail[:rem] = data[4 * nfull :]
        lanes = (lanes + fingerprint_lanes_triton(tail.view(torch.int32), word_offset + nfull)) & MASK32
    return lanes


def _lanes(t: torch.Tensor, byte_offset: int, impl: str) -> torch.Tensor:
    """Lane sums of t's bytes placed at global byte `byte_offset` (a multiple of 4),
    as a device tensor, without a host sync."""
    impl = _resolve_impl(impl, t.device)
    if t.is_contiguous() and t.numel():
        return _chunk_lanes(t.reshape(-1).view(torch.uint8), byte_offset // 4, impl)
    acc = torch.zeros(2, dtype=torch.int64, device=t.device)
    for data, off in _byte_chunks(t):
        acc = (acc + _chunk_lanes(data, (byte_offset + off) // 4, impl)) & MASK32
    return acc


# --- public API -----------------------------------------------------------------


@dataclass(frozen=True)
class FingerprintPartial:
    """Lane sums of one shard of a tensor: bytes [byte_start, byte_start + byte_len)
    of the whole tensor's row-major contents. Shards that tile the whole tensor
    combine with `combine_partials` into its digest."""

    lane0: int
    lane1: int
    byte_start: int
    byte_len: int


def fingerprint_partial(shard: torch.Tensor, *, offset: int = 0, impl: str = "auto") -> FingerprintPartial:
    """Lane sums of `shard`, the elements [offset, offset + shard.numel()) of a
    larger tensor in row-major order (e.g. one tensor-parallel rank's rows).

    offset * element_size must be a multiple of 4 bytes, so that shards meet on
    word boundaries (true for any row split of a tensor whose rows are 4-byte
    multiples)."""
    shard = _check_tensor(shard, "shard")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"offset must be a non-negative int (elements), got {offset!r}")
    byte_start = offset * shard.element_size()
    if byte_start % 4:
        raise ValueError(
            f"offset={offset} puts the shard at byte {byte_start}, not a multiple of 4; "
            f"shards of a {shard.dtype} tensor must start on a 4-byte boundary"
        )
    l0, l1 = _lanes(shard, byte_start, impl).tolist()
    return FingerprintPartial(l0, l1, byte_start, shard.numel() * shard.element_size())


def fingerprint_pieces(pieces: Iterable[tuple[torch.Tensor, int]], *, impl: str = "auto") -> tuple[int, int]:
    """The two lane sums of a set of pieces of one larger tensor, each piece
    ``(t, offset)`` holding the elements [offset, offset + t.numel()) of it in
    row-major order: e.g. the rows of a tensor-parallel column shard, each at
    ``row * columns + first_column``. Pieces must not overlap; every
    piece's byte offset must be a multiple of 4. Contiguous CPU pieces go to
    the kernel in one call. Lanes of pieces (or of ranks) add up, mod 2^32."""
    items = []
    for i, (t, offset) in enumerate(pieces):
        t = _check_tensor(t, f"pieces[{i}]")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"pieces[{i}]: offset must be a non-negative int (elements), got {offset!r}")
        byte_start = offset * t.element_size()
        if byte_start % 4:
            raise ValueError(f"pieces[{i}]: offset {offset} is at byte {byte_start}, not a multiple of 4")
        if t.numel():
            items.append((t, byte_start))
    l0 = l1 = 0
    batch = [(t, b) for t, b in items if _resolve_impl(impl, t.device) == "cpu" and t.is_contiguous()]
    if batch:
        lanes = _cpu_lanes_many([t.reshape(-1).view(torch.uint8) for t, _ in batch], [b // 4 for _, b in batch])
        l0, l1 = (int(v) for v in lanes.sum(0).tolist())
    for t, b in items:
        if not (_resolve_impl(impl, t.device) == "cpu" and t.is_contiguous()):
            a0, a1 = _lanes(t, b, impl).tolist()
            l0, l1 = l0 + a0, l1 + a1
    return l0 & MASK32, l1 & MASK32


def combine_partials(parts: Iterable[FingerprintPartial], shape: Iterable[int], dtype: torch.dtype) -> int:
    """Digest of the whole tensor (given shape and dtype) from partials that tile
    its bytes exactly once, in any order."""
    parts = sorted(parts, key=lambda p: p.byte_start)
    shape = [int(s) for s in shape]
    numel = 1
    for s in shape:
        numel *= s
    total = numel * torch.empty((), dtype=dtype).element_size()
    pos = 0
    for p in parts:
        if p.byte_start != pos:
            raise ValueError(
                f"partials do not tile the tensor: expected a shard at byte {pos}, got one at {p.byte_start}"
            )
        pos += p.byte_len
        if pos % 4 and pos != total:
            raise ValueError(f"a shard ends at byte {pos}, inside a 32-bit word; only the last shard may")
    if pos != total:
        raise ValueError(f"partials cover {pos} bytes, the tensor has {total}")
    l0 = sum(p.lane0 for p in parts) & MASK32
    l1 = sum(p.lane1 for p in parts) & MASK32
    return finalize(l0, l1, dtype, shape)


def fingerprint(t: torch.Tensor, *, impl: str = "auto") -> int:
    """Deterministic 64-bit digest of t's dtype, shape and exact contents (raw
    bits in row-major order), identical on every device, path, tiling and
    thread count; unlike ``torch.hash_tensor`` it sees element order.

    impl: "auto" (C++ on CPU, CUDA or Triton on GPU), "cpu", "cuda", "triton",
    or "reference" (numpy oracle)."""
    t = _check_tensor(t, "t")
    l0, l1 = _lanes(t, 0, impl).tolist()
    return finalize(l0, l1, t.dtype, t.shape)


def fingerprint_sharded(
    shard: torch.Tensor,
    *,
    offset: int,
    shape: Iterable[int],
    process_group=None,
    impl: str = "auto",
) -> int:
    """Digest of a tensor of `shape` whose elements are spread over the ranks of
    `process_group` in contiguous row-major pieces; this rank holds `shard`,
    starting at element `offset`. Lane sums are all-reduced (no gathering of
    data); every rank returns the same digest. Shards must tile the tensor."""
    import torch.distributed as dist

    shard = _check_tensor(shard, "shard")
    part = fingerprint_partial(shard, offset=offset, impl=impl)
    world = dist.get_world_size(process_group)
    meta = torch.tensor([part.byte_start, part.byte_len], dtype=torch.int64)
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=process_group)
    lanes = torch.tensor([part.lane0, part.lane1], dtype=torch.int64)
    dist.all_reduce(lanes, group=process_group)
    parts = [FingerprintPartial(0, 0, int(m[0]), int(m[1])) for m in gathered]
    parts[0] = FingerprintPartial(
        int(lanes[0]) & MASK32, int(lanes[1]) & MASK32, parts[0].byte_start, parts[0].byte_len
    )
    return combine_partials(parts, shape, shard.dtype)


@dataclass(frozen=True)
class FingerprintTable:
    """Per-tensor digests plus one combined digest over (name, digest) pairs."""

    digests: dict[str, int] = field(default_factory=dict)
    digest: int = 0

    @property
    def hex(self) -> str:
        return f"{self.digest:016x}"

    def changed(self, other: FingerprintTable) -> list[str]:
        """Names whose digest differs, or that only one of the two tables has."""
        names = sorted(set(self.digests) | set(other.digests))
        return [n for n in names if self.digests.get(n) != other.digests.get(n)]

    def as_dict(self) -> dict:
        return {"digest": self.hex, "tensors": {n: f"{d:016x}" for n, d in self.digests.items()}}


def table_digest(digests: Mapping[str, int]) -> int:
    """The combined digest of a table of per-tensor digests (name -> digest),
    independent of the order of the names."""
    values = [_TABLE_TAG, len(digests)]
    for name in sorted(digests):
        values += [_name_code(name), digests[name]]
    return _absorb(values)


def fingerprint_tensors(named: Mapping[str, torch.Tensor] | torch.nn.Module, *, impl: str = "auto") -> FingerprintTable:
    """Fingerprint every tensor of a mapping, or every parameter and buffer of a
    module (tied tensors once, under their first name). On a GPU the lane sums
    of all tensors are collected on the device and copied back once."""
    if isinstance(named, torch.nn.Module):
        items = list(named.named_parameters()) + list(named.named_buffers())
    elif isinstance(named, Mapping):
        items = list(named.items())
    else:
        raise TypeError(f"named must be a Mapping[str, Tensor] or an nn.Module, got {type(named).__name__}")
    metas, lanes, batch = [], [], []
    # The implementation per device, resolved once: asking the dispatcher for
    # every tensor costs more than hashing a small one.
    resolved: dict[torch.device, str] = {}
    for name, t in items:
        if not isinstance(name, str):
            raise TypeError(f"named: keys must be str, got {type(name).__name__}")
        t = _check_tensor(t, f"named[{name!r}]")
        metas.append((name, t.dtype, tuple(t.shape)))
        if t.device not in resolved:
            resolved[t.device] = _resolve_impl(impl, t.device)
        if resolved[t.device] == "cpu" and t.is_contiguous() and t.numel():
            batch.append((len(lanes), t.reshape(-1).view(torch.uint8)))
            lanes.append(None)
        else:
            lanes.append(_lanes(t, 0, impl))
    values: list[list[int]] = [[0, 0]] * len(lanes)
    if batch:
        # Contiguous CPU tensors go to the kernel in one call: one parallel
        # region for the whole model instead of a fork/join per small tensor.
        many = _cpu_lanes_many([d for _, d in batch], [0] * len(batch)).tolist()
        for (i, _), v in zip(batch, many):
            values[i] = v
    by_device: dict[torch.device, list[int]] = {}
    for i, ln in enumerate(lanes):
        if ln is not None:
            by_device.setdefault(ln.device, []).append(i)
    for idxs in by_device.values():
        # one device-to-host copy per device
        for i, v in zip(idxs, torch.stack([lanes[i] for i in idxs]).cpu().tolist()):
            values[i] = v
    digests = {name: finalize(v[0], v[1], dt, shape) for (name, dt, shape), v in zip(metas, values)}
    return FingerprintTable(digests, table_digest(digests))


def fingerprint_sharded_tensors(
    named: Mapping[str, tuple[Iterable[int], torch.dtype, Iterable[tuple[torch.Tensor, int]]]],
    *,
    process_group=None,
    impl: str = "auto",
) -> FingerprintTable:
    """The table of whole-tensor digests of tensors spread over the ranks of
    `process_group` in pieces: name -> (global shape, dtype, this rank's
    pieces as ``(tensor, element offset)``). Every rank passes the same names
    (a rank holding nothing of a tensor passes no pieces); lane sums are
    all-reduced, never the data, and every rank gets the same table, equal to
    ``fingerprint_tensors`` of the whole tensors."""
    names = sorted(named)
    lanes = torch.zeros(len(names), 2, dtype=torch.int64)
    for i, name in enumerate(names):
        _, _, pieces = named[name]
        lanes[i] = torch.tensor(fingerprint_pieces(pieces, impl=impl), dtype=torch.int64)
    if process_group is not None:
        import torch.distributed as dist

        dist.all_reduce(lanes, group=process_group)
    values = (lanes & MASK32).tolist()
    digests = {}
    for name, (l0, l1) in zip(names, values):
        shape, dtype, _ = named[name]
        digests[name] = finalize(l0, l1, dtype, shape)
    return FingerprintTable(digests, table_digest(digests))
