"""Linear cross-entropy, forward + backward: time, ratio to eager torch, and
peak extra memory, with every provider measured in the same run.

Providers: ours (``impl="auto"``: the C++ tiles on CPU, the torch path of
library products over chunks on GPU, its elementwise work in Triton chunk
kernels) and, on GPU, ours with the Triton kernels (``impl="triton"``) and
ours on the torch path with torch ops for the elementwise work; eager torch ``F.cross_entropy(h @ W.T, y)`` (the reference);
torch 2.13's chunked ``F.linear_cross_entropy`` with its automatic options and
with ``batch_chunk_size=256``; Apple's cut-cross-entropy (``torch_compile`` on
CPU, its Triton kernel on GPU); Liger-Kernel's fused linear cross-entropy (GPU
only); and the matmul floor: the op's matmul FLOPs at the rate a plain
``h @ W.T`` of the same shape reaches, i.e. k x time(h @ W.T) with k = 2 for a
frozen head (logits + dh) and 3 with dW, timed with torch.mm (MKL) and with
oneDNN's inner product in the same run; the faster is the group's floor
(bench/conftest.py prints every provider's ratio to it). On CUDA the floor is
torch.mm (cuBLAS) alone.

Peak extra memory is measured per provider in a fresh process: after one
warm-up step, the resident set high-water mark (VmHWM, reset through
/proc/self/clear_refs) minus the resident size before the step, minus the
returned gradients (dh, and dW in the dW mode); on a GPU,
torch.cuda.max_memory_allocated the same way.

    make bench                                           # everything in bench/
    pytest bench/bench_linear_cross_entropy.py -s        # this file
    RT_BENCH_LCE_FULL=1 pytest bench/bench_linear_cross_entropy.py -s   # every shape
    RT_BENCH_LCE_SHAPES="512,576,49152;512,4096,128256" pytest ...       # chosen (N,D,V)
    RT_BENCH_LCE_PEAK="ours" pytest ...   # peak memory of these providers only ("" for none)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _memory import peak_bytes_of

import resident_trainer as rt
from resident_trainer.ops import _gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
SMOLLM2 = (576, 49152)
LLAMA3_8B = (4096, 128256)
if os.environ.get("RT_BENCH_LCE_SHAPES"):
    # e.g. RT_BENCH_LCE_SHAPES="512,576,49152;8192,576,49152"
    SHAPES = [tuple(int(x) for x in s.split(",")) for s in os.environ["RT_BENCH_LCE_SHAPES"].split(";")]
elif os.environ.get("RT_BENCH_LCE_FULL") == "1":
    SHAPES = [(n, d, v) for d, v in (SMOLLM2, LLAMA3_8B) for n in (512, 2048, 8192)]
elif DEVICE == "cuda":
    SHAPES = [(8192, *LLAMA3_8B), (2048, *SMOLLM2)]
else:
    # The CPU goal shape; the full grid takes hours on two cores.
    SHAPES = [(2048, *SMOLLM2)]
ROUNDS = 5 if DEVICE == "cuda" else 3


def _ours(h, w, y):
    return rt.linear_cross_entropy(h, w, y)


def _ours_triton(h, w, y):
    return rt.linear_cross_entropy(h, w, y, impl="triton")


def _ours_torch_with(name, value):
    """The torch path with one of its module settings changed for the call."""

    def fn(h, w, y):
        from resident_trainer.ops import linear_cross_entropy as lce

        before = getattr(lce, name)
        setattr(lce, name, value)
        try:
            return rt.linear_cross_entropy(h, w, y, impl="torch")
        finally:
            setattr(lce, name, before)

    return fn


def _eager(h, w, y):
    return F.cross_entropy((h @ w.T).float(), y)


def _torch_chunked_auto(h, w, y):
    return F.linear_cross_entropy(h, w, y, options=torch.nn.LinearCrossEntropyOptions())


def _torch_chunked_256(h, w, y):
    return F.linear_cross_entropy(h, w, y, options=torch.nn.LinearCrossEntropyOptions(batch_chunk_size=256))


def _cce(h, w, y):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, y, impl="cce" if h.is_cuda else "torch_compile")


def _liger(h, w, y):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss()(w, h, y)


PROVIDERS = {
    "ours": _ours,
    "ours, impl='triton'": _ours_triton,
    "ours, impl='torch' without the chunk kernels": _ours_torch_with("TORCH_FUSED", False),
    "ours, impl='torch' with dW in forward": _ours_torch_with("TORCH_WGRAD_FORWARD", True),
    "torch eager (reference)": _eager,
    "torch chunked, auto options": _torch_chunked_auto,
    "torch chunked, batch_chunk_size=256": _torch_chunked_256,
    "cut-cross-entropy": _cce,
    "liger-kernel": _liger,
}
# The floor's product, ``h @ W.T``, per backend.
FLOORS = {
    "matmul floor, torch.mm (MKL)": lambda h, w: torch.mm(h, w.t()),
    "matmul floor, oneDNN": lambda h, w: torch.ops.mkldnn._linear_pointwise(h, w, None, "none", [], ""),
}
NEEDS = {"cut-cross-entropy": "cut_cross_entropy", "liger-kernel": "liger_kernel"}
# Triton on CPU is the interpreter: a test tool. On CPUs the torch path's
# elementwise work is torch ops anyway.
GPU_ONLY = {
    "liger-kernel",
    "ours, impl='triton'",
    "ours, impl='torch' without the chunk kernels",
    "ours, impl='torch' with dW in forward",
}
# Providers that differ from "ours" only when the head takes a gradient.
DW_ONLY = {"ours, impl='torch' with dW in forward"}
# torch's own chunked op (F.linear_cross_entropy) is not in every torch.
TORCH_CHUNKED = {"torch chunked, auto options", "torch chunked, batch_chunk_size=256"}


def make_inputs(n, d, v, mode, device=DEVICE, dtype=DTYPE, seed=0):
    # Drawn where they are used: on a GPU, a CPU draw of the Llama-3 head
    # (525M values) took seconds per provider, in the parent and its
    # peak-memory child alike.
    g = torch.Generator(device).manual_seed(seed)
    h = (torch.randn(n, d, generator=g, device=device) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, device=device) * d**-0.5).to(dtype).requires_grad_(mode == "dW")
    y = torch.randint(0, v, (n,), generator=g, device=device)
    return h, w, y


def step(fn, h, w, y):
    h.grad = None
    w.grad = None
    fn(h, w, y).backward()
    if h.is_cuda:
        torch.cuda.synchronize()


def measure_peak_extra_mib(provider, mode, n, d, v):
    """Peak memory of one fwd+bwd step above its inputs, minus the returned
    gradients, in MiB (run this in a fresh process)."""
    fn = PROVIDERS[provider]
    h, w, y = make_inputs(n, d, v, mode)
    step(fn, h, w, y)  # warm-up: compilation, allocator pools
    h.grad = w.grad = None
    returned = h.numel() * h.element_size() + (w.numel() * w.element_size() if mode == "dW" else 0)
    peak = peak_bytes_of(lambda: step(fn, h, w, y), DEVICE)
    return max(peak - returned, 0) / 2**20


def _peak_in_subprocess(provider, mode, n, d, v):
    cmd = [sys.executable, __file__, "--peak", provider, mode, str(n), str(d), str(v)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    return round(json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_mib"], 1)


def _available(provider):
    if provider in GPU_ONLY and DEVICE != "cuda":
        return False
    if provider in TORCH_CHUNKED and not hasattr(F, "linear_cross_entropy"):
        return False
    mod = NEEDS.get(provider)
    if mod is None:
        return True
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-D{s[1]}-V{s[2]}")
@pytest.mark.parametrize("mode", ["frozen", "dW"])
@pytest.mark.parametrize("provider", list(PROVIDERS) + list(FLOORS))
def test_linear_cross_entropy(benchmark, provider, mode, shape):
    n, d, v = shape
    if provider in FLOORS:
        if "oneDNN" in provider and (DEVICE != "cpu" or not _gemm.onednn_supports(DTYPE)):
            pytest.skip(f"oneDNN's inner product does not run {DTYPE} on this {DEVICE}")
    elif mode == "frozen" and provider in DW_ONLY:
        pytest.skip(f"{provider} is 'ours' with a frozen head")
    elif not _available(provider):
        pytest.skip(f"{provider} is not installed, is not in torch {torch.__version__}, or does not run on {DEVICE}")
    h, w, y = make_inputs(n, d, v, mode)
    k = 2 if mode == "frozen" else 3
    benchmark.group = f"linear CE fwd+bwd, {mode} head, N={n} D={d} V={v} {str(DTYPE)[6:]} {DEVICE}"
    benchmark.extra_info.update(
        provider=provider,
        reference=provider == "torch eager (reference)",
        floor=provider in FLOORS,
        flops=2 * k * n * d * v,
    )
    if provider in FLOORS:
        hd = h.detach()
        wd = w.detach()
        product = FLOORS[provider]

        def floor():
            for _ in range(k):
                product(hd, wd)
            if hd.is_cuda:
                torch.cuda.synchronize()

        benchmark.pedantic(floor, rounds=ROUNDS, warmup_rounds=1)
        return
    peak = os.environ.get("RT_BENCH_LCE_PEAK")
    if peak is None or provider in [p.strip() for p in peak.split(",")]:
        benchmark.extra_info["peak_extra_MiB"] = _peak_in_subprocess(provider, mode, n, d, v)
    fn = PROVIDERS[provider]
    benchmark.pedantic(lambda: step(fn, h, w, y), rounds=ROUNDS, warmup_rounds=1)


def test_all_ignored_batch(benchmark):
    """Which providers survive a batch whose targets are all ignore_index."""
    n, d, v = 64, 32, 1000
    benchmark.group = "all targets ignored (loss and gradients finite?)"
    results = {}
    for provider in PROVIDERS:
        if not _available(provider):
            continue
        h, w, y = make_inputs(n, d, v, "dW")
        y[:] = -100
        try:
            loss = PROVIDERS[provider](h, w, y)
            loss.backward()
            finite = (
                bool(torch.isfinite(loss)) and bool(torch.isfinite(h.grad).all()) and bool(torch.isfinite(w.grad).all())
            )
            results[provider] = "finite" if finite else f"NaN/inf (loss {loss.item()})"
        except Exception as exc:  # a peer that raises is a result too
            results[provider] = f"raises {type(exc).__name__}"
    benchmark.extra_info.update(provider="(see per-provider results)", **results)
    benchmark.pedantic(lambda: None, rounds=1)
    assert results["ours"] == "finite"


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "--peak":
    _, _, prov, md, n_, d_, v_ = sys.argv
    print(json.dumps({"peak_extra_mib": measure_peak_extra_mib(prov, md, int(n_), int(d_), int(v_))}))
