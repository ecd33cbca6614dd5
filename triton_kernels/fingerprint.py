"""Triton fingerprint kernel: the two 32-bit lane sums of a byte buffer.

Restates the constants and the word terms of csrc/fingerprint.h (definition
version 3; a test checks that they agree). Each program hashes BLOCK
consecutive words and writes its two partial sums; the launcher adds the
partials. Wrap-around sums commute, so the result is the same for every BLOCK
and grid.
"""

import torch
import triton
import triton.language as tl

KEY_MUL: tl.constexpr = tl.constexpr(0x9E3779B1)
HI_SEED: tl.constexpr = tl.constexpr(0x27D4EB2F)
HI_MUL: tl.constexpr = tl.constexpr(0x165667B1)


@triton.jit
def _mum(a, m: tl.constexpr):
    # lo32 ^ hi32 of the exact product of two uint32 values (one wide multiply).
    p = a.to(tl.uint64) * tl.full(a.shape, m, tl.uint64)
    return (p ^ (p >> 32)).to(tl.uint32)


@triton.jit
def _fingerprint_kernel(
    words_ptr,
    partial_ptr,
    n_words,
    word_offset,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    mask = j < n_words
    w = tl.load(words_ptr + j, mask=mask, other=0).to(tl.uint32, bitcast=True)
    # 64-bit global word index: tensors above 16 GiB must not wrap.
    g = j + word_offset
    lo = (g & 0xFFFFFFFF).to(tl.uint32)
    hi = (g >> 32).to(tl.uint32)
    k = lo * KEY_MUL + _mum(hi ^ HI_SEED, HI_MUL)
    # The exact product (w ^ k) * (2k + 1); its halves go to the two lanes.
    # See csrc/fingerprint.h.
    m = k * 2 + 1
    p = (w ^ k).to(tl.uint64) * m.to(tl.uint64)
    zero = tl.zeros_like(w)
    s0 = tl.sum(tl.where(mask, p.to(tl.uint32), zero), axis=0)
    s1 = tl.sum(tl.where(mask, (p >> 32).to(tl.uint32), zero), axis=0)
    tl.store(partial_ptr + 2 * pid, s0.to(tl.int64))
    tl.store(partial_ptr + 2 * pid + 1, s1.to(tl.int64))


def fingerprint_lanes_triton(words: torch.Tensor, word_offset: int, block: int = 4096) -> torch.Tensor:
    """Lane sums of the int32 words `words` (1-D, contiguous) at global word index
    `word_offset`; returns an int64 tensor [lane0, lane1] on the same device."""
    n = words.numel()
    if n == 0:
        return torch.zeros(2, dtype=torch.int64, device=words.device)
    # One program per BLOCK words: 4096 words = 16 KiB per program keeps
    # enough loads in flight on HBM and the partials buffer tiny.
    grid = (triton.cdiv(n, block),)
    partial = torch.empty(grid[0], 2, dtype=torch.int64, device=words.device)
    _fingerprint_kernel[grid](words, partial, n, word_offset, BLOCK=block)
    return partial.sum(0) & 0xFFFFFFFF
