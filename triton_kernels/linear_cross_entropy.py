"""Triton kernels of linear cross-entropy (see resident_trainer/ops/linear_cross_entropy.py).

Four kernels, all deterministic (every output element has one owner program,
no atomics). Two are impl="triton", which forms the logits itself:

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

Two serve impl="torch" (cuBLAS forms the logits, a chunk of fp32 rows at a
time): ``_chunk_softmax_kernel`` (row statistics and exp(z - m) for the frozen
head's dh product) and ``_chunk_grad_kernel`` (G for the dW product).

tanh is written with exp (tanh(x) = 1 - 2 / (exp(2x) + 1)): exact in the limits
(+-1 when exp overflows or underflows) and available in the interpreter.
"""

import torch
import triton
import triton.language as tl

from resident_trainer.triton_kernels._common import cast, dot, dot_precision, emulate_bf16


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


# --- fused passes over a chunk of fp32 logits (the torch path's elementwise work) ---------
#
# The torch path (impl="torch") has cuBLAS write one chunk of fp32 logits at a
# time. What follows the product is elementwise: per token a max, a sum of
# exponentials and the target's logit, then exp(z - m) in the products'
# operand type for dh (frozen head), or G for dW. Done with torch ops that is
# about eight passes over the chunk; these kernels read it twice (frozen head)
# or once (G) and write the half-precision operand directly.


@triton.jit
def _chunk_logit(z_ptr, b_ptr, cols, mask, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """(z, t) at columns `cols` of one row (z_ptr its start): the logits (bias
    added, softcapped) with -inf where masked, and tanh(z_raw / softcap) (or z)."""
    z = tl.load(z_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    t = z
    if SOFTCAP:
        t = _tanh(z / softcap)
        z = softcap * t
    return tl.where(mask, z, float("-inf")), t


@triton.jit
def _chunk_softmax_kernel(
    z_ptr,
    b_ptr,
    y_ptr,
    p_ptr,
    slope_ptr,
    m_ptr,
    s_ptr,
    zy_ptr,
    sz_ptr,
    V,
    stride_z,
    stride_p,
    softcap,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    NEED_P: tl.constexpr,
    NEED_SLOPE: tl.constexpr,
    NEED_SZ: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per token row: row max m, sum_c exp(z_c - m), the target's
    logit, sum_c z_c (NEED_SZ); then (NEED_P) exp(z - m) * softcap'(z) and
    (NEED_SLOPE) softcap'(z) stored in p's and slope's dtype. p may be z itself
    (each element is read before the same program overwrites it)."""
    row = tl.program_id(0).to(tl.int64)
    zrow = z_ptr + row * stride_z
    m = tl.max(tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32), axis=0)
    s = tl.sum(tl.zeros((BLOCK_V,), dtype=tl.float32), axis=0)
    sz = s
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        mask = cols < V
        z, t = _chunk_logit(zrow, b_ptr, cols, mask, softcap, HAS_BIAS, SOFTCAP)
        if NEED_SZ:
            sz += tl.sum(tl.where(mask, z, 0.0), axis=0)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    y = tl.load(y_ptr + row)
    has = y >= 0
    yc = tl.where(has, y, 0).to(tl.int64)
    zt, _ = _chunk_logit(zrow, b_ptr, yc, has, softcap, HAS_BIAS, SOFTCAP)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(zy_ptr + row, tl.where(has, zt, 0.0))
    if NEED_SZ:
        tl.store(sz_ptr + row, sz)
    if NEED_P or NEED_SLOPE:
        prow = p_ptr + row * stride_p
        srow = slope_ptr + row * stride_p
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
            mask = cols < V
            z, t = _chunk_logit(zrow, b_ptr, cols, mask, softcap, HAS_BIAS, SOFTCAP)
            slope = 1.0 - t * t
            if NEED_P:
                p = tl.exp(z - m)
                if SOFTCAP:
                    p = p * slope
                tl.store(prow + cols, cast(p, p_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)
            if NEED_SLOPE:
                tl.store(srow + cols, cast(slope, slope_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


@triton.jit
def _chunk_grad_kernel(
    z_ptr,
    b_ptr,
    y_ptr,
    lse_ptr,
    coef_ptr,
    wtok_ptr,
    g_ptr,
    V,
    stride_z,
    stride_g,
    target_w,
    smooth,
    softcap,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """G = (exp(z - lse) coef - target_w wtok [c = y] - smooth wtok) softcap'(z)
    for one token row (axis 0) and one column block (axis 1), stored in g's
    dtype; g may be z itself."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    z, t = _chunk_logit(z_ptr + row * stride_z, b_ptr, cols, mask, softcap, HAS_BIAS, SOFTCAP)
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    wtok = tl.load(wtok_ptr + row)
    y = tl.load(y_ptr + row)
    g = tl.exp(z - lse) * coef - wtok * smooth
    g = g - tl.where(cols == y, wtok * target_w, 0.0)
    if SOFTCAP:
        g = g * (1.0 - t * t)
    tl.store(g_ptr + row * stride_g + cols, cast(g, g_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


# Columns per step of the chunk kernels: 16 KiB of fp32 logits, four warps.
CHUNK_BLOCK_V = 4096


def _chunk_launch(z):
    return dict(num_warps=4 if z.is_cuda else 1, BLOCK_V=min(CHUNK_BLOCK_V, triton.next_power_of_2(z.shape[1])))


def lce_chunk_softmax(z, bias, y_local, p, slope, softcap, need_sz):
    """(m, s, zy, sz or None), each (rows,) fp32, of a contiguous chunk of fp32
    logits z (rows, V) without the bias; fills p (rows, V) with exp(z - m) *
    softcap'(z) and slope with softcap'(z) where given (either may be None, p
    may be z)."""
    rows, v = z.shape
    f32 = dict(dtype=torch.float32, device=z.device)
    m, s, zy = (torch.empty(rows, **f32) for _ in range(3))
    sz = torch.empty(rows, **f32) if need_sz else None
    out = p if p is not None else slope
    if out is not None and (out.shape != z.shape or out.stride(1) != 1):
        raise ValueError("lce_chunk_softmax: p and slope must be contiguous and shaped like z")
    if slope is not None and p is not None and slope.stride(0) != p.stride(0):
        raise ValueError("lce_chunk_softmax: p and slope must have the same row stride")
    _chunk_softmax_kernel[(rows,)](
        z,
        bias if bias is not None else z,
        y_local.contiguous(),
        p if p is not None else (slope if slope is not None else z),
        slope if slope is not None else (p if p is not None else z),
        m,
        s,
        zy,
        sz if need_sz else m,
        v,
        z.stride(0),
        out.stride(0) if out is not None else 0,
        float(softcap or 0.0),
        HAS_BIAS=bias is not None,
        SOFTCAP=bool(softcap),
        NEED_P=p is not None,
        NEED_SLOPE=slope is not None,
        NEED_SZ=need_sz,
        EMULATE_BF16=out is not None and emulate_bf16(out),
        **_chunk_launch(z),
    )
    return m, s, zy, sz


def lce_chunk_grad(z, bias, y_local, lse, coef, wtok, g, target_w, smooth, softcap):
    """Fills g (shaped like the fp32 logit chunk z (rows, V) without the bias,
    or z itself) with the logit gradient G; y_local, lse, coef, wtok: (rows,),
    y_local relative to the chunk's first column (outside it: no target)."""
    rows, v = z.shape
    if g.shape != z.shape or g.stride(1) != 1:
        raise ValueError("lce_chunk_grad: g must be contiguous and shaped like z")
    launch = _chunk_launch(z)
    _chunk_grad_kernel[(rows, triton.cdiv(v, launch["BLOCK_V"]))](
        z,
        bias if bias is not None else z,
        y_local.contiguous(),
        lse.float().contiguous(),
        coef.float().contiguous(),
        wtok.float().contiguous(),
        g,
        v,
        z.stride(0),
        g.stride(0),
        float(target_w),
        float(smooth),
        float(softcap or 0.0),
        HAS_BIAS=bias is not None,
        SOFTCAP=bool(softcap),
        EMULATE_BF16=emulate_bf16(g),
        **launch,
    )
    return g
