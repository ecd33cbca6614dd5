"""Added-expert block, forward and forward + backward: time, ratio to torch
autograd, TFLOP/s and the activation bytes each provider keeps for the
backward, every provider measured in the same run.

Providers: ours (``impl="auto"``: on CPU the compiled kernel for fp32 with
D < 1024, else the torch composition; Triton on GPU) saving the
pre-activations and with ``recompute=True``; the compiled CPU kernel
(``impl="cpu"``) and the torch composition (``impl="torch"``) on their own; plain torch autograd of
``F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)`` (the reference,
the Hugging Face LlamaMLP); Liger-Kernel's SwiGLU MLP (cuBLAS products around
its fused silu * up, GPU only); and the products' floor: the block's products
alone (3 forward, 9 forward + backward) with no elementwise work, timed with
torch.mm (MKL) and with oneDNN's inner product (its transposed-operand copies
included) in the same run; the faster is the group's floor (bench/conftest.py
prints every provider's ratio to it), the bound for an implementation built
on either backend.

FLOPs: the block's products, 6 N D A forward and 18 N D A forward + backward
(x, Wg, Wu, Wd all need gradients), the same count for every provider; the
recomputing mode does 4 N D A more than it is credited with.

Saved bytes (``saved_act_bytes``): what autograd keeps for the backward
beyond the inputs x, Wg, Wu, Wd, found with torch.autograd.graph.saved_tensors_hooks
(each storage once). Autograd keeps gate, up, silu(gate) and the product:
4 N A elements; ours keeps gate and up; recomputing, nothing.

    make bench                                       # everything in bench/
    pytest bench/bench_added_expert.py -s            # this file: the CPU goal shape on CPU
    RT_BENCH_AE_FULL=1 pytest bench/bench_added_expert.py -s   # every shape below
    RT_BENCH_AE_DTYPES=bfloat16 pytest bench/bench_added_expert.py -s   # other dtypes
    pytest bench/bench_added_expert.py -s -k "N2048-D4096"     # pick shapes by id
    pytest bench/bench_added_expert.py -s -k interleaved       # providers in rotation, round by round
"""

from __future__ import annotations

import itertools
import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

import resident_trainer.ops.added_expert as ae
from resident_trainer.ops import _gemm
from resident_trainer.ops.saved import saved_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GOAL = (2048, 576, 256)  # N, D, A: SmolLM2's width, a typical block
FULL = [(n, d, a) for d in (576, 4096) for a in (64, 256, 1024) for n in (512, 2048, 8192)]
if os.environ.get("RT_BENCH_AE_FULL") == "1" or DEVICE == "cuda":
    SHAPES = FULL
else:
    # The CPU goal shape; the full grid takes about an hour on two cores.
    SHAPES = [GOAL]
# RT_BENCH_AE_DTYPES=float32,bfloat16 picks others (the goals: fp32 on CPU, bf16 on GPU).
_DT = os.environ.get("RT_BENCH_AE_DTYPES", "bfloat16" if DEVICE == "cuda" else "float32")
DTYPES = [getattr(torch, name) for name in _DT.split(",")]
ROUNDS = int(os.environ.get("RT_BENCH_AE_ROUNDS", "15"))


def _ours(x, wg, wu, wd):
    return ae.added_expert(x, wg, wu, wd)


def _ours_recompute(x, wg, wu, wd):
    return ae.added_expert(x, wg, wu, wd, recompute=True)


def _ours_torch(x, wg, wu, wd):
    return ae.added_expert(x, wg, wu, wd, impl="torch")


def _ours_cpu(x, wg, wu, wd):
    return ae.added_expert(x, wg, wu, wd, impl="cpu")


def _reference(x, wg, wu, wd):
    return ae.added_expert_reference(x, wg, wu, wd)


def _liger(x, wg, wu, wd):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return F.linear(LigerSiLUMulFunction.apply(F.linear(x, wg), F.linear(x, wu)), wd)


PROVIDERS = {
    "ours": ("resident_trainer.added_expert", _ours),
    "ours-recompute": ("resident_trainer.added_expert recompute", _ours_recompute),
    "ours-torch": ("resident_trainer (impl='torch')", _ours_torch),
    "ours-cpu": ("resident_trainer (impl='cpu')", _ours_cpu),
    "reference": ("torch autograd (HF LlamaMLP)", _reference),
    "liger": ("Liger SiLUMul + cuBLAS", _liger),
    "mm-floor": ("torch.mm floor (products only)", None),
    "onednn-floor": ("oneDNN floor (products only)", None),
}


def _onednn_mm(a, b):
    """a @ b through oneDNN's inner product (which computes a @ w.T)."""
    return torch.ops.mkldnn._linear_pointwise(_gemm._operand(a), _gemm._operand(b.t()), None, "none", [], "")


class _Floor:
    """The block's products with one backend and nothing else, on the same
    operands (stand-ins for the activations)."""

    def __init__(self, x, wg, wu, wd, dout, mm=torch.mm):
        self.x, self.wg, self.wu, self.wd, self.dout = x.detach(), wg.detach(), wu.detach(), wd.detach(), dout
        self.mm = mm
        self.h = mm(self.x, self.wg.t())

    def forward(self):
        mm = self.mm
        g = mm(self.x, self.wg.t())
        u = mm(self.x, self.wu.t())
        return mm(g, self.wd.t()), u

    def step(self):
        self.forward()
        mm, h, x, d = self.mm, self.h, self.x, self.dout
        dp = mm(d, self.wd)
        mm(d.t(), h)  # dWd
        mm(h.t(), x)  # dWg
        mm(h.t(), x)  # dWu
        mm(dp, self.wg)  # dx, gate half
        mm(dp, self.wu)  # dx, up half


def _inputs(n, d, a, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen).to(DEVICE, dtype).requires_grad_()
    wg = (torch.randn(a, d, generator=gen) / d**0.5).to(DEVICE, dtype).requires_grad_()
    wu = (torch.randn(a, d, generator=gen) / d**0.5).to(DEVICE, dtype).requires_grad_()
    wd = (torch.randn(d, a, generator=gen) / a**0.5).to(DEVICE, dtype).requires_grad_()
    dout = torch.randn(n, d, generator=gen).to(DEVICE, dtype)
    return [x, wg, wu, wd], dout


def _skip_reason(provider, dtype):
    """Why `provider` does not run here (None: it runs)."""
    if provider == "liger" and DEVICE != "cuda":
        return "Liger's kernels are Triton, GPU only (the interpreter is a test tool)"
    if provider == "ours-cpu" and (DEVICE != "cpu" or dtype != torch.float32):
        return "the compiled CPU kernel is fp32 on CPU"
    if provider == "onednn-floor" and (DEVICE != "cpu" or not _gemm.onednn_supports(dtype)):
        return f"oneDNN's inner product does not run {dtype} on this {DEVICE}"
    return None


def _timed_call(provider, shape, dtype, mode):
    """(a call that runs `provider` once in `mode` and waits for it, the
    activation bytes it saves for the backward or None), on fresh inputs."""
    _, fn = PROVIDERS[provider]
    leaves, dout = _inputs(*shape, dtype)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    if fn is None:
        floor = _Floor(*leaves, dout, mm=_onednn_mm if provider == "onednn-floor" else torch.mm)
        call = floor.forward if mode == "fwd" else floor.step
        saved = None
    else:
        saved = saved_bytes(fn, leaves)

        def call():
            for t in leaves:
                t.grad = None
            out = fn(*leaves)
            if mode == "fwd+bwd":
                out.backward(dout)
            return out

    def timed():
        call()
        sync()

    return timed, saved


def _group(shape, dtype, mode):
    n, d, a = shape
    return f"added_expert {mode} N={n} D={d} A={a} {str(dtype)[6:]} on {DEVICE}"


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-D{}-A{}".format(*s))
def test_added_expert(benchmark, shape, dtype, mode, provider):
    reason = _skip_reason(provider, dtype)
    if reason:
        pytest.skip(reason)
    n, d, a = shape
    timed, saved = _timed_call(provider, shape, dtype, mode)
    benchmark.group = _group(shape, dtype, mode)
    flops = (6 if mode == "fwd" else 18) * n * d * a
    benchmark.extra_info.update(
        provider=PROVIDERS[provider][0],
        reference=provider == "reference",
        floor=provider.endswith("-floor"),
        flops=flops,
    )
    if saved is not None:
        benchmark.extra_info["saved_act_bytes"] = saved
    benchmark.pedantic(timed, rounds=ROUNDS, iterations=1, warmup_rounds=2)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-D{}-A{}".format(*s))
def test_added_expert_interleaved(benchmark, shape, dtype, mode):
    """Every provider once a round, in a rotating order, ROUNDS rounds: a VM
    whose speed drifts within a run skews the one-provider-after-another
    ratios above (the same code measured 1.01x and 0.72x of autograd in two
    runs on one Xeon), not these. pytest-benchmark times one whole round; the
    per-provider medians and the median of the per-round ratios go to
    extra_info["interleaved"], which bench/conftest.py prints."""
    names = [p for p in PROVIDERS if _skip_reason(p, dtype) is None]
    calls = {p: _timed_call(p, shape, dtype, mode)[0] for p in names}
    for _ in range(2):  # warm-up, as the separate benchmarks do
        for p in names:
            calls[p]()
    times: dict[str, list[float]] = {p: [] for p in names}
    turn = itertools.count()

    def one_round():
        k = next(turn) % len(names)
        for p in names[k:] + names[:k]:
            t0 = time.perf_counter()
            calls[p]()
            times[p].append(time.perf_counter() - t0)

    benchmark.group = _group(shape, dtype, mode) + " interleaved"
    benchmark.extra_info["provider"] = "one round of every provider"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    benchmark.extra_info["interleaved"] = interleaved_table(times)


def interleaved_table(times: dict[str, list[float]]) -> list[dict]:
    """Per provider: its median time, that median over the reference's and
    over the floor's (the faster floor), and the median of its per-round
    ratios to the reference (rounds paired)."""
    if not times.get("reference"):
        return []
    med = {p: statistics.median(t) for p, t in times.items()}
    floors = [p for p in times if p.endswith("-floor")]
    floor = min(floors, key=med.get) if floors else None
    ref = times["reference"]
    return [
        {
            "provider": PROVIDERS[p][0],
            "median_s": med[p],
            "vs_reference": med[p] / med["reference"],
            "vs_reference_paired": statistics.median(a / b for a, b in zip(t, ref)),
            "vs_floor": med[p] / med[floor] if floor else None,
        }
        for p, t in sorted(times.items(), key=lambda kv: med[kv[0]])
    ]
