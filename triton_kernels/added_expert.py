"""Triton kernels of the added-expert block ``out = (silu(x Wg^T) * (x Wu^T)) Wd^T``.

Two fused kernels carry everything that plain autograd spreads over many
launches; the plain products around them go to cuBLAS through ``torch.mm``,
which a hand-written Triton GEMM does not beat on Hopper:

- forward: gate and up of a tile in one K loop over x (two accumulators; the
  weights packed (2A, D) or apart), with the SwiGLU epilogue
  ``p = bf16(silu(gate)) * up`` in registers; stores p and (unless
  recomputing) the pre-activations h = [gate | up]. Then ``out = p @ Wd^T``.
- backward: ``dp = dout @ Wd`` with the whole elementwise backward in the
  epilogue; with ``RECOMPUTE`` the same K loop also rebuilds gate and up from
  x (both products contract over D, so they share the loop). Stores
  ``dh = [dgate | dup]`` and p. Then ``dWd = dout^T @ p``,
  ``dW_gu = dh^T @ x`` and ``dx = dh @ W_gu``: each one product.

Every product accumulates in fp32, in its own accumulator. Casts follow the
Hugging Face SwiGLU MLP: gate and up are rounded to the input dtype, silu(gate)
is rounded before the multiply, p is rounded. Launchers take already-validated
tensors (checks live in resident_trainer.ops.added_expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from resident_trainer.triton_kernels._common import cast as _cast
from resident_trainer.triton_kernels._common import dot as _dot
from resident_trainer.triton_kernels._common import dot_precision, emulate_bf16


@triton.jit
def _gate_up_tile(
    x_ptr,
    wg_ptr,
    wu_ptr,
    offs_m,
    offs_n,
    m_ok,
    n_ok,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    D,
    FP32_PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """(x @ Wg^T, x @ Wu^T) of one (BLOCK_M, BLOCK_N) tile, fp32, two accumulators."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    # W^T tiles (BLOCK_K, BLOCK_N). Gate and up share strides: the launcher
    # passes two row ranges of one packed weight, or two same-layout weights.
    w_off = offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    wg_ptrs = wg_ptr + w_off
    wu_ptrs = wu_ptr + w_off
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = offs_k < D - k0
        xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        # Separate accumulators: summing two products into one tl.dot
        # accumulator gave 45% error on Blackwell (Liger PR #1435).
        acc_g = _dot(xt, wg, acc_g, FP32_PRECISION, EMULATE_BF16)
        acc_u = _dot(xt, wu, acc_u, FP32_PRECISION, EMULATE_BF16)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    return acc_g, acc_u


@triton.jit
def _gate_up_forward_kernel(
    x_ptr,
    wg_ptr,
    wu_ptr,
    mask_ptr,
    h_ptr,
    p_ptr,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_hm,
    stride_pm,
    N,
    D,
    A,
    HAS_MASK: tl.constexpr,
    STORE_H: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """p = silu(x Wg^T) * (x Wu^T) with HF casts; optionally h = [x Wg^T | x Wu^T].

    x: (N, D); wg, wu: (A, D); mask: (N,) uint8; h: (N, 2A); p: (N, A).
    """
    # Neuron tiles vary fastest: the programs that run together share x's rows.
    n_tiles = tl.cdiv(A, BLOCK_N)
    pid = tl.program_id(0)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < N
    n_ok = offs_n < A
    acc_g, acc_u = _gate_up_tile(
        x_ptr, wg_ptr, wu_ptr, offs_m, offs_n, m_ok, n_ok, stride_xm, stride_xk, stride_wn, stride_wk, D,
        FP32_PRECISION, EMULATE_BF16, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    dtype = p_ptr.dtype.element_ty
    g = _cast(acc_g, dtype, EMULATE_BF16)
    u = _cast(acc_u, dtype, EMULATE_BF16)
    gf = g.to(tl.float32)
    a = _cast(gf * tl.sigmoid(gf), dtype, EMULATE_BF16)
    p = _cast(a.to(tl.float32) * u.to(tl.float32), dtype, EMULATE_BF16)
    if HAS_MASK:
        keep = tl.load(mask_ptr + offs_m, mask=m_ok, other=0) != 0
        p = tl.where(keep[:, None], p, tl.zeros_like(p))
    ok = m_ok[:, None] & n_ok[None, :]
    rows = offs_m[:, None].to(tl.int64)
    tl.store(p_ptr + rows * stride_pm + offs_n[None, :], p, mask=ok)
    if STORE_H:
        tl.store(h_ptr + rows * stride_hm + offs_n[None, :], g, mask=ok)
        tl.store(h_ptr + rows * stride_hm + A + offs_n[None, :], u, mask=ok)


@triton.jit
def _act_backward_kernel(
    dout_ptr,
    wd_ptr,
    x_ptr,
    wg_ptr,
    wu_ptr,
    h_ptr,
    mask_ptr,
    dh_ptr,
    p_ptr,
    stride_om,
    stride_ok,
    stride_wdk,
    stride_wdn,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_hm,
    stride_dhm,
    stride_pm,
    N,
    D,
    A,
    RECOMPUTE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dh = [dgate | dup] and p from dp = dout @ Wd and the pre-activations.

    torch: a = silu(g).to(dt); p = a * u; du = dp * a;
    dg = dp * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
    dout: (N, D); wd: (D, A); x: (N, D) and wg, wu: (A, D) when RECOMPUTE, else
    h: (N, 2A); mask: (N,) uint8; dh: (N, 2A); p: (N, A).
    """
    n_tiles = tl.cdiv(A, BLOCK_N)
    pid = tl.program_id(0)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < N
    n_ok = offs_n < A
    ok = m_ok[:, None] & n_ok[None, :]
    rows = offs_m[:, None].to(tl.int64)
    dtype = p_ptr.dtype.element_ty

    do_ptrs = dout_ptr + rows * stride_om + offs_k[None, :] * stride_ok
    wd_ptrs = wd_ptr + offs_k[:, None].to(tl.int64) * stride_wdk + offs_n[None, :] * stride_wdn
    acc_dp = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if RECOMPUTE:
        # Gate, up and dp all contract over D: one K loop, three accumulators.
        x_ptrs = x_ptr + rows * stride_xm + offs_k[None, :] * stride_xk
        w_off = offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        wg_ptrs = wg_ptr + w_off
        wu_ptrs = wu_ptr + w_off
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = offs_k < D - k0
        dot = tl.load(do_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wdt = tl.load(wd_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_dp = _dot(dot, wdt, acc_dp, FP32_PRECISION, EMULATE_BF16)
        do_ptrs += BLOCK_K * stride_ok
        wd_ptrs += BLOCK_K * stride_wdk
        if RECOMPUTE:
            xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_g = _dot(xt, wg, acc_g, FP32_PRECISION, EMULATE_BF16)
            acc_u = _dot(xt, wu, acc_u, FP32_PRECISION, EMULATE_BF16)
            x_ptrs += BLOCK_K * stride_xk
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_wk
    if RECOMPUTE:
        # The same roundings as the forward kernel.
        gf = _cast(acc_g, dtype, EMULATE_BF16).to(tl.float32)
        uf = _cast(acc_u, dtype, EMULATE_BF16).to(tl.float32)
    else:
        gf = tl.load(h_ptr + rows * stride_hm + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
        uf = tl.load(h_ptr + rows * stride_hm + A + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(gf)
    # The forward multiplied up by the rounded silu; its gradient uses the same.
    a = _cast(gf * s, dtype, EMULATE_BF16).to(tl.float32)
    p = _cast(a * uf, dtype, EMULATE_BF16)
    du = acc_dp * a
    dg = acc_dp * uf * (s * (1.0 + gf * (1.0 - s)))
    if HAS_MASK:
        keep = tl.load(mask_ptr + offs_m, mask=m_ok, other=0) != 0
        du = tl.where(keep[:, None], du, 0.0)
        dg = tl.where(keep[:, None], dg, 0.0)
        p = tl.where(keep[:, None], p, tl.zeros_like(p))
    tl.store(dh_ptr + rows * stride_dhm + offs_n[None, :], _cast(dg, dtype, EMULATE_BF16), mask=ok)
    tl.store(dh_ptr + rows * stride_dhm + A + offs_n[None, :], _cast(du, dtype, EMULATE_BF16), mask=ok)
    tl.store(p_ptr + rows * stride_pm + offs_n[None, :], p, mask=ok)


# --- launchers ----------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(n: int, a: int, dtype: torch.dtype, device: torch.device, three_accumulators: bool) -> TileConfig:
    """Deterministic tile sizes for (n tokens, a neurons). On Hopper-class GPUs,
    128x64 tiles with 64-deep K steps keep the tensor cores fed; three fp32
    accumulators (recomputing backward) need a 64-row tile to stay in
    registers. Small problems take smaller row tiles so that the grid still
    covers the SMs (A=64, N=512 is 4 programs at 128 rows)."""
    block_k = 32 if dtype == torch.float32 else 64
    block_n = 64
    block_m = 64 if three_accumulators else 128
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        while block_m > 16 and triton.cdiv(n, block_m) * triton.cdiv(a, block_n) < sms:
            block_m //= 2
    return TileConfig(block_m, block_n, block_k, num_warps=8 if block_m >= 64 else 4, num_stages=3)


def _mask_u8(token_mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if token_mask is None:
        return like  # never read: HAS_MASK is False
    return token_mask.contiguous().view(torch.uint8)


def _gate_up(w_gate: torch.Tensor, w_up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    # The kernels read gate and up with one pair of strides: two row ranges of
    # the packed weight, or two weights of the same layout (else copied).
    wg, wu = w_gate.chunk(2) if w_up is None else (w_gate, w_up)
    if wg.stride() != wu.stride():
        wg, wu = wg.contiguous(), wu.contiguous()
    return wg, wu


def added_expert_forward_triton(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    token_mask: torch.Tensor | None,
    store_pre: bool,
    config: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, h): out = (silu(x Wg^T) * (x Wu^T)) @ Wd^T, h = [x Wg^T | x Wu^T]
    ((0, 2A) when not store_pre). x: (N, D); w_gate, w_up: (A, D), or w_gate
    packed (2A, D) and w_up None; w_down: (D, A); token_mask: (N,) bool or
    None (False rows give exactly zero)."""
    n, d = x.shape
    a = w_down.shape[1]
    h = x.new_empty((n if store_pre else 0, 2 * a))
    if n == 0:
        return x.new_zeros((0, d)), h
    wg, wu = _gate_up(w_gate, w_up)
    p = x.new_empty((n, a))
    cfg = config or pick_config(n, a, x.dtype, x.device, three_accumulators=False)
    grid = (triton.cdiv(n, cfg.block_m) * triton.cdiv(a, cfg.block_n),)
    _gate_up_forward_kernel[grid](
        x, wg, wu, _mask_u8(token_mask, p), h, p,
        x.stride(0), x.stride(1), wg.stride(0), wg.stride(1), h.stride(0), p.stride(0),
        n, d, a,
        HAS_MASK=token_mask is not None, STORE_H=store_pre, FP32_PRECISION=dot_precision(x.dtype),
        EMULATE_BF16=emulate_bf16(x),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return torch.mm(p, w_down.t()), h


def added_expert_backward_triton(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    h: torch.Tensor | None,
    token_mask: torch.Tensor | None,
    need_dx: bool,
    need_dw_gate_up: bool,
    need_dw_down: bool,
    config: TileConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dW_gu, dWd) of the block for grad_out: (N, D), dW_gu packed
    (2A, D); recomputes the pre-activations from x when h is None. Gradients
    not asked for are None."""
    n, d = x.shape
    a = w_down.shape[1]
    if n == 0:
        return (
            x.new_zeros((0, d)) if need_dx else None,
            x.new_zeros((2 * a, d)) if need_dw_gate_up else None,
            torch.zeros_like(w_down) if need_dw_down else None,
        )
    recompute = h is None
    wg, wu = _gate_up(w_gate, w_up)
    dh = x.new_empty((n, 2 * a))
    p = x.new_empty((n, a))
    cfg = config or pick_config(n, a, x.dtype, x.device, three_accumulators=recompute)
    grid = (triton.cdiv(n, cfg.block_m) * triton.cdiv(a, cfg.block_n),)
    hh = p if recompute else h  # never read when recomputing
    _act_backward_kernel[grid](
        grad_out, w_down, x, wg, wu, hh, _mask_u8(token_mask, p), dh, p,
        grad_out.stride(0), grad_out.stride(1), w_down.stride(0), w_down.stride(1),
        x.stride(0), x.stride(1), wg.stride(0), wg.stride(1),
        hh.stride(0), dh.stride(0), p.stride(0),
        n, d, a,
        RECOMPUTE=recompute, HAS_MASK=token_mask is not None, FP32_PRECISION=dot_precision(x.dtype),
        EMULATE_BF16=emulate_bf16(x),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    dw_down = torch.mm(grad_out.t(), p) if need_dw_down else None
    dw_gate_up = torch.mm(dh.t(), x) if need_dw_gate_up else None
    # dx = [dgate | dup] @ W_gu: one K = 2A product against the packed weight
    # (a temporary copy when gate and up come apart), one fp32 accumulator.
    dx = torch.mm(dh, w_gate if w_up is None else torch.cat([w_gate, w_up])) if need_dx else None
    return dx, dw_gate_up, dw_down
