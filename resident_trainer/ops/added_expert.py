"""Added expert: the trained SwiGLU block ``out = (silu(x Wg^T) * (x Wu^T)) Wd^T``.

Read bottom-up: the plain-torch oracle, the torch composition of the fused
op, the dispatch to the kernels (C++ on CPU: csrc/added_expert_cpu.cpp;
Triton: triton_kernels/added_expert.py), the torch.library ops with their
autograd, and the public function (tensor parallelism through
resident_trainer.ops.collectives). The trainable module built on it is
resident_trainer.train.AddedSharedNeurons.

Shapes: x (N, D) or (B, T, D); w_gate, w_up (A, D); w_down (D, A). Gate and up
may come packed as one (2A, D) weight, **gate rows first**:
``w_gate_up = torch.cat([w_gate, w_up])`` (the layout of a merged
column-parallel gate/up projection; under tensor parallelism each rank packs
its own gate rows above its own up rows).

What the fused op does that autograd does in many steps: gate and up come
from one pass over x against the packed weight (one product in the torch
composition; in the kernels both tiles from the same x rows while they are in
cache, in two accumulators); the whole elementwise backward is one pass, the
epilogue of dp = dout @ Wd in the kernels (five elementwise ops in the torch
composition); dx is one product against the packed weight (``[dgate | dup] @ W_gu``) and the
gate/up weight gradients are one product (``[dgate | dup]^T @ x``). It saves
the two pre-activations (N, 2A) instead of autograd's four (N, A) tensors, and
with ``recompute=True`` nothing but x (the backward recomputes them).

Casts follow the Hugging Face SwiGLU MLP, ``down(act(gate(x)) * up(x))``, in
the input dtype: gate and up rounded, silu(gate) rounded before the multiply,
the product rounded; every product accumulates in fp32.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from resident_trainer import _ext
from resident_trainer.ops._gemm import choose, linear
from resident_trainer.ops.collectives import copy_to_ranks, sum_over_ranks

IMPLS = ("auto", "cpu", "torch", "triton", "reference")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --- the oracle: plain torch autograd, materializes everything ------------------


def added_expert_reference(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)``,
    rows where token_mask is False set to zero; the Hugging Face LlamaMLP in
    the input dtype (run it in fp64 for a ground truth). w_up=None: w_gate is
    the packed (2A, D) weight, gate rows first."""
    if w_up is None:
        w_gate, w_up = w_gate.chunk(2, dim=0)
    p = F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)
    if token_mask is not None:
        p = torch.where(token_mask.unsqueeze(-1), p, torch.zeros((), dtype=p.dtype, device=p.device))
    return F.linear(p, w_down)


# --- the fused op from torch ops: any dtype and device ---------------------------

# Products go through resident_trainer.ops._gemm.linear (``a @ b.T``): torch.mm
# or oneDNN's inner product, whichever measured faster on this CPU for the
# shape (oneDNN runs AVX-512 on AMD, where MKL runs AVX2: 2.5 ms against 6.5 ms
# for (2048 x 576) @ (576 x 256) fp32 on one thread of a Zen 5; on an AVX-512
# Xeon MKL was the faster).


# The compiled one-pass elementwise ops (fp32 CPU), looked up once.
_HAS_ACT_KERNEL = _ext.has_kernel("added_expert_act_forward", "CPU")


def _act_kernel(h: torch.Tensor) -> bool:
    return _HAS_ACT_KERNEL and h.dtype == torch.float32 and h.device.type == "cpu"


def _act_forward_torch(h: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """p = silu(gate) * up with HF casts, h = [gate | up]: (N, 2A) -> (N, A).
    fp32 on a CPU: one pass of the compiled op."""
    if _act_kernel(h):
        return torch.ops.resident_trainer.added_expert_act_forward(h, token_mask)
    a = h.shape[1] // 2
    p = F.silu(h[:, :a])
    p.mul_(h[:, a:])
    if token_mask is not None:
        p.masked_fill_(~token_mask.unsqueeze(1), 0)
    return p


def _act_backward_torch(
    h: torch.Tensor, dp: torch.Tensor, token_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, p): dh = [dgate | dup] (N, 2A) for dp = dL/dp (N, A), and p again
    (for dWd), from h = [gate | up]. Five elementwise passes, written in the
    input dtype (each computes in fp32 inside), none in an fp32 temporary:
    in bf16 the upcast copies cost more than the passes themselves. fp32 on
    a CPU: one pass of the compiled op (its p equals its forward's bit for bit)."""
    if _act_kernel(h):
        return torch.ops.resident_trainer.added_expert_act_backward(h, dp, token_mask)
    n, a = dp.shape
    gate, up = h[:, :a], h[:, a:]
    # The same op as the forward, so p and the rounded silu are bit-identical.
    act = F.silu(gate)
    p = act * up
    dh = torch.empty((n, 2 * a), dtype=h.dtype, device=h.device)
    torch.mul(dp, act, out=dh[:, a:])
    torch.ops.aten.silu_backward.grad_input(dp * up, gate, grad_input=dh[:, :a])
    if token_mask is not None:
        off = ~token_mask.unsqueeze(1)
        dh.masked_fill_(off, 0)
        p.masked_fill_(off, 0)
    return dh, p


def _mm_tn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a.T @ b for a: (N, M), b: (N, L), the weight-gradient shape. oneDNN's
    inner product copies a transposed first operand, so the narrower of the
    two goes there; where torch.mm is the measured choice for that product
    (it reads transposed operands in place) it is one torch.mm."""
    first, second = (a, b) if a.shape[1] <= b.shape[1] else (b, a)
    if choose(first.t(), second.t()) == "mkl":
        return torch.mm(a.t(), b)
    if first is a:
        return linear(a.t(), b.t())
    return linear(b.t(), a.t()).t().contiguous()


def _pack(w_gate: torch.Tensor, w_up: torch.Tensor | None) -> torch.Tensor:
    # A temporary: the op saves the caller's weights, never this copy.
    return w_gate if w_up is None else torch.cat([w_gate, w_up])


def _forward_torch(x, w_gate, w_up, w_down, token_mask, store_pre):
    h = linear(x, _pack(w_gate, w_up))
    p = _act_forward_torch(h, token_mask)
    out = linear(p, w_down)
    return out, (h if store_pre else h.new_empty((0, h.shape[1])))


def _backward_torch(grad_out, x, w_gate, w_up, w_down, h, token_mask, need_dx, need_dwgu, need_dwd):
    w_gate_up = _pack(w_gate, w_up)
    if h is None:
        h = linear(x, w_gate_up)
    dp = linear(grad_out, w_down.t())
    dh, p = _act_backward_torch(h, dp, token_mask)
    dw_down = _mm_tn(grad_out, p) if need_dwd else None
    dw_gate_up = _mm_tn(dh, x) if need_dwgu else None
    dx = linear(dh, w_gate_up.t()) if need_dx else None
    return dx, dw_gate_up, dw_down


# --- dispatch, torch.library ops and their autograd -----------------------------


# Looked up once: the dispatcher query is not traceable by torch.compile.
_HAS_CPU_KERNEL = _ext.has_kernel("added_expert_fused_forward", "CPU")

# The compiled kernel is a CPU candidate below this width. Measured on a
# 2-core Zen 5, fp32, forward + backward: at D = 576 it is as fast as the
# torch composition or faster (up to 25%; 10% at N = 2048, A = 256) at every
# N and A of the benchmark grid, the elementwise work staying on tiles in
# cache; at D = 1024 the composition is 5% faster and at D = 2048-4096 5-30%,
# oneDNN's inner product blocking the long D loops better.
_CPU_KERNEL_MAX_D = 1023

# Below that width "auto" still measures: the kernel's products are oneDNN's
# micro-kernel, which beats MKL where MKL runs its AVX2 code (AMD), and the
# composition's go to whichever of MKL and oneDNN _gemm measured faster. On a
# 2-core Sapphire Rapids-class Xeon (N=2048, D=576, A=256, fp32) the
# composition took 20.9 ms forward + backward against 22.5 ms for the kernel.
# So each class (threads, N rounded up to a power of two, D, A) times one
# forward + backward of both on random operands of its shape (at most 1024
# rows), once per process, best of 3 each after a warm-up: ~0.1 s at N = 1024.
# RESIDENT_TRAINER_REPRODUCIBLE=1 takes the kernel without measuring (the two
# paths round differently).
_PATH_CHOICES: dict[tuple, tuple[str, dict[str, float]]] = {}
_PATH_PROBE_ROWS = 1024
_PATH_PROBE_RUNS = 3


def _measure_paths(n: int, d: int, a: int) -> tuple[str, dict[str, float]]:
    """("cpu" or "torch", best seconds of each) for one forward + backward
    at this shape, on random fp32 operands."""
    g = torch.Generator().manual_seed(0)
    rows = max(1, min(n, _PATH_PROBE_ROWS))
    x = torch.randn(rows, d, generator=g)
    w_gu = torch.randn(2 * a, d, generator=g) * d**-0.5
    w_d = torch.randn(d, a, generator=g) * a**-0.5
    g_out = torch.randn(rows, d, generator=g)

    def run(name):
        _, h = _forward_impl(x, w_gu, None, w_d, None, True, name)
        _backward_impl(g_out, x, w_gu, None, w_d, h, None, True, True, True, name)

    best = {"cpu": float("inf"), "torch": float("inf")}
    with torch.no_grad():
        for name in best:
            run(name)
        for _ in range(_PATH_PROBE_RUNS):
            for name in best:
                t0 = time.perf_counter()
                run(name)
                best[name] = min(best[name], time.perf_counter() - t0)
    return min(best, key=best.get), best


def _measured_cpu_path(n: int, d: int, a: int) -> str:
    if torch.compiler.is_compiling():
        return "cpu"  # no timing (nor thread count) inside a trace: the kernel
    key = (torch.get_num_threads(), 1 << max(n - 1, 0).bit_length(), d, a)
    hit = _PATH_CHOICES.get(key)
    if hit is None:
        hit = _PATH_CHOICES[key] = _measure_paths(n, d, a)
    return hit[0]


def path_report() -> str:
    """For benchmark output: each measured class's CPU path (the compiled
    kernel or the torch composition) with both best times."""
    lines = ["added_expert CPU path (fp32, D < 1024, impl='auto'):"]
    for (threads, n, d, a), (name, best) in sorted(_PATH_CHOICES.copy().items()):
        times = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items())
        lines.append(f"  {threads} threads N<={n} D={d} A={a}: {name} ({times})")
    if len(lines) == 1:
        lines.append(f"  no class measured{_ext.reproducible_note('the compiled kernel')}")
    return "\n".join(lines)


def resolve_impl(impl: str, x: torch.Tensor, a: int | None = None) -> str:
    """The implementation added_expert runs for `impl` and input x (what
    "auto" picks on this device, dtype and width; explicit choices checked).
    With `a` (the local neuron count) "auto" measures, for fp32 with D < 1024
    on a CPU, whether the compiled kernel or the torch composition is faster
    (once per class); without it, the kernel."""
    # The compiled kernel covers fp32; for bf16, fp16 and fp64 the torch
    # composition is the CPU path (oneDNN's bf16 inner product already runs
    # the CPU's bf16 dot-product instructions where it has them).
    kernel = x.dtype == torch.float32 and _HAS_CPU_KERNEL and x.shape[-1] <= _CPU_KERNEL_MAX_D
    cpu_auto = "torch"
    if kernel and impl == "auto" and x.device.type == "cpu":
        n = x.numel() // max(x.shape[-1], 1)
        measure = not (a is None or a == 0 or n == 0 or _ext.reproducible())
        cpu_auto = _measured_cpu_path(n, x.shape[-1], a) if measure else "cpu"
    elif kernel:
        cpu_auto = "cpu"
    impl = _ext.resolve_impl("added_expert", impl, IMPLS, x.device, gpu_auto="triton", cpu_auto=cpu_auto)
    if impl == "cpu":
        if x.dtype != torch.float32:
            raise TypeError(
                f"impl='cpu' (the compiled kernel) takes float32, got {x.dtype}; use impl='auto' or 'torch'"
            )
        _ext.require_extension("added_expert (impl='cpu')")
        if not _HAS_CPU_KERNEL:
            raise RuntimeError(
                "impl='cpu': resident_trainer._C was built without the added_expert kernel; " + _ext.BUILD_HINT
            )
    return impl


def _forward_impl(x, w_gate, w_up, w_down, token_mask, store_pre, impl):
    n, d = x.shape
    a = w_down.shape[1]
    if n == 0:
        return x.new_zeros((0, d)), x.new_empty((0, 2 * a))
    if w_down.numel() == 0:
        impl = "torch"  # D = 0 or A = 0: nothing for a kernel to do
    if impl == "cpu":
        return torch.ops.resident_trainer.added_expert_fused_forward(x, w_gate, w_up, w_down, token_mask, store_pre)
    if impl == "triton":
        from resident_trainer.triton_kernels.added_expert import added_expert_forward_triton

        return added_expert_forward_triton(x, w_gate, w_up, w_down, token_mask, store_pre)
    return _forward_torch(x, w_gate, w_up, w_down, token_mask, store_pre)


def _backward_impl(grad_out, x, w_gate, w_up, w_down, h, token_mask, need_dx, need_dwgu, need_dwd, impl):
    """(dx, dW_gu, dWd), dW_gu packed (2A, D); None where not needed."""
    a = w_down.shape[1]
    if x.shape[0] == 0:
        return (
            x.new_zeros(x.shape) if need_dx else None,
            x.new_zeros((2 * a, x.shape[1])) if need_dwgu else None,
            torch.zeros_like(w_down) if need_dwd else None,
        )
    if w_down.numel() == 0:
        impl = "torch"
    args = (grad_out, x, w_gate, w_up, w_down, h, token_mask, need_dx, need_dwgu, need_dwd)
    if impl == "cpu":
        grads = torch.ops.resident_trainer.added_expert_fused_backward(*args)
        return tuple(g if want else None for g, want in zip(grads, (need_dx, need_dwgu, need_dwd)))
    if impl == "triton":
        from resident_trainer.triton_kernels.added_expert import added_expert_backward_triton

        return added_expert_backward_triton(*args)
    return _backward_torch(*args)


@torch.library.custom_op("resident_trainer::added_expert_forward", mutates_args=())
def _forward_op(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    token_mask: torch.Tensor | None,
    store_pre: bool,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, h): the block's output (N, D) and, when store_pre, the
    pre-activations h = [gate | up] (N, 2A) that the backward reads
    (otherwise a (0, 2A) placeholder). w_up=None: w_gate is packed (2A, D)."""
    return _forward_impl(x, w_gate, w_up, w_down, token_mask, store_pre, impl)


@_forward_op.register_fake
def _(x, w_gate, w_up, w_down, token_mask, store_pre, impl):
    n = x.shape[0] if store_pre else 0
    return x.new_empty((x.shape[0], w_down.shape[0])), x.new_empty((n, 2 * w_down.shape[1]))


@torch.library.custom_op("resident_trainer::added_expert_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    h: torch.Tensor,
    token_mask: torch.Tensor | None,
    recompute: bool,
    need: list[bool],
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW_gu, dWd), dW_gu packed (2A, D); a gradient not asked for in
    `need` comes back as a 0-element placeholder (ops cannot return None)."""
    grads = _backward_impl(
        grad_out, x, w_gate, w_up, w_down, None if recompute else h, token_mask, need[0], need[1], need[2], impl
    )
    return tuple(g if g is not None else x.new_empty((0,)) for g in grads)


@_backward_op.register_fake
def _(grad_out, x, w_gate, w_up, w_down, h, token_mask, recompute, need, impl):
    shapes = (x.shape, (2 * w_down.shape[1], x.shape[1]), w_down.shape)
    return tuple(x.new_empty(s if want else (0,)) for s, want in zip(shapes, need))


def _setup_context(ctx, inputs, output):
    x, w_gate, w_up, w_down, token_mask, store_pre, impl = inputs
    ctx.recompute = not store_pre
    ctx.impl = impl
    ctx.packed = w_up is None
    # The op's inputs, and h: the only activation it adds (none when
    # recomputing). Separate gate and up weights are saved as they are, never
    # as a packed copy.
    ctx.save_for_backward(x, w_gate, w_up, w_down, output[1] if store_pre else None, token_mask)
    # h is an output only for the backward to read: it never gets a gradient,
    # and autograd would otherwise fill an (N, 2A) zero tensor for it on every
    # backward (0.33 ms of a 19 ms step at N=2048, A=256 on a 2-core Xeon).
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_h):
    x, w_gate, w_up, w_down, h, token_mask = ctx.saved_tensors
    nx, ng, nu, nd = ctx.needs_input_grad[:4]
    need = [bool(nx), bool(ng or nu), bool(nd)]
    if not any(need) or grad_out is None:  # grads are not materialized: None when out was unused
        return (None,) * 7
    if h is None:
        h = x.new_empty((0, 2 * w_down.shape[1]))
    dx, dwgu, dwd = _backward_op(grad_out, x, w_gate, w_up, w_down, h, token_mask, ctx.recompute, need, ctx.impl)
    if ctx.packed:
        dwg, dwu = (dwgu if ng else None), None
    else:
        dwg, dwu = dwgu.chunk(2) if need[1] else (None, None)
        dwg, dwu = (dwg if ng else None), (dwu if nu else None)
    return (dx if nx else None), dwg, dwu, (dwd if nd else None), None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# --- public API -----------------------------------------------------------------


def _check_inputs(x, w_gate, w_up, w_down, token_mask):
    x = _ext.check_tensor(x, "x")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be (N, D) or (B, T, D), got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be one of {[str(d) for d in _DTYPES]}, got {x.dtype}")
    d = x.shape[-1]
    w_gate = _ext.check_tensor(w_gate, "w_gate")
    w_down = _ext.check_tensor(w_down, "w_down")
    named = [("w_gate", w_gate), ("w_down", w_down)]
    if w_up is None:
        if w_gate.dim() != 2 or w_gate.shape[0] % 2 or w_gate.shape[1] != d:
            raise ValueError(
                f"w_gate (packed [gate; up], w_up=None) must be (2A, D={d}), got shape {tuple(w_gate.shape)}"
            )
        a = w_gate.shape[0] // 2
    else:
        w_up = _ext.check_tensor(w_up, "w_up")
        named.append(("w_up", w_up))
        if w_gate.dim() != 2 or w_gate.shape[1] != d:
            raise ValueError(f"w_gate must be (A, D={d}), got shape {tuple(w_gate.shape)}")
        a = w_gate.shape[0]
        if w_up.shape != w_gate.shape:
            raise ValueError(f"w_up must have w_gate's shape {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    if w_down.shape != (d, a):
        raise ValueError(f"w_down must be (D={d}, A={a}), got shape {tuple(w_down.shape)}")
    for name, w in named:
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but x has {x.dtype}; all four must match")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}")
    if token_mask is not None:
        token_mask = _ext.check_tensor(token_mask, "token_mask")
        if token_mask.dtype != torch.bool:
            raise TypeError(f"token_mask must be a bool tensor, got {token_mask.dtype}")
        if token_mask.shape != x.shape[:-1]:
            raise ValueError(
                f"token_mask must have x's leading shape {tuple(x.shape[:-1])}, got {tuple(token_mask.shape)}"
            )
        if token_mask.device != x.device:
            raise ValueError(f"token_mask is on {token_mask.device} but x is on {x.device}")
    return a


def added_expert(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    *,
    token_mask: torch.Tensor | None = None,
    recompute: bool = False,
    process_group=None,
    impl: str = "auto",
) -> torch.Tensor:
    """The added-expert block, fused forward and backward:
    ``F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)`` with
    the Hugging Face casts in low precision, differentiable w.r.t. x and all
    weights.

    x: (N, D) or (B, T, D); w_gate, w_up: (A, D); w_down: (D, A). w_up=None
    means w_gate is the packed (2A, D) weight ``torch.cat([w_gate, w_up])``.
    token_mask: bool, x's leading shape; False tokens get exactly zero output
    and contribute no gradient (the block is an exact no-op on them).
    recompute: save only x; the backward recomputes the pre-activations (one
    more (N, D) x (D, 2A) product) instead of keeping them.
    process_group: the A neurons are split over its ranks (this rank passes its
    own rows of w_gate and w_up and its columns of w_down); the partial outputs
    and the partial dx are summed over the ranks, weight gradients stay local.
    impl: "auto" (on CPU, for fp32 with D < 1024, the compiled kernel or the
    torch composition, whichever measured faster for the shape (`path_report`);
    otherwise the torch composition; Triton on CUDA), "cpu" (the compiled fp32 kernel),
    "torch" (the fused op composed from torch ops, any device), "triton", or
    "reference" (the plain torch autograd oracle)."""
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be a bool, got {type(recompute).__name__}")
    _check_inputs(x, w_gate, w_up, w_down, token_mask)
    impl = resolve_impl(impl, x, w_down.shape[1])
    lead, d = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d)
    mask = None if token_mask is None else token_mask.reshape(-1)
    if process_group is not None:
        x2 = copy_to_ranks(x2, process_group)
    if impl == "reference":
        out = added_expert_reference(x2, w_gate, w_up, w_down, mask)
    else:
        # Without autograd (serving) there is no backward to keep h for.
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x2, w_gate, w_up, w_down))
        out, _ = _forward_op(x2, w_gate, w_up, w_down, mask, grad and not recompute, impl)
    if process_group is not None:
        out = sum_over_ranks(out, process_group)
    return out.reshape(*lead, d)
