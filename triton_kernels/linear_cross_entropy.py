"""Triton kernels of linear cross-entropy (see resident_trainer/ops/linear_cross_entropy.py).

Two kernels, both deterministic (every output element has one owner program,
no atomics):

- ``_lce_partials_kernel``: one program per block of tokens walks all
  vocabulary tiles with an online softmax. Per tile it forms the logits
  ``h @ W_tile^T`` (fp32 accumulation over D in BLOCK_D slices), updates the
  running max and sum-exp, and adds ``p @ W_tile`` into the token block's rows
  of the fp32 accumulator A (rescaled when the max moves). A is too large for
  registers at D in the thousands, so it lives in global memory; each program
  owns its rows, which stay in L2 while the program runs.
- ``_lce_weight_grad_kernel``: one program per vocabulary tile walks all token
  blocks, recomputes the logits, forms G and accumulates ``G^T @ h`` into its
  own rows of an fp32 dW buffer, and sums G into dbias.

tanh is written with exp (tanh(x) = 1 - 2 / (exp(2x) + 1)): exact in the limits
(+-1 when exp overflows or underflows) and available in the interpreter.
"""

import torch
import triton
import triton.language as tl

from resident_trainer.triton_kernels._common import dot, dot_precision, emulate_bf16


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _logit_tile(
    h_ptr,
    w_ptr,
    b_ptr,
    rows,
    cols,
    row_mask,
    col_mask,
    D,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    softcap,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """(z, t): the fp32 logit tile (softcapped) and tanh(z_raw / softcap) (or z)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        dm = ds < D
        hb = tl.load(
            h_ptr + rows[:, None] * stride_hn + ds[None, :] * stride_hd, mask=row_mask[:, None] & dm[None, :], other=0.0
        )
        wb = tl.load(
            w_ptr + cols[:, None] * stride_wv + ds[None, :] * stride_wd, mask=col_mask[:, None] & dm[None, :], other=0.0
        )
        acc = dot(hb, tl.trans(wb), acc, DOT_PRECISION, EMULATE_BF16)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    t = acc
    if SOFTCAP:
        t = _tanh(acc / softcap)
        acc = softcap * t
    return acc, t


@triton.jit
def _lce_partials_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    yl_ptr,
    m_ptr,
    s_ptr,
    zy_ptr,
    sz_ptr,
    a_ptr,
    bb_ptr,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    N,
    V,
    D,
    softcap,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    NEED_A: tl.constexpr,
    NEED_B: tl.constexpr,
    NEED_SZ: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sz = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zy = tl.zeros((BLOCK_N,), dtype=tl.float32)
    yl = tl.load(yl_ptr + rows, mask=row_mask, other=-1)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_mask = cols < V
        z, t = _logit_tile(
            h_ptr,
            w_ptr,
            b_ptr,
            rows,
            cols,
            row_mask,
            col_mask,
            D,
            stride_hn,
            stride_hd,
            stride_wv,
            stride_wd,
            softcap,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
            HAS_BIAS,
            SOFTCAP,
            DOT_PRECISION,
            EMULATE_BF16,
        )
        if NEED_SZ:
            sz += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)
        # the target's logit, from the same tile the softmax sees
        zy += tl.sum(tl.where(cols[None, :] == yl[:, None], z, 0.0), axis=1)
        z = tl.where(col_mask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new[:, None])
        s = s * alpha + tl.sum(p, axis=1)
        m = m_new
        if NEED_A or NEED_B:
            slope = 1.0 - t * t
            if SOFTCAP:
                p = p * slope
            slope = tl.where(col_mask[None, :], slope, 0.0)
            for d0 in range(0, D, BLOCK_D):
                ds = d0 + tl.arange(0, BLOCK_D)
                dm = ds < D
                wb = tl.load(
                    w_ptr + cols[:, None] * stride_wv + ds[None, :] * stride_wd,
                    mask=col_mask[:, None] & dm[None, :],
                    other=0.0,
                )
                amask = row_mask[:, None] & dm[None, :]
                if NEED_A:
                    a_ptrs = a_ptr + rows[:, None] * D + ds[None, :]
                    acc = tl.load(a_ptrs, mask=amask, other=0.0) * alpha[:, None]
                    acc = dot(p.to(wb.dtype), wb, acc, DOT_PRECISION, EMULATE_BF16)
                    tl.store(a_ptrs, acc, mask=amask)
                if NEED_B:
                    b_ptrs = bb_ptr + rows[:, None] * D + ds[None, :]
                    accb = tl.load(b_ptrs, mask=amask, other=0.0)
                    accb = dot(slope.to(wb.dtype), wb, accb, DOT_PRECISION, EMULATE_BF16)
                    tl.store(b_ptrs, accb, mask=amask)
    tl.store(m_ptr + rows, m, mask=row_mask)
    tl.store(s_ptr + rows, s, mask=row_mask)
    tl.store(zy_ptr + rows, zy, mask=row_mask)
    if NEED_SZ:
        tl.store(sz_ptr + rows, sz, mask=row_mask)


@triton.jit
def _lce_weight_grad_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    yl_ptr,
    lse_ptr,
    coef_ptr,
    wtok_ptr,
    dw_ptr,
    db_ptr,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    N,
    V,
    D,
    target_w,
    smooth,
    softcap,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    NEED_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    db = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        row_mask = rows < N
        z, t = _logit_tile(
            h_ptr,
            w_ptr,
            b_ptr,
            rows,
            cols,
            row_mask,
            col_mask,
            D,
            stride_hn,
            stride_hd,
            stride_wv,
            stride_wd,
            softcap,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
            HAS_BIAS,
            SOFTCAP,
            DOT_PRECISION,
            EMULATE_BF16,
        )
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
        coef = tl.load(coef_ptr + rows, mask=row_mask, other=0.0)
        wtok = tl.load(wtok_ptr + rows, mask=row_mask, other=0.0)
        yl = tl.load(yl_ptr + rows, mask=row_mask, other=-1)
        g = tl.exp(z - lse[:, None]) * coef[:, None] - wtok[:, None] * smooth
        g = g - tl.where(cols[None, :] == yl[:, None], wtok[:, None] * target_w, 0.0)
        if SOFTCAP:
            g = g * (1.0 - t * t)
        g = tl.where(row_mask[:, None] & col_mask[None, :], g, 0.0)
        if NEED_BIAS:
            db += tl.sum(g, axis=0)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            dm = ds < D
            hb = tl.load(
                h_ptr + rows[:, None] * stride_hn + ds[None, :] * stride_hd,
                mask=row_mask[:, None] & dm[None, :],
                other=0.0,
            )
            dw_ptrs = dw_ptr + cols[:, None] * D + ds[None, :]
            wmask = col_mask[:, None] & dm[None, :]
            acc = tl.load(dw_ptrs, mask=wmask, other=0.0)
            acc = dot(tl.trans(g.to(hb.dtype)), hb, acc, DOT_PRECISION, EMULATE_BF16)
            tl.store(dw_ptrs, acc, mask=wmask)
    if NEED_BIAS:
        tl.store(db_ptr + cols, db, mask=col_mask)


# Default tiles for GPUs: 64 tokens x 128 vocabulary rows, D in slices of 64,
# keep two fp32 tiles (logits, accumulator slice) in registers with 8 warps.
BLOCKS = dict(BLOCK_N=64, BLOCK_V=128, BLOCK_D=64)


def lce_partials_triton(h, w, bias, y_local, softcap, need_a, need_b, need_sz, blocks=None):
    """(m, s, zy, a, b, sz) for h: (N, D), w: (V, D) (any strides), bias: (V,) or
    None, y_local: (N,) int64 row of W holding each target or -1.
    m, s, zy, sz: (N,) fp32; a, b: (N, D) fp32 or None."""
    bl = {**BLOCKS, **(blocks or {})}
    n, d = h.shape
    v = w.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    m = torch.empty(n, **f32)
    s = torch.empty(n, **f32)
    zy = torch.empty(n, **f32)
    sz = torch.zeros(n, **f32) if need_sz else None
    a = torch.zeros(n, d, **f32) if need_a else None
    b = torch.zeros(n, d, **f32) if need_b else None
    dummy = m
    grid = (triton.cdiv(n, bl["BLOCK_N"]),)
    _lce_partials_kernel[grid](
        h,
        w,
        bias if bias is not None else dummy,
        y_local.contiguous(),
        m,
        s,
        zy,
        sz if need_sz else dummy,
        a if need_a else dummy,
        b if need_b else dummy,
        h.stride(0),
        h.stride(1),
        w.stride(0),
        w.stride(1),
        n,
        v,
        d,
        float(softcap or 0.0),
        HAS_BIAS=bias is not None,
        SOFTCAP=bool(softcap),
        NEED_A=need_a,
        NEED_B=need_b,
        NEED_SZ=need_sz,
        DOT_PRECISION=dot_precision(h.dtype),
        EMULATE_BF16=emulate_bf16(h),
        num_warps=8 if h.is_cuda else 1,
        **bl,
    )
    return m, s, zy, a, b, sz


def lce_weight_grad_triton(h, w, bias, y_local, lse, coef, wtok, target_w, smooth, softcap, need_bias, blocks=None):
    """(dW like w, dbias (V,) fp32 or None); see _lce_weight_grad_kernel."""
    bl = {**BLOCKS, **(blocks or {})}
    n, d = h.shape
    v = w.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    dw = torch.zeros(v, d, **f32)
    db = torch.zeros(v, **f32) if need_bias else None
    grid = (triton.cdiv(v, bl["BLOCK_V"]),)
    _lce_weight_grad_kernel[grid](
        h,
        w,
        bias if bias is not None else dw,
        y_local,
        lse.float().contiguous(),
        coef.float().contiguous(),
        wtok.float().contiguous(),
        dw,
        db if need_bias else dw,
        h.stride(0),
        h.stride(1),
        w.stride(0),
        w.stride(1),
        n,
        v,
        d,
        float(target_w),
        float(smooth),
        float(softcap or 0.0),
        HAS_BIAS=bias is not None,
        SOFTCAP=bool(softcap),
        NEED_BIAS=need_bias,
        DOT_PRECISION=dot_precision(h.dtype),
        EMULATE_BF16=emulate_bf16(h),
        num_warps=8 if h.is_cuda else 1,
        **bl,
    )
    return dw.to(w.dtype), db
