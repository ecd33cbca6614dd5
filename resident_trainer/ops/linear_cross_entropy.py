"""Linear cross-entropy: exact cross-entropy of ``input @ W.T`` against targets,
computed in vocabulary tiles, never allocating the ``[tokens x vocab]`` logits.

Read bottom-up: the oracle (materializes everything), the per-device kernels
that produce per-shard partials (running max, sum-exp and the running
``sum_c exp(z_c - m) W_c``), the combination of partials across vocabulary
shards, the torch.library ops with their autograd, then the public function.

Algorithm. The gradient of the loss w.r.t. the hidden state is
``softmax(h W^T) W - W[y]``: attention with Q=h and K=V=W. One online-softmax
pass over vocabulary tiles keeps, per token, the running max ``m``, the running
sum ``S = sum exp(z - m)`` and ``A = sum exp(z - m) W_c`` (rescaled when ``m``
moves), so the loss and ``dh`` come out of the forward pass with the matmul
FLOPs of the materializing version (2NDV for the logits, 2NDV for dh) and
O(tokens x tile) extra memory. dh is kept and scaled by the upstream gradient in
backward. When the weight (or bias) needs a gradient and the upstream gradient
is the same for every token, the CPU path instead walks token chunks, keeps one
chunk's logit rows (32 MiB) and forms dh and dW in the forward pass (6NDV, no
recompute); otherwise backward recomputes each logit tile once more for
``dW = G^T h`` (8NDV in all). docs/LINEAR_CROSS_ENTROPY.md has the table.

Vocabulary parallel. With a process group, W is this rank's rows
``[vocab_start, vocab_start + V_local)`` of the global head. Ranks all-reduce
MAX of ``m``, SUM of (rescaled sum-exp, target logit, logit sum), then SUM of
their partial dh, so every rank gets the exact global loss, lse and dh.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from resident_trainer import _ext
from resident_trainer.ops._gemm import _bucket, linear, linear_acc

IMPLS = ("auto", "cpu", "torch", "triton", "reference")
REDUCTIONS = ("mean", "sum", "none")


# --- the oracle: materializes the logits ----------------------------------------------


def linear_cross_entropy_reference(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    linear_bias: Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    return_lse: bool = False,
    dtype: torch.dtype = torch.float32,
    matmul_dtype: torch.dtype | None = None,
):
    """Plain-torch oracle: ``F.cross_entropy((input @ W.T + bias).to(dtype), target)``
    with optional softcap and z-loss, materializing the (N, V) logits in `dtype`
    (float32 by default; float64 for ground truth). Differentiable by autograd.
    `matmul_dtype` (default: `dtype`) is the dtype of the product itself:
    ``matmul_dtype=torch.bfloat16`` is what torch does for bf16 inputs.

    Per token: ``lse - (1 - label_smoothing) z_y - label_smoothing * mean_c z_c + z_loss * lse**2``, 0 for
    ignored tokens; "mean" divides by the number of non-ignored tokens (0 when
    there are none, where torch returns NaN)."""
    d = linear_weight.shape[-1]
    mdt = matmul_dtype or dtype
    h = input.reshape(-1, d).to(mdt)
    logits = h @ linear_weight.to(mdt).T
    if linear_bias is not None:
        logits = logits + linear_bias.to(mdt)
    logits = logits.to(dtype)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    y = target.reshape(-1)
    valid = y != ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    zy = logits.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    loss = lse - (1.0 - label_smoothing) * zy
    if label_smoothing:
        loss = loss - label_smoothing * logits.mean(-1)
    if z_loss:
        loss = loss + z_loss * lse.square()
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    out = _reduce(loss, valid, reduction, target.shape)
    return (out, lse.reshape(target.shape)) if return_lse else out


def _reduce(loss_tok: Tensor, valid: Tensor, reduction: str, shape) -> Tensor:
    if reduction == "none":
        return loss_tok.reshape(shape)
    total = loss_tok.sum()
    if reduction == "sum":
        return total
    # An all-ignored batch has loss 0 and zero gradients, never 0/0.
    return total / valid.sum().clamp(min=1).to(total.dtype)


def _reduce_exact(loss_tok: Tensor, valid: Tensor, reduction: str, shape) -> Tensor:
    """`_reduce` with the sum accumulated in fp64 and rounded once to fp32.

    The per-token losses are exact to a few fp32 ulps of one token's loss; an
    fp32 sum of them rounds at the size of the running total, ~N times larger,
    and that was the larger error. Measured (20 seeds, N=252, D=507, V=123,
    20% ignored, bf16 inputs, a 2-core Zen 3 EPYC; sums of 1500-4000): the sum's
    median error against fp64 went 1.11e-4 -> 8.5e-5 without softcap and
    7.0e-5 -> 2.9e-5 with softcap=4, where the per-token losses summed exactly
    are within 3.6e-5 and 2.9e-6 and the rest is the one rounding to fp32 (half
    an ulp of 4000 is 1.2e-4). Torch's own bf16 computation (the product in
    bf16) is 0.33 and 0.016 away. The fp64 sum costs N additions."""
    if reduction == "none":
        return loss_tok.reshape(shape)
    total = loss_tok.sum(dtype=torch.float64)
    if reduction == "mean":
        total = total / valid.sum().clamp(min=1)
    return total.to(loss_tok.dtype)


# --- per-shard partials ------------------------------------------------------------


@dataclass
class Partials:
    """Per token, over this shard's vocabulary tiles, with z the (softcapped)
    logits and m the running max:

    row_max: m; sum_exp: sum_c exp(z_c - m); target_logit: z_y where this
    shard holds the target (0 elsewhere); softmax_w: sum_c exp(z_c - m)
    softcap'(z_c) W_c (N, D), the unnormalised softmax-weighted head rows (for
    dh); slope_w: sum_c softcap'(z_c) W_c (N, D), only with softcap and label
    smoothing; logit_sum: sum_c z_c, only with softcap and label smoothing
    (otherwise it is h . colsum(W) + sum(bias), computed without tiles)."""

    row_max: Tensor
    sum_exp: Tensor
    target_logit: Tensor
    softmax_w: Tensor | None = None
    slope_w: Tensor | None = None
    logit_sum: Tensor | None = None


# Token block of the CPU path: up to 2048 tokens against one vocabulary tile
# (1024 rows keep the fp32 logit tile at 8 MiB, within L3). The block bounds
# the memory; the vocabulary tiles set the products' shapes, and they are
# chosen per CPU (below).
CPU_BLOCK_N = 2048

# --- CPU vocabulary tiles, chosen by measurement ------------------------------------
#
# Which tile is fastest depends on the CPU. On a 2-core Sapphire Rapids-class
# Xeon the weight-gradient path (N=2048, D=576, V=49152 fp32) took 1.25x of
# its matmul floor with 1024-row tiles and 1.04x with 4096-row ones; on a
# 2-core Zen 5 EPYC every tile from 1024 to 8192 rows was within the run's
# noise. With a frozen head, 4096-row tiles took 1.16x (Xeon: 1.02x of the
# floor against 0.88x) and 1.12-1.18x (Zen 5) the time of 1024-row ones, so
# they are not among its candidates.
#
# So each path picks its tile on the CPU it runs on, once per process and
# shape class. A class is the weight's dtype, the thread count, D, the token
# rows of a block (or chunk) rounded up to a power of two, the vocabulary
# rounded up and capped at the probe's slice, and the path's options. Before
# the class's first call, the path itself runs on that call's operands, cut to
# one token block (or chunk), _TILE_PROBE_V vocabulary rows and at most
# _TILE_PROBE_LOGITS logits, once with each candidate tile as a warm-up, then
# _TILE_PROBE_RUNS times alternating, and each tile's median time counts (a
# best time favours the tile with the widest spread). Each run reads the next slice of the
# vocabulary, so W streams from memory as in the real loop (a slice read again
# would come from cache). The fastest candidate is taken
# if it beats TILE_DEFAULT's by TILE_MARGIN (5%); otherwise TILE_DEFAULT
# stays. Smaller differences are the probe's noise: on a Zen 5 one probe
# measured 2048-row frozen-head tiles 3% faster than 1024-row ones, which
# were 13% faster over the whole vocabulary. All this costs 0.6-0.8 s,
# once, at N=2048, D=576 on two cores. A class whose candidates all cover its
# vocabulary in one tile measures nothing.
#
# RESIDENT_TRAINER_LCE_TILE_V and RESIDENT_TRAINER_LCE_WGRAD_TILE_V force a
# tile (rows; read on every call). CPU_TILE_V and CPU_WGRAD_TILE_V, set to a
# number, fix one in-process (the tests' small tiles). Otherwise
# RESIDENT_TRAINER_REPRODUCIBLE=1 takes TILE_DEFAULT without measuring (tiles
# sum the softmax in different orders). `tile_report()` lists what was
# chosen and measured.
TILE_ENV = {"frozen": "RESIDENT_TRAINER_LCE_TILE_V", "wgrad": "RESIDENT_TRAINER_LCE_WGRAD_TILE_V"}
TILE_CANDIDATES = {"frozen": (512, 1024, 2048), "wgrad": (1024, 2048, 4096, 8192)}
_TILE_PROBE_V = {"frozen": 4096, "wgrad": 8192}
TILE_DEFAULT = {"frozen": 1024, "wgrad": 4096}
TILE_MARGIN = 0.95
_TILE_PROBE_RUNS = 3
_TILE_PROBE_LOGITS = 8 << 20
CPU_TILE_V: int | None = None
CPU_WGRAD_TILE_V: int | None = None
_TILE_CHOICES: dict[tuple, tuple[int, dict[int, float]]] = {}  # class: (tile, median seconds)
_TILE_LOCK = threading.Lock()


def forced_tile(path: str) -> int | None:
    """The tile (vocabulary rows) `path` ("frozen" or "wgrad") is forced to by its
    environment variable, or None when that is unset (measured)."""
    name = TILE_ENV[path]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        rows = int(raw)
    except ValueError:
        rows = 0
    if rows <= 0:
        raise ValueError(f"{name} must be a positive number of vocabulary rows (unset: measured), got {raw!r}")
    return rows


def _choose_tile(path: str, key: tuple, v: int, probe) -> int:
    """The vocabulary tile for `path` on a class `key` of local vocabulary `v`:
    forced, fixed, or measured once with ``probe(tile, part)`` (see above),
    where each run takes the next `part` of the vocabulary."""
    forced = forced_tile(path)
    if forced is not None:
        return forced
    fixed = CPU_TILE_V if path == "frozen" else CPU_WGRAD_TILE_V
    if fixed is not None:
        return fixed
    span = min(v, _TILE_PROBE_V[path])
    if _ext.reproducible():
        return min(TILE_DEFAULT[path], span)
    candidates = sorted({min(c, span) for c in TILE_CANDIDATES[path]})
    if len(candidates) == 1 or torch.compiler.is_compiling():
        return candidates[0]
    key = (path, *key, min(_bucket(v), _TILE_PROBE_V[path]))
    hit = _TILE_CHOICES.get(key)
    if hit is None:
        with _TILE_LOCK:
            hit = _TILE_CHOICES.get(key)
            if hit is None:
                runs = {tile: [] for tile in candidates}
                part = 0
                with torch.no_grad():
                    for tile in candidates:
                        probe(tile, part)  # warm-up: the products' backends are measured here
                        part += 1
                    for _ in range(_TILE_PROBE_RUNS):
                        for tile in candidates:
                            t0 = time.perf_counter()
                            probe(tile, part)
                            runs[tile].append(time.perf_counter() - t0)
                            part += 1
                typical = {tile: statistics.median(times) for tile, times in runs.items()}
                default = min(TILE_DEFAULT[path], span)
                fastest = min(typical, key=typical.get)
                tile = fastest if typical[fastest] < TILE_MARGIN * typical[default] else default
                hit = _TILE_CHOICES[key] = (tile, typical)
    return hit[0]


def _probe_slice(v: int, span: int, part: int) -> int:
    """The first row of the probe's `part`-th slice of `span` vocabulary rows:
    each run reads rows the previous runs did not (while the vocabulary lasts),
    so W comes from memory as it does in the real loop, not from cache."""
    return (part % max(v // span, 1)) * span


def tile_report() -> str:
    """For benchmark output: the tile settings and each measured class's
    choice with every candidate's median probe time."""
    env = ", ".join(f"{n}={os.environ.get(n, '') or '(unset: measured)'}" for n in TILE_ENV.values())
    lines = [f"linear_cross_entropy CPU tiles: {env}"]
    for key, (tile, medians) in sorted(_TILE_CHOICES.copy().items(), key=str):
        path, dtype, threads, d, rows, *_, v = key
        times = ", ".join(f"{t} {s * 1e3:.1f} ms" for t, s in medians.items())
        lines.append(f"  {path} {str(dtype)[6:]} {threads} threads D={d} rows<={rows} V<={v}: {tile} rows ({times})")
    if len(lines) == 1:
        tiles = ", ".join(f"{p} {t} rows" for p, t in TILE_DEFAULT.items())
        lines.append(f"  no shape class measured{_ext.reproducible_note(f'the default tiles ({tiles})')}")
    return "\n".join(lines)


def _frozen_tile(h, w, bias, yl, softcap, need_softmax_w, need_slope_w, need_logit_sum) -> int:
    rows = min(h.shape[0], CPU_BLOCK_N)
    span = min(w.shape[0], _TILE_PROBE_V["frozen"])
    key = (w.dtype, torch.get_num_threads(), w.shape[1], _bucket(rows), bias is not None, bool(softcap))
    key += (need_softmax_w, need_slope_w, need_logit_sum)

    def probe(tile, part):
        v0 = _probe_slice(w.shape[0], span, part)
        _partials_cpu(
            h[:rows],
            w[v0 : v0 + span],
            None if bias is None else bias[v0 : v0 + span],
            yl[:rows] - v0,
            softcap,
            need_softmax_w,
            need_slope_w,
            need_logit_sum,
            tile_v=tile,
        )

    return _choose_tile("frozen", key, w.shape[0], probe)


def _tile(buf: Tensor, rows: int, cols: int) -> Tensor:
    """A contiguous (rows, cols) view of the front of a flat scratch buffer."""
    return buf[: rows * cols].view(rows, cols)


def _logit_tile_cpu(hb: Tensor, wt: Tensor, bias: Tensor | None) -> Tensor:
    """hb @ wt.T (+ bias) in fp32, a new contiguous (rows, cols) tile."""
    z = linear(hb, wt)
    if bias is not None:
        z.add_(bias)
    return z


def _partials_cpu(
    h: Tensor,
    w: Tensor,
    bias: Tensor | None,
    yl: Tensor,
    softcap: float,
    need_softmax_w: bool,
    need_slope_w: bool,
    need_logit_sum: bool,
    tile_v: int | None = None,
) -> Partials:
    _ext.require_extension("linear_cross_entropy (impl='cpu')")
    n, d = h.shape
    v = w.shape[0]
    if tile_v is None:
        tile_v = _frozen_tile(h, w, bias, yl, softcap, need_softmax_w, need_slope_w, need_logit_sum)
    f32 = dict(dtype=torch.float32, device=h.device)
    row_max = torch.full((n,), float("-inf"), **f32)
    sum_exp = torch.zeros(n, **f32)
    softmax_w = torch.zeros(n, d, **f32) if need_softmax_w else None
    slope_w = torch.zeros(n, d, **f32) if need_slope_w else None
    logit_sum = torch.zeros(n, **f32) if need_logit_sum else None
    target_logit = torch.zeros(n, **f32)
    yl = yl.contiguous()
    # One softcap slope tile reused for every tile: the peak stays at a few
    # tiles' worth however large V is.
    slope_buf = (
        torch.empty(min(n, CPU_BLOCK_N) * min(v, tile_v), **f32)
        if softcap and (need_softmax_w or need_slope_w)
        else None
    )
    ops = torch.ops.resident_trainer
    for n0 in range(0, n, CPU_BLOCK_N):
        n1 = min(n, n0 + CPU_BLOCK_N)
        hb = h[n0:n1].float()
        for v0 in range(0, v, tile_v):
            v1 = min(v, v0 + tile_v)
            wt = w[v0:v1] if w.dtype == torch.float32 else w[v0:v1].float()
            z = _logit_tile_cpu(hb, wt, None if bias is None else bias[v0:v1].float())
            slope = _tile(slope_buf, n1 - n0, v1 - v0) if slope_buf is not None else None
            # softcap, running max / sum-exp, p = exp(z - m) (times softcap'
            # for the dh accumulator) in one pass over the tile
            # (the kernel also rescales the rows of softmax_w whose max moved, and
            # picks up each target's logit when this tile holds it)
            ops.lce_online_update(
                z,
                row_max[n0:n1],
                sum_exp[n0:n1],
                slope,
                None if logit_sum is None else logit_sum[n0:n1],
                None if softmax_w is None else softmax_w[n0:n1],
                yl[n0:n1],
                target_logit[n0:n1],
                v0,
                float(softcap),
                bool(need_softmax_w and softcap),
            )
            if need_softmax_w:
                linear_acc(softmax_w[n0:n1], z, wt.T)
            if need_slope_w:
                linear_acc(slope_w[n0:n1], slope, wt.T)
    return Partials(row_max, sum_exp, target_logit, softmax_w, slope_w, logit_sum)


def _weight_grad_cpu(
    h: Tensor,
    w: Tensor,
    bias: Tensor | None,
    y_local: Tensor,
    lse: Tensor,
    coef: Tensor,
    wtok: Tensor,
    target_w: float,
    smooth: float,
    softcap: float,
    need_bias: bool,
) -> tuple[Tensor, Tensor | None]:
    """dW = G^T h and dbias = sum_n G over this shard, recomputing each logit tile:
    G[n, c] = softcap'(z) * (coef[n] p[n, c] - wtok[n] (target_w [c == y_n] + smooth)),
    p = exp(z - lse). Vocabulary tiles are the outer loop, so each dW tile is
    finished (accumulated in fp32 over all tokens) and stored once."""
    _ext.require_extension("linear_cross_entropy (impl='cpu')")
    n, d = h.shape
    v = w.shape[0]
    lse, coef, wtok = lse.float().contiguous(), coef.float().contiguous(), wtok.float().contiguous()
    y_local = y_local.contiguous()
    h32 = h.float()
    f32 = dict(dtype=torch.float32, device=h.device)
    dw = torch.empty_like(w)
    db = torch.zeros(v, **f32) if need_bias else None
    # the same products as the forward pass's with dh: its measured tile
    tile_v = _frozen_tile(h, w, bias, y_local, softcap, True, False, False)
    for v0 in range(0, v, tile_v):
        v1 = min(v, v0 + tile_v)
        wt = w[v0:v1] if w.dtype == torch.float32 else w[v0:v1].float()
        dwt = dw[v0:v1] if w.dtype == torch.float32 else torch.empty(v1 - v0, d, **f32)
        dwt.zero_()
        for n0 in range(0, n, CPU_BLOCK_N):
            n1 = min(n, n0 + CPU_BLOCK_N)
            hb = h32[n0:n1]
            g = _logit_tile_cpu(hb, wt, None if bias is None else bias[v0:v1].float())
            # G in place over the logit tile, softcap and target included
            torch.ops.resident_trainer.lce_grad_tile(
                g,
                lse[n0:n1],
                coef[n0:n1],
                wtok[n0:n1],
                y_local[n0:n1],
                v0,
                float(target_w),
                float(smooth),
                float(softcap),
                None,
            )
            linear_acc(dwt, g.T, hb.T)
            if need_bias:
                db[v0:v1] += g.sum(0)
        if dwt.data_ptr() != dw[v0:v1].data_ptr():
            dw[v0:v1] = dwt
    return dw, db


# Token rows per gather of target rows of W (bounds those (rows, D) temporaries).
_GATHER_ROWS = 256

# Logit budget of the weight-gradient path (its vocabulary tile is measured:
# see _choose_tile). Each chunk of tokens reads all of W twice and reads and
# writes all of dW once, so fewer, larger chunks move less memory; wider
# tiles mean fewer, larger products. Side by side on a 2-core Sapphire
# Rapids-class Xeon (N=2048, D=576, V=49152 fp32, dW, medians of 3, against
# 3 x h @ W.T): 32 MiB and 1024-row tiles 1.25x of that floor, 32 MiB and
# 4096 1.14x, 64 MiB and 4096 1.04x, 128 MiB and 4096 1.03x. On a loaded
# Zen 3: 8 MiB 5.2 s, 32 MiB 3.2 s, 128 MiB 2.6 s. 64 MiB (341-row chunks here) is 6% of what eager torch
# allocates at this shape. On a 2-core Zen 5, with 4096-row tiles: 32 MiB
# 1.24 s, 64 MiB 1.19 s, 128 MiB 1.21 s (medians of 3).
CPU_CHUNK_BYTES = 64 << 20


def _combine(big_m, s_loc, zy, sz, valid, group, vocab, label_smoothing, z_loss) -> tuple[Tensor, Tensor, Tensor]:
    """(lse, loss, s) of a chunk of tokens, from this shard's sum of exp(z -
    big_m) (big_m: the row max over every shard), target logit (0 where the
    target is elsewhere) and logit sum, each summed over the shards of
    `group` (s: the summed exp); the loss is 0 where not `valid`."""
    stats = torch.stack([s_loc, zy, sz])
    if group is not None:
        dist.all_reduce(stats, group=group)
    s_tot, zy, sz = stats.unbind(0)
    lse = big_m + torch.log(s_tot)
    loss = lse - (1.0 - label_smoothing) * zy
    if label_smoothing:
        loss = loss - (label_smoothing / vocab) * sz
    if z_loss:
        loss = loss + z_loss * lse.square()
    return lse, torch.where(valid, loss, torch.zeros_like(loss)), s_tot


def _forward_weight_grad_cpu(
    h,
    w,
    bias,
    valid,
    yl,
    sz_all,
    vocab,
    v_largest,
    label_smoothing,
    softcap,
    z_loss,
    group,
    need_dh,
    need_bias,
    tile_v=None,
):
    """Loss, lse, dh and the unit-weight dW/dbias in one pass over token chunks,
    each chunk's full logit rows kept (as vocabulary tiles) within a bounded
    budget: 2NDV for the logits, 2NDV for dh, 2NDV for dW, no recompute. Valid
    when the upstream gradient is the same for every token (reduction "mean"
    or "sum", lse not returned): backward scales dW by it. Each chunk's
    statistics are combined across vocabulary shards before its gradients are
    formed."""
    _ext.require_extension("linear_cross_entropy (impl='cpu')")
    ops = torch.ops.resident_trainer
    n, d = h.shape
    v = w.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    # Every rank must cut the same chunks (their statistics are all-reduced
    # chunk by chunk), so the size follows the largest shard, not this one.
    chunk = max(16, min(n, CPU_CHUNK_BYTES // (4 * max(v_largest, 1) * (2 if softcap else 1))))
    if tile_v is None:
        # Each rank may pick its own tile: the collectives are per chunk, not per tile.
        span = min(v, _TILE_PROBE_V["wgrad"])
        key = (w.dtype, torch.get_num_threads(), d, _bucket(chunk), bias is not None, bool(softcap), need_dh)

        def probe(tile, part):  # one chunk, cut to at most _TILE_PROBE_LOGITS logits
            c = slice(0, min(chunk, max(256, _TILE_PROBE_LOGITS // span)))
            v0 = _probe_slice(v, span, part)
            _forward_weight_grad_cpu(
                h[c],
                w[v0 : v0 + span],
                None if bias is None else bias[v0 : v0 + span],
                valid[c],
                yl[c] - v0,
                sz_all[c],
                vocab,
                v_largest,
                label_smoothing,
                softcap,
                z_loss,
                None,
                need_dh,
                need_bias,
                tile_v=tile,
            )

        tile_v = _choose_tile("wgrad", key, v, probe)
    dw = torch.zeros(v, d, **f32)
    db = torch.zeros(v, **f32) if need_bias else torch.empty(0, **f32)
    dh = torch.zeros(n, d, **f32) if need_dh else torch.empty(0, **f32)
    loss = torch.empty(n, **f32)
    lse = torch.empty(n, **f32)
    bounds = [(v0, min(v, v0 + tile_v)) for v0 in range(0, v, tile_v)]
    for n0 in range(0, n, chunk):
        n1 = min(n, n0 + chunk)
        c = n1 - n0
        hc = h[n0:n1].float()
        ylc = yl[n0:n1].contiguous()
        # The chunk's logits as vocabulary tiles: every product is against a
        # tile of W, so no backend ever repacks the whole head.
        tiles, slopes = [], []
        big_m = torch.full((c,), float("-inf"), **f32)
        zsum = torch.zeros(c, **f32)
        zy = torch.zeros(c, **f32)
        for v0, v1 in bounds:
            wt = w[v0:v1] if w.dtype == torch.float32 else w[v0:v1].float()
            z = _logit_tile_cpu(hc, wt, None if bias is None else bias[v0:v1].float())
            slope = torch.empty_like(z) if softcap else None
            tm, ts = ops.lce_row_max_sum(z, slope, float(softcap))  # softcap applied in place
            torch.maximum(big_m, tm, out=big_m)
            zsum += ts
            rows = ((ylc >= v0) & (ylc < v1)).nonzero().squeeze(1)
            if rows.numel():
                zy[rows] = z[rows, ylc[rows] - v0]
            tiles.append(z)
            slopes.append(slope)
        sz = zsum if (label_smoothing and softcap) else sz_all[n0:n1]
        if group is not None:
            dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
        s_loc = torch.zeros(c, **f32)
        for z in tiles:
            s_loc += ops.lce_row_exp_sum(z, big_m)
        vc = valid[n0:n1]
        lse_c, loss[n0:n1], _ = _combine(big_m, s_loc, zy, sz, vc, group, vocab, label_smoothing, z_loss)
        lse[n0:n1] = lse_c
        # G = valid * (softmax * (1 + 2 z_loss lse) - (1 - label_smoothing) onehot - label_smoothing / V) * softcap'
        wtok = vc.float()
        coef = wtok * (1.0 + 2.0 * z_loss * lse_c) if z_loss else wtok
        dh_c = dh[n0:n1] if need_dh else None
        for (v0, v1), g, slope in zip(bounds, tiles, slopes):
            ops.lce_grad_tile(g, lse_c, coef, wtok, ylc, v0, 1.0 - label_smoothing, label_smoothing / vocab, 0.0, slope)
            wt = w[v0:v1] if w.dtype == torch.float32 else w[v0:v1].float()
            if need_dh:
                linear_acc(dh_c, g, wt.T)
            # the transposed operand, which oneDNN copies, is one tile
            linear_acc(dw[v0:v1], g.T, hc.T)
            if need_bias:
                db[v0:v1] += g.sum(0)
        del tiles, slopes
    if need_dh and group is not None:
        dist.all_reduce(dh, group=group)
    # fp32 even for 16-bit heads: backward still multiplies by the upstream
    # gradient, and rounding before that multiply would round twice.
    return loss, lse, dh, dw, db


# --- the torch path: library products over chunks (impl="torch"; "auto" on GPUs) --------
#
# On a GPU the products are most of the work, and cuBLAS runs them near the
# card's peak. On an H200 (N=8192, D=4096, V=128256, bf16, frozen head) the
# Triton kernels, one program per 64 tokens walking the whole vocabulary,
# took 8.1x the time of the two products alone; this path 1.72x (2.21x with
# dW), the rest being its elementwise passes over the fp32 chunks
# (docs/RESULTS.md, "GPU"). This path computes one chunk of
# logits at a time with torch.mm (fp32 results from bf16/fp16 operands on
# CUDA), does the softmax work with torch ops in place, and feeds the
# products for dh and dW. Frozen head: row chunks holding every vocabulary
# column (no online rescaling). Weight gradient: in backward on vocabulary
# tiles holding every token, so each dW tile is written once; or, for a
# reduced loss where TORCH_WGRAD_FORWARD says so, in forward from the frozen
# head's row chunks (_forward_weight_grad_torch, three products in all).
#
# TORCH_CHUNK_BYTES bounds one chunk's fp32 logits (RESIDENT_TRAINER_LCE_CHUNK_MIB
# overrides it, read on every call).
#
# The elementwise work on a chunk goes through two Triton kernels
# (triton_kernels/linear_cross_entropy.py, "fused passes") where the chunk is
# on a GPU and Triton is installed: they read the chunk twice (frozen head) or
# once (G) where the torch ops make about eight passes, and write the
# products' half-precision operand directly. TORCH_FUSED (None: on CUDA with
# Triton; True, False: always, never) and RESIDENT_TRAINER_LCE_FUSED=0/1
# (read on every call, over TORCH_FUSED) choose; the tests run both on CPUs,
# the kernels under Triton's interpreter.
TORCH_CHUNK_BYTES = 256 << 20
TORCH_MIN_TILE_V = 1024  # the weight gradient's narrowest vocabulary tile
TORCH_FUSED: bool | None = None
# Weight gradients of a reduced loss in forward (_forward_weight_grad_torch):
# each row chunk's logits feed dh and dW, three products instead of four, but
# dW then adds up over the row chunks, so each chunk reads and writes the
# whole (V, D) fp32 dW. On a 2-core CPU that is cheap beside the products
# (0.71x the recomputing path's time at N=2048, D=576, V=49152 fp32); on an
# H200 at the Llama-3-8B head (523-row chunks) the 16 read-writes of a 2 GiB
# dW come to about what the recompute costs, so GPUs keep the recompute
# until it is measured there. None: on CPUs only; True, False: always,
# never; RESIDENT_TRAINER_LCE_WGRAD_FORWARD=0/1 (read on every call) over it.
TORCH_WGRAD_FORWARD: bool | None = None
_OUT_DTYPE_MM: dict[str, bool] = {}  # device type: torch.mm takes out_dtype there


def _torch_chunk_bytes() -> int:
    env = os.environ.get("RESIDENT_TRAINER_LCE_CHUNK_MIB", "").strip()
    if env:
        try:
            mib = float(env)
        except ValueError:
            mib = 0.0
        if not mib > 0:
            raise ValueError(f"RESIDENT_TRAINER_LCE_CHUNK_MIB must be a positive number of MiB, got {env!r}")
        return max(4, int(mib * 2**20))
    return TORCH_CHUNK_BYTES


def _torch_fused(device: torch.device) -> bool:
    """Whether the torch path's elementwise work on `device` runs in the Triton chunk kernels."""
    env = os.environ.get("RESIDENT_TRAINER_LCE_FUSED", "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"RESIDENT_TRAINER_LCE_FUSED must be 0 or 1, got {env!r}")
        want = env == "1"
    elif TORCH_FUSED is not None:
        want = TORCH_FUSED
    else:
        return device.type == "cuda" and _ext.HAS_TRITON
    if want:
        _ext.require_triton("linear_cross_entropy (impl='torch' with RESIDENT_TRAINER_LCE_FUSED=1)")
        if device.type != "cuda" and not _ext.triton_interpreted():
            raise ValueError(
                "RESIDENT_TRAINER_LCE_FUSED=1 needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), "
                f"got tensors on {device}"
            )
    return want


def _torch_wgrad_forward(device: torch.device) -> bool:
    """Whether the torch path forms a reduced loss's weight gradients in forward on `device`."""
    env = os.environ.get("RESIDENT_TRAINER_LCE_WGRAD_FORWARD", "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"RESIDENT_TRAINER_LCE_WGRAD_FORWARD must be 0 or 1, got {env!r}")
        return env == "1"
    if TORCH_WGRAD_FORWARD is not None:
        return TORCH_WGRAD_FORWARD
    return device.type != "cuda"


def _mm32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with fp32 results. Half-precision operands keep their fp32
    accumulators: torch.mm's out_dtype on CUDA; elsewhere (or in a torch
    without it) the operands go to fp32 first."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b)
    half = a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
    if half and a.is_cuda and _OUT_DTYPE_MM.get("cuda", True):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            _OUT_DTYPE_MM["cuda"] = False
    return torch.mm(a.float(), b.float())


def _addmm32(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """c += a @ b for an fp32 c, rounding the sum once (the product is not
    rounded to fp32 on its own first where the library can help it)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return c.addmm_(a, b)
    if a.is_cuda and _OUT_DTYPE_MM.get("cuda", True):
        try:  # in place: c may be the whole (V, D) dW
            return torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        except (RuntimeError, TypeError):
            pass
        try:
            return c.copy_(torch.addmm(c, a, b, out_dtype=torch.float32))
        except (RuntimeError, TypeError):
            pass
    return c.add_(_mm32(a, b))


def _capped(z: Tensor, softcap: float, need_slope: bool) -> Tensor | None:
    """softcap * tanh(z / softcap) in place on z; returns the slope 1 - tanh^2
    (a new tensor) when asked for."""
    z.div_(softcap).tanh_()
    slope = torch.mul(z, z).neg_().add_(1.0) if need_slope else None
    z.mul_(softcap)
    return slope


def _partials_torch(
    h: Tensor,
    w: Tensor,
    bias: Tensor | None,
    yl: Tensor,
    softcap: float,
    need_softmax_w: bool,
    need_slope_w: bool,
    need_logit_sum: bool,
) -> Partials:
    n, d = h.shape
    v = w.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    row_max = torch.empty(n, **f32)
    sum_exp = torch.empty(n, **f32)
    target_logit = torch.zeros(n, **f32)
    softmax_w = torch.empty(n, d, **f32) if need_softmax_w else None
    slope_w = torch.empty(n, d, **f32) if need_slope_w else None
    logit_sum = torch.empty(n, **f32) if need_logit_sum else None
    rows = max(1, min(n, _torch_chunk_bytes() // (4 * v)))
    wt = w.t()
    b32 = None if bias is None else bias.float()
    pdt = torch.float32 if w.dtype == torch.float32 else w.dtype  # the products' operand type
    fused = _torch_fused(h.device)
    if fused:
        from resident_trainer.triton_kernels.linear_cross_entropy import lce_chunk_softmax
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        z = _mm32(h[n0:n1], wt)
        if fused:
            p = None
            if softmax_w is not None:  # fp32 operands: exp(z - m) overwrites the logits
                p = z if pdt == torch.float32 else torch.empty(z.shape, dtype=pdt, device=z.device)
            slope = torch.empty(z.shape, dtype=pdt, device=z.device) if slope_w is not None else None
            m, s, zy, sz = lce_chunk_softmax(z, b32, yl[n0:n1], p, slope, softcap, logit_sum is not None)
            row_max[n0:n1], sum_exp[n0:n1], target_logit[n0:n1] = m, s, zy
            if logit_sum is not None:
                logit_sum[n0:n1] = sz
            if softmax_w is not None:
                softmax_w[n0:n1] = _mm32(p, w)
            if slope_w is not None:
                slope_w[n0:n1] = _mm32(slope, w)
            del z, p, slope
            continue
        if b32 is not None:
            z.add_(b32)
        slope = _capped(z, softcap, need_softmax_w or need_slope_w) if softcap else None
        y = yl[n0:n1]
        has = y >= 0
        zy = z.gather(1, y.clamp_min(0)[:, None]).squeeze(1)
        target_logit[n0:n1] = torch.where(has, zy, torch.zeros_like(zy))
        if logit_sum is not None:
            logit_sum[n0:n1] = z.sum(1)
        m = z.amax(1)
        row_max[n0:n1] = m
        z.sub_(m[:, None]).exp_()
        sum_exp[n0:n1] = z.sum(1)
        if softmax_w is not None:
            if slope is not None:
                z.mul_(slope)
            softmax_w[n0:n1] = _mm32(z.to(pdt), w)
        if slope_w is not None:
            slope_w[n0:n1] = _mm32(slope.to(pdt), w)
        del z, slope
    return Partials(row_max, sum_exp, target_logit, softmax_w, slope_w, logit_sum)


def _weight_grad_torch(
    h: Tensor,
    w: Tensor,
    bias: Tensor | None,
    y_local: Tensor,
    lse: Tensor,
    coef: Tensor,
    wtok: Tensor,
    target_w: float,
    smooth: float,
    softcap: float,
    need_bias: bool,
) -> tuple[Tensor, Tensor | None]:
    """dW = G^T h and dbias = sum_n G (G as in _weight_grad_cpu), one
    vocabulary tile of every token's logits at a time; when the tokens are
    too many for one tile's budget, row chunks add into an fp32 tile."""
    n, d = h.shape
    v = w.shape[0]
    if n == 0:
        return torch.zeros_like(w), torch.zeros(v, dtype=torch.float32, device=h.device) if need_bias else None
    budget = _torch_chunk_bytes()
    cols = max(1, min(v, budget // (4 * n)))
    if cols < min(v, TORCH_MIN_TILE_V):  # many tokens: narrowest tiles, rows in chunks
        cols = min(v, TORCH_MIN_TILE_V)
    rows = max(1, min(n, budget // (4 * cols)))
    lse, coef, wtok = lse.float(), coef.float(), wtok.float()
    pdt = torch.float32 if w.dtype == torch.float32 else w.dtype
    f32 = dict(dtype=torch.float32, device=h.device)
    dw = torch.empty_like(w)
    db = torch.zeros(v, **f32) if need_bias else None
    fused = _torch_fused(h.device)
    if fused:
        from resident_trainer.triton_kernels.linear_cross_entropy import lce_chunk_grad
    for v0 in range(0, v, cols):
        v1 = min(v, v0 + cols)
        wt = w[v0:v1].t()
        b_tile = None if bias is None else bias[v0:v1].float()
        acc = None
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            hb = h[n0:n1]
            g = _mm32(hb, wt)
            if fused:
                # dbias sums the fp32 G, so then G overwrites the logits
                gp = g if (pdt == torch.float32 or db is not None) else torch.empty(g.shape, dtype=pdt, device=g.device)
                lce_chunk_grad(
                    g, b_tile, y_local[n0:n1] - v0, lse[n0:n1], coef[n0:n1], wtok[n0:n1], gp, target_w, smooth, softcap
                )
                if db is not None:
                    db[v0:v1] += gp.sum(0)
                gp = gp.to(pdt)
                hp = hb.to(pdt)
                acc = _mm32(gp.t(), hp) if acc is None else _addmm32(acc, gp.t(), hp)
                del g, gp
                continue
            if b_tile is not None:
                g.add_(b_tile)
            slope = _capped(g, softcap, True) if softcap else None
            g.sub_(lse[n0:n1, None]).exp_().mul_(coef[n0:n1, None])
            y = y_local[n0:n1] - v0
            here = ((y >= 0) & (y < v1 - v0)).nonzero().squeeze(1)
            if here.numel():
                g.index_put_((here, y[here]), -target_w * wtok[n0:n1][here], accumulate=True)
            if smooth:
                g.sub_((smooth * wtok[n0:n1])[:, None])
            if slope is not None:
                g.mul_(slope)
            acc = _mm32(g.t().to(pdt), hb.to(pdt)) if acc is None else _addmm32(acc, g.t().to(pdt), hb.to(pdt))
            if db is not None:
                db[v0:v1] += g.sum(0)
            del g, slope
        dw[v0:v1] = acc
    return dw, db


def _forward_weight_grad_torch(
    h, w, bias, valid, yl, sz_all, vocab, v_largest, label_smoothing, softcap, z_loss, group, need_dh, need_bias
):
    """_forward_weight_grad_cpu's contract on the torch path: row chunks
    holding every vocabulary column, each chunk's logits formed once and fed
    to both gradient products (three products in all, where forward and a
    recomputing backward take four). dW is accumulated in fp32 over the
    chunks. n > 0 (_forward answers an empty batch itself)."""
    n, d = h.shape
    v = w.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    pdt = torch.float32 if w.dtype == torch.float32 else w.dtype
    fused = _torch_fused(h.device)
    if fused:
        from resident_trainer.triton_kernels.linear_cross_entropy import lce_chunk_grad, lce_chunk_softmax
    # Every rank cuts the same chunks (their statistics are all-reduced chunk
    # by chunk): the size follows the largest shard. Without the kernels a
    # softcap keeps its slope beside the logits.
    rows = max(1, min(n, _torch_chunk_bytes() // (4 * max(v_largest, 1) * (2 if softcap and not fused else 1))))
    wt = w.t()
    b32 = None if bias is None else bias.float()
    target_w, smooth = 1.0 - label_smoothing, label_smoothing / vocab
    per_chunk_sum = bool(label_smoothing and softcap)  # else sz_all holds the logit sums
    dw = None
    db = torch.zeros(v, **f32) if need_bias else torch.empty(0, **f32)
    dh = torch.empty(n, d, **f32) if need_dh else torch.empty(0, **f32)
    loss = torch.empty(n, **f32)
    lse = torch.empty(n, **f32)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        hc, yc, vc = h[n0:n1], yl[n0:n1], valid[n0:n1]
        z = _mm32(hc, wt)
        if fused:
            m, s_loc, zy, zsum = lce_chunk_softmax(z, b32, yc, None, None, softcap, per_chunk_sum)
            big_m = m.clone()
            if group is not None:
                dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
            s_loc = s_loc * torch.exp(m - big_m)
        else:
            if b32 is not None:
                z.add_(b32)
            slope = _capped(z, softcap, True) if softcap else None
            has = yc >= 0
            zy = torch.where(has, z.gather(1, yc.clamp_min(0)[:, None]).squeeze(1), 0.0)
            zsum = z.sum(1) if per_chunk_sum else None
            big_m = z.amax(1)
            if group is not None:
                dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
            s_loc = z.sub_(big_m[:, None]).exp_().sum(1)  # z now holds exp(z - big_m)
        sz = zsum if per_chunk_sum else sz_all[n0:n1]
        lse_c, loss[n0:n1], _ = _combine(big_m, s_loc, zy, sz, vc, group, vocab, label_smoothing, z_loss)
        lse[n0:n1] = lse_c
        # G = valid * (softmax * (1 + 2 z_loss lse) - (1 - label_smoothing) onehot - label_smoothing / V) * softcap'
        wtok = vc.float()
        coef = wtok * (1.0 + 2.0 * z_loss * lse_c) if z_loss else wtok
        if fused:
            g = z if (pdt == torch.float32 or need_bias) else torch.empty(z.shape, dtype=pdt, device=z.device)
            lce_chunk_grad(z, b32, yc, lse_c, coef, wtok, g, target_w, smooth, softcap)
        else:
            g = z.mul_((torch.exp(big_m - lse_c) * coef)[:, None])
            # the target's -1 for every token, times 0 where it is elsewhere (no host wait)
            g.scatter_add_(1, yc.clamp_min(0)[:, None], torch.where(has, -target_w * wtok, 0.0)[:, None])
            if smooth:
                g.sub_((smooth * wtok)[:, None])
            if slope is not None:
                g.mul_(slope)
            del slope
        if need_bias:
            db += g.sum(0)
        g = g.to(pdt)
        if need_dh:
            dh[n0:n1] = _mm32(g, w)
        hp = hc.to(pdt)
        dw = _mm32(g.t(), hp) if dw is None else _addmm32(dw, g.t(), hp)
        del z, g
    if need_dh and group is not None:
        dist.all_reduce(dh, group=group)
    return loss, lse, dh, dw, db


# --- dispatch to a device's kernels ------------------------------------------------------


def _resolve_impl(impl: str, device: torch.device) -> str:
    return _ext.resolve_impl("linear_cross_entropy", impl, IMPLS, device, gpu_auto="torch")


def _partials(h, w, bias, yl, softcap, need_softmax_w, need_slope_w, need_logit_sum, impl) -> Partials:
    if impl == "triton":
        _ext.require_triton("linear_cross_entropy (impl='triton')")
        from resident_trainer.triton_kernels.linear_cross_entropy import lce_partials_triton

        return Partials(*lce_partials_triton(h, w, bias, yl, softcap, need_softmax_w, need_slope_w, need_logit_sum))
    if impl == "torch":
        return _partials_torch(h, w, bias, yl, softcap, need_softmax_w, need_slope_w, need_logit_sum)
    return _partials_cpu(h, w, bias, yl, softcap, need_softmax_w, need_slope_w, need_logit_sum)


def _weight_grad(h, w, bias, y_local, lse, coef, wtok, target_w, smooth, softcap, need_bias, impl):
    if impl == "triton":
        from resident_trainer.triton_kernels.linear_cross_entropy import lce_weight_grad_triton

        return lce_weight_grad_triton(h, w, bias, y_local, lse, coef, wtok, target_w, smooth, softcap, need_bias)
    if impl == "torch":
        return _weight_grad_torch(h, w, bias, y_local, lse, coef, wtok, target_w, smooth, softcap, need_bias)
    return _weight_grad_cpu(h, w, bias, y_local, lse, coef, wtok, target_w, smooth, softcap, need_bias)


# --- combining shards -----------------------------------------------------------------------


def _resolve_group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name) if group_name else None


def _global_vocab(v_local: int, vocab_start: int, group, device: torch.device) -> tuple[int, int]:
    """(global vocabulary size, largest shard); with a group, checks that the
    ranks' shards tile [0, V) in rank order."""
    if group is None:
        return v_local, v_local
    world = dist.get_world_size(group)
    meta = torch.tensor([vocab_start, v_local], dtype=torch.int64, device=device)
    parts = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(parts, meta, group=group)
    pos = largest = 0
    for r, (start, size) in enumerate(p.tolist() for p in parts):
        largest = max(largest, size)
        if start != pos:
            raise ValueError(
                f"vocab_start: rank {r} of the process group holds rows starting at {start}, "
                f"expected {pos} (the shards must tile the vocabulary in rank order)"
            )
        pos += size
    return pos, largest


def _local_targets(y: Tensor, ignore_index: int, vocab_start: int, v_local: int) -> tuple[Tensor, Tensor]:
    """(valid, y_local): y_local is the row of W holding the target, or -1."""
    valid = y != ignore_index
    yl = y - vocab_start
    mine = valid & (yl >= 0) & (yl < v_local)
    return valid, torch.where(mine, yl, torch.full_like(yl, -1))


def _forward(
    h,
    w,
    bias,
    y,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss,
    vocab_start,
    group_name,
    need_dh,
    need_p,
    need_wgrad,
    need_bgrad,
    impl,
):
    n, d = h.shape
    v_local = w.shape[0]
    group = _resolve_group(group_name)
    vocab, v_largest = _global_vocab(v_local, vocab_start, group, h.device)
    valid, yl = _local_targets(y, ignore_index, vocab_start, v_local)
    bad = valid & ((y < 0) | (y >= vocab))
    if bool(bad.any()):
        raise ValueError(
            f"target: value {int(y[bad][0])} is out of range [0, {vocab}) and is not ignore_index={ignore_index}"
        )
    f32 = dict(dtype=torch.float32, device=h.device)

    def empty():  # a fresh one each time: op outputs must not alias each other
        return torch.empty(0, **f32)

    vtot = torch.tensor(vocab, dtype=torch.int64, device=h.device)
    weights_in_forward = need_wgrad or need_bgrad
    if n == 0:
        dw = torch.zeros(w.shape, **f32) if weights_in_forward else empty()
        db = torch.zeros(v_local, **f32) if need_bgrad else empty()
        return (
            torch.zeros(0, **f32),
            torch.zeros(0, **f32),
            torch.zeros(0, d, **f32) if need_dh else empty(),
            empty(),
            vtot,
            dw,
            db,
        )

    mine = yl >= 0
    smooth_per_tile = bool(softcap and label_smoothing)
    colsum = None
    if label_smoothing and not smooth_per_tile:
        # sum_c z_c = h . sum_c W_c + sum_c b_c: no per-tile work without softcap.
        colsum = w.sum(0, dtype=torch.float32)
        sz = h.float() @ colsum
        if bias is not None:
            sz = sz + bias.sum(dtype=torch.float32)
    else:
        sz = torch.zeros(n, **f32)
    if weights_in_forward:
        fwg = _forward_weight_grad_torch if impl == "torch" else _forward_weight_grad_cpu
        loss, lse, dh, dw, db = fwg(
            h, w, bias, valid, yl, sz, vocab, v_largest, label_smoothing, softcap, z_loss, group, need_dh, need_bgrad
        )
        return loss, lse, dh, empty(), vtot, dw, db

    parts = _partials(h, w, bias, yl, softcap, need_dh, need_dh and smooth_per_tile, smooth_per_tile, impl)
    zy = parts.target_logit
    if parts.logit_sum is not None:
        sz = parts.logit_sum
    m = parts.row_max
    big_m = m.clone()
    if group is not None:
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(m - big_m)
    lse, loss, s_tot = _combine(big_m, parts.sum_exp * scale, zy, sz, valid, group, vocab, label_smoothing, z_loss)

    dh, p = empty(), empty()
    if need_dh:
        # softmax(z) W (softcap-aware), this shard's part, in global normalisation
        p = parts.softmax_w.mul_((scale / s_tot)[:, None])
        dh = p * (1.0 + 2.0 * z_loss * lse)[:, None] if (z_loss or need_p) else p
        # minus the target's row of W, where this shard holds it. Every token
        # gathers a row (the first, times 0, where the target is elsewhere):
        # selecting the tokens first (nonzero) would wait for the GPU's queue,
        # and on an H200 the host then spent ~8 ms of a 35 ms step in the
        # per-block index_put_ calls while the GPU idled.
        ky = torch.where(mine, -(1.0 - label_smoothing), 0.0).to(torch.float32)
        if softcap:  # the target's softcap slope, 1 - tanh^2, from its capped logit
            ky = ky * (1.0 - (zy / softcap).square())
        y_row = yl.clamp_min(0)
        for r0 in range(0, n, _GATHER_ROWS):
            r1 = min(n, r0 + _GATHER_ROWS)
            dh[r0:r1].addcmul_(w.index_select(0, y_row[r0:r1]).float(), ky[r0:r1, None])
        if label_smoothing:
            dh.sub_((label_smoothing / vocab) * (parts.slope_w if parts.slope_w is not None else colsum[None, :]))
        dh.mul_(valid[:, None])
        if group is not None:
            if need_p:
                both = torch.stack([dh, p])
                dist.all_reduce(both, group=group)
                # op outputs must not share storage: one of the halves is copied
                dh, p = both[0], both[1].clone()
            else:
                dist.all_reduce(dh, group=group)
        if not need_p:
            p = empty()
    return loss, lse, dh, p, vtot, empty(), empty()


# --- torch.library ops and their autograd -------------------------------------------------

_FWD_SCHEMA = (
    "(Tensor input, Tensor weight, Tensor? bias, Tensor target, int ignore_index, float label_smoothing, "
    "float softcap, float z_loss, int vocab_start, str group_name, bool need_dh, bool need_p, bool need_wgrad, "
    "bool need_bgrad, str impl) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor input, Tensor weight, Tensor? bias, Tensor y_local, Tensor lse, Tensor coef, Tensor wtok, "
    "float label_smoothing, Tensor vocab_total, float softcap, bool need_bias, str impl) -> (Tensor, Tensor)"
)


@torch.library.custom_op("resident_trainer::linear_cross_entropy", mutates_args=(), schema=_FWD_SCHEMA)
def _lce_op(
    input,
    weight,
    bias,
    target,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss,
    vocab_start,
    group_name,
    need_dh,
    need_p,
    need_wgrad,
    need_bgrad,
    impl,
):
    """Per-token loss (N,), lse (N,), dh per token (N, D) fp32 (unscaled by the
    upstream gradient; empty unless need_dh), softmax-weighted W (N, D) for the
    lse gradient (empty unless need_p), the global vocabulary size, and dW / dbias
    for unit per-token weights (empty unless need_wgrad / need_bgrad)."""
    return _forward(
        input,
        weight,
        bias,
        target,
        ignore_index,
        label_smoothing,
        softcap,
        z_loss,
        vocab_start,
        group_name,
        need_dh,
        need_p,
        need_wgrad,
        need_bgrad,
        impl,
    )


@_lce_op.register_fake
def _(
    input,
    weight,
    bias,
    target,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss,
    vocab_start,
    group_name,
    need_dh,
    need_p,
    need_wgrad,
    need_bgrad,
    impl,
):
    n, d = input.shape
    f32 = dict(dtype=torch.float32, device=input.device)
    return (
        input.new_empty(n, dtype=torch.float32),
        input.new_empty(n, dtype=torch.float32),
        torch.empty((n, d) if need_dh else (0,), **f32),
        torch.empty((n, d) if need_p else (0,), **f32),
        torch.empty((), dtype=torch.int64, device=input.device),
        torch.empty(weight.shape, **f32) if (need_wgrad or need_bgrad) else torch.empty(0, **f32),
        torch.empty(weight.shape[0] if need_bgrad else 0, **f32),
    )


@torch.library.custom_op("resident_trainer::linear_cross_entropy_weight_grad", mutates_args=(), schema=_BWD_SCHEMA)
def _lce_weight_grad_op(
    input, weight, bias, y_local, lse, coef, wtok, label_smoothing, vocab_total, softcap, need_bias, impl
):
    """(dW like weight, dbias (V,) fp32 or empty), recomputing the logit tiles.
    vocab_total is a 0-d tensor (the global vocabulary size from forward), read
    here rather than in the traced backward."""
    smooth = label_smoothing / int(vocab_total) if label_smoothing else 0.0
    dw, db = _weight_grad(
        input, weight, bias, y_local, lse, coef, wtok, 1.0 - label_smoothing, smooth, softcap, need_bias, impl
    )
    return dw, db if db is not None else torch.empty(0, dtype=torch.float32, device=input.device)


@_lce_weight_grad_op.register_fake
def _(input, weight, bias, y_local, lse, coef, wtok, label_smoothing, vocab_total, softcap, need_bias, impl):
    return torch.empty_like(weight), torch.empty(
        weight.shape[0] if need_bias else 0, dtype=torch.float32, device=weight.device
    )


def _setup_context(ctx, inputs, output):
    (
        input,
        weight,
        bias,
        target,
        ignore_index,
        label_smoothing,
        softcap,
        z_loss,
        vocab_start,
        _group,
        need_dh,
        need_p,
        _nw,
        _nb,
        impl,
    ) = inputs
    _loss, lse, dh, p, vtot, dw, db = output
    ctx.save_for_backward(input, weight, bias, target, lse, dh, p, vtot, dw, db)
    # Only loss and lse carry gradients. Without these two calls autograd
    # would hand backward a zero-filled tensor for every other output: an
    # extra (V, D) fp32 buffer for dW alone.
    ctx.mark_non_differentiable(dh, p, vtot, dw, db)
    ctx.set_materialize_grads(False)
    ctx.cfg = (ignore_index, label_smoothing, softcap, z_loss, vocab_start, need_dh, need_p, impl)


def _backward(ctx, g_loss, g_lse, _g_dh, _g_p, _g_vtot, _g_dw, _g_db):
    input, weight, bias, target, lse, dh, p, vtot, dw_unit, db_unit = ctx.saved_tensors
    ignore_index, label_smoothing, softcap, z_loss, vocab_start, need_dh, need_p, impl = ctx.cfg
    if g_loss is None:  # only the lse was used
        g_loss = torch.zeros_like(lse)
    d_input = d_weight = d_bias = None
    if ctx.needs_input_grad[0]:
        if not need_dh:
            raise RuntimeError("linear_cross_entropy: input needs a gradient but dh was not computed in forward")
        # In place on the saved dh: no second (N, D) buffer at the peak. A
        # second backward through the same graph then fails loudly (the saved
        # tensor's version changed) instead of scaling twice.
        grad = dh.mul_(g_loss[:, None])
        if need_p and g_lse is not None:
            grad.addcmul_(p, g_lse[:, None])
        d_input = grad.to(input.dtype)
    need_bias = bias is not None and ctx.needs_input_grad[2]
    if dw_unit.numel() or db_unit.numel():
        # Weight gradients were formed in forward for unit per-token weights;
        # the caller only asks for this when the upstream gradient is uniform.
        scale = g_loss[:1].float() if g_loss.numel() else torch.zeros(1, dtype=torch.float32, device=weight.device)
        if ctx.needs_input_grad[1]:
            d_weight = dw_unit.mul_(scale).to(weight.dtype)  # in place, as dh above
        if need_bias:
            d_bias = (db_unit * scale).to(bias.dtype)
    elif ctx.needs_input_grad[1] or need_bias:
        valid, yl = _local_targets(target, ignore_index, vocab_start, weight.shape[0])
        wtok = torch.where(valid, g_loss, torch.zeros_like(g_loss)).float()
        coef = wtok * (1.0 + 2.0 * z_loss * lse) if z_loss else wtok
        if g_lse is not None:
            coef = coef + g_lse
        dw, db = torch.ops.resident_trainer.linear_cross_entropy_weight_grad(
            input, weight, bias, yl, lse, coef, wtok, label_smoothing, vtot, softcap, need_bias, impl
        )
        d_weight = dw if ctx.needs_input_grad[1] else None
        d_bias = db.to(bias.dtype) if need_bias else None
    return (d_input, d_weight, d_bias) + (None,) * 12


_lce_op.register_autograd(_backward, setup_context=_setup_context)


# --- public API ---------------------------------------------------------------------------


def _check_args(
    input,
    linear_weight,
    target,
    linear_bias,
    reduction,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss,
    process_group,
    vocab_start,
    impl,
):
    for name, t in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if linear_weight.dim() != 2:
        raise ValueError(f"linear_weight must be 2-D (V, D), got shape {tuple(linear_weight.shape)}")
    d = linear_weight.shape[1]
    if input.dim() < 2 or input.shape[-1] != d:
        raise ValueError(
            f"input must be (N, D) or (B, T, D) with D = linear_weight.shape[1] = {d}, got shape {tuple(input.shape)}"
        )
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"target must have shape {tuple(input.shape[:-1])} (input's leading dims), got {tuple(target.shape)}"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must be an integer tensor of class indices, got {target.dtype}")
    if not input.dtype.is_floating_point:
        raise TypeError(f"input must be a floating-point tensor, got {input.dtype}")
    if linear_weight.dtype != input.dtype:
        raise TypeError(f"input ({input.dtype}) and linear_weight ({linear_weight.dtype}) must have the same dtype")
    for name, t in (("linear_weight", linear_weight), ("target", target)):
        if t.device != input.device:
            raise ValueError(f"{name} is on {t.device} but input is on {input.device}")
    if linear_bias is not None:
        if not isinstance(linear_bias, Tensor):
            raise TypeError(f"linear_bias must be a torch.Tensor or None, got {type(linear_bias).__name__}")
        if tuple(linear_bias.shape) != (linear_weight.shape[0],):
            raise ValueError(f"linear_bias must have shape ({linear_weight.shape[0]},), got {tuple(linear_bias.shape)}")
        if linear_bias.dtype != input.dtype:
            raise TypeError(f"linear_bias ({linear_bias.dtype}) must have input's dtype ({input.dtype})")
        if linear_bias.device != input.device:
            raise ValueError(f"linear_bias is on {linear_bias.device} but input is on {input.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    if not float(z_loss) >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if not isinstance(vocab_start, int) or isinstance(vocab_start, bool) or vocab_start < 0:
        raise ValueError(f"vocab_start must be a non-negative int, got {vocab_start!r}")
    if process_group is None and vocab_start != 0:
        raise ValueError(f"vocab_start={vocab_start} needs a process_group (W is then this rank's vocabulary shard)")
    if impl == "reference" and process_group is not None:
        raise ValueError("impl='reference' materializes the full logits and takes no process_group")


def linear_cross_entropy(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    linear_bias: Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    process_group=None,
    vocab_start: int = 0,
    return_lse: bool = False,
    impl: str = "auto",
):
    """Cross-entropy of ``input @ linear_weight.T (+ linear_bias)`` against `target`,
    computed in vocabulary tiles without allocating the logits.

    Computes what ``F.cross_entropy((input @ W.T + bias).float(), target,
    reduction=..., ignore_index=..., label_smoothing=...)`` computes, with
    ``softcap * tanh(logits / softcap)`` applied first when `softcap` is set and
    ``z_loss * lse**2`` added per (non-ignored) token when `z_loss` is set. A
    drop-in for ``torch.nn.functional.linear_cross_entropy`` where the arguments
    overlap. A batch whose targets are all `ignore_index` has loss 0 and zero
    gradients.

    Shapes: input (N, D) or (B, T, D); linear_weight (V, D) (this rank's rows
    ``[vocab_start, vocab_start + V)`` when `process_group` is given); target
    (N,) or (B, T) integer class indices in the global vocabulary. Returns the
    fp32 loss (a scalar, or per token for reduction="none") and, with
    ``return_lse=True``, also the fp32 per-token log-sum-exp (differentiable).

    Gradients: input always (computed in the forward pass and scaled in
    backward); linear_weight and linear_bias when they require grad
    (recomputing the logit tiles in backward).

    impl: "auto" (the C++/torch tiled path on CPU, "torch" on GPU), "cpu",
    "torch" (torch.mm products, cuBLAS on GPUs, over chunks of fp32 logits
    bounded by RESIDENT_TRAINER_LCE_CHUNK_MIB, 256 by default), "triton", or
    "reference" (the materializing oracle)."""
    _check_args(
        input,
        linear_weight,
        target,
        linear_bias,
        reduction,
        ignore_index,
        label_smoothing,
        softcap,
        z_loss,
        process_group,
        vocab_start,
        impl,
    )
    if impl == "reference":
        return linear_cross_entropy_reference(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            softcap=softcap,
            z_loss=z_loss,
            return_lse=return_lse,
        )
    impl = _resolve_impl(impl, input.device)
    d = linear_weight.shape[1]
    h = input.reshape(-1, d)
    y = target.reshape(-1).long()
    need_dh = torch.is_grad_enabled() and input.requires_grad
    need_p = need_dh and return_lse
    # Weight gradients in the forward pass (no recompute) need an upstream
    # gradient that is the same for every token: a reduced loss, lse unused.
    in_forward = impl == "cpu" or (impl == "torch" and _torch_wgrad_forward(input.device))
    uniform = reduction != "none" and not return_lse and in_forward and torch.is_grad_enabled()
    need_wgrad = uniform and linear_weight.requires_grad
    need_bgrad = uniform and linear_bias is not None and linear_bias.requires_grad
    group_name = process_group.group_name if process_group is not None else ""
    loss_tok, lse, *_ = torch.ops.resident_trainer.linear_cross_entropy(
        h,
        linear_weight,
        linear_bias,
        y,
        ignore_index,
        float(label_smoothing),
        float(softcap or 0.0),
        float(z_loss),
        vocab_start,
        group_name,
        need_dh,
        need_p,
        need_wgrad,
        need_bgrad,
        impl,
    )
    out = _reduce_exact(loss_tok, y != ignore_index, reduction, target.shape)
    return (out, lse.reshape(target.shape)) if return_lse else out
