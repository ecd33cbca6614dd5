"""Matrix products on the CPU: torch.mm (MKL) or oneDNN's inner product,
whichever this CPU runs faster, chosen by measurement.

Neither backend wins everywhere. torch.mm on the CPU goes to MKL's sgemm,
which on AMD processors runs its AVX2 code while oneDNN dispatches on the
instruction set: on a 2-core AMD EPYC (Zen 5, fp32) (2048 x 576) @ (576 x
49152) took 705 ms with torch.mm and 347 ms with oneDNN. On an Intel Xeon
with AVX-512, where MKL runs its AVX-512 code, oneDNN was not faster: the
added expert's nine products took 0.98x of autograd's time through oneDNN
against 0.76x through torch.mm. So `linear` measures both on the CPU it
runs on, once per process and shape class (dtype, thread count, the operands'
layouts, and M, K, L each rounded up to a power of two), before the class's
first product: on that call's own operands, with the rows of `a` cut to keep
a product under 5e8 FLOPs (~3 ms on two cores; never under 128 rows), one
warm-up call each (oneDNN creates and caches its primitive there) and then
3 timed calls each, alternating, the best of each compared (oneDNN must be
at least 10% faster to be chosen: see ONEDNN_MARGIN); at most ~25 ms per
class, once. Every product of a class then runs the same backend, so
results are reproducible within a process. Only M is cut: K and L set the
backends' blocking and the cost of oneDNN's copy of a transposed `a`
relative to the product, so the probe keeps them. The probe takes the best
of a few runs of a few ms, so on a machine shared with other busy processes
its choice is noisy; that costs speed, never accuracy. `backend_report()`
lists what was chosen and measured.

RESIDENT_TRAINER_GEMM=mkl or =onednn forces a backend (read on every call;
default "auto", the measurement); under "auto", RESIDENT_TRAINER_REPRODUCIBLE=1
takes torch.mm without measuring (the two round differently, and a close
probe can choose either from one process to the next). oneDNN is reached through
``torch.ops.mkldnn._linear_pointwise``, the op torch's own CPU compiler emits
for linear layers; builds without it, other devices and dtypes it does not
run take torch.mm whatever the setting. oneDNN's bf16 inner product needs
AVX-512 (or AMX): on an AVX2-only EPYC (Zen 3) it refuses to create the
primitive ("could not create a primitive descriptor"). Whether a dtype works
is probed once per process on a tiny product.

"mkl" names torch.mm, what torch does by default: MKL's sgemm for fp32; for
bf16 torch picks its own kernel (oneDNN's matmul where the CPU has AVX-512).
"""

from __future__ import annotations

import functools
import os
import threading
import time

import torch
from torch import Tensor

from resident_trainer import _ext

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)

ENV = "RESIDENT_TRAINER_GEMM"
MODES = ("auto", "mkl", "onednn")
BACKENDS = ("mkl", "onednn")

# A probe's FLOP budget per product and its floor on rows (see above).
PROBE_FLOPS = 5e8
_PROBE_MIN_ROWS = 128
_PROBE_RUNS = 3
# oneDNN is chosen only when the probe measures it this much faster than
# torch.mm. The probe times a product on hot operands; in a real loop the
# operands stream from memory and oneDNN first reorders its weight operand,
# which the probe does not see: on a Sapphire Rapids-class Xeon the probe
# measured oneDNN 2% faster on the cross-entropy's (170 x 576) @ (576 x 1024)
# products (0.55 against 0.56 ms), and in the loop they took 775 against 481 us
# a call. Where oneDNN wins for real it wins by far more (2x on Zen 5, 1.4x on
# Zen 3, where MKL runs its AVX2 code on AMD).
ONEDNN_MARGIN = 0.9


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN's inner product runs for `dtype` on this CPU (probed once)."""
    if not ONEDNN or dtype not in _ONEDNN_DTYPES:
        return False
    a = torch.ones(2, 8, dtype=dtype)
    b = torch.ones(3, 8, dtype=dtype)
    try:
        out = torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    except RuntimeError:
        return False
    return bool((out == 8).all())


def mode() -> str:
    """The RESIDENT_TRAINER_GEMM setting ("auto" when unset), checked."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV} must be one of {MODES} (unset means 'auto'), got {os.environ[ENV]!r}")
    return value


def _bucket(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _layout(t: Tensor) -> str:
    return "n" if t.is_contiguous() else "t"


def shape_class(a: Tensor, b: Tensor) -> tuple:
    """The key a measurement is kept under for ``a @ b.T``: dtype, threads,
    the operands' layouts (oneDNN copies a transposed `a`, torch.mm does not)
    and the power-of-two ceilings of M, K and L."""
    (m, k), l_ = a.shape, b.shape[0]
    return (a.dtype, torch.get_num_threads(), _layout(a) + _layout(b), _bucket(m), _bucket(k), _bucket(l_))


def _onednn(a: Tensor, b: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def _mkl(a: Tensor, b: Tensor) -> Tensor:
    return torch.mm(a, b.t())


_RUN = {"mkl": _mkl, "onednn": _onednn}


_CHOICES: dict[tuple, tuple[str, dict[str, float]]] = {}
_LOCK = threading.Lock()


def _measure(a: Tensor, b: Tensor) -> tuple[str, dict[str, float]]:
    """(the faster backend, best seconds of each) for ``a @ b.T`` on the
    leading rows of `a`. The backends alternate, each keeping its best run:
    on a machine shared with other work a preempted run is slow for one
    backend, not both."""
    m, k = a.shape
    rows = max(_PROBE_MIN_ROWS, int(PROBE_FLOPS / (2.0 * k * b.shape[0])))
    if rows < m:
        a = a[:rows]
        if not a.is_contiguous():  # keep a column-major `a` column-major
            a = a.t().contiguous().t()
    best = dict.fromkeys(BACKENDS, float("inf"))
    with torch.no_grad():
        for name in BACKENDS:
            _RUN[name](a, b)  # warm-up
        for _ in range(_PROBE_RUNS):
            for name in BACKENDS:
                t0 = time.perf_counter()
                _RUN[name](a, b)
                best[name] = min(best[name], time.perf_counter() - t0)
    return ("onednn" if best["onednn"] < ONEDNN_MARGIN * best["mkl"] else "mkl"), best


def choose(a: Tensor, b: Tensor) -> str:
    """The backend ``linear(a, b)`` runs, "mkl" or "onednn": forced by
    RESIDENT_TRAINER_GEMM, torch.mm where oneDNN cannot run the product,
    else the measured choice for its class (measured here on first use)."""
    forced = mode()  # checked even where only torch.mm can run
    if not (a.device.type == "cpu" and b.dtype == a.dtype and a.numel() and b.numel() and onednn_supports(a.dtype)):
        return "mkl"
    if forced != "auto":
        return forced
    if _ext.reproducible():
        return "mkl"
    key = shape_class(a, b)
    hit = _CHOICES.get(key)
    if hit is None:
        with _LOCK:
            hit = _CHOICES.get(key)
            if hit is None:
                hit = _CHOICES[key] = _measure(a, b)
    return hit[0]


def backend_report() -> str:
    """For benchmark output: the setting, what each backend runs here, and
    each measured class's choice with both backends' best probe times."""
    dtypes = ", ".join(f"{str(d)[6:]} {'yes' if onednn_supports(d) else 'no'}" for d in _ONEDNN_DTYPES)
    lines = [
        f"gemm: {ENV}={os.environ.get(ENV, '') or '(unset: auto)'}; torch.mm (MKL: "
        f"{'yes' if torch.backends.mkl.is_available() else 'no'}); oneDNN inner product: {dtypes}"
    ]
    for key, (name, best) in sorted(_CHOICES.copy().items(), key=str):
        dtype, threads, layout, m, k, l_ = key
        times = ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in best.items())
        lines.append(f"  {str(dtype)[6:]} {threads} threads {layout} M<={m} K<={k} L<={l_}: {name} ({times})")
    if len(lines) == 1:
        note = _ext.reproducible_note("torch.mm") if mode() == "auto" else ""
        lines.append(f"  no shape class measured{note}")
    return "\n".join(lines)


def clear_choices() -> None:
    """Forget every measurement (each class measures again on its next product)."""
    with _LOCK:
        _CHOICES.clear()


def _operand(t: Tensor) -> Tensor:
    # Row- or column-major operands go in as they are; anything else is copied.
    return t if t.is_contiguous() or t.t().is_contiguous() else t.contiguous()


def linear_acc(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``out += a @ b.T`` in place, as `linear` would compute the product:
    torch.mm's backend accumulates in the product itself (``addmm_``, one
    pass over `out` fewer); oneDNN's product is added afterwards."""
    a, b = _operand(a), _operand(b)
    if out.dtype == a.dtype and choose(a, b) == "mkl":
        return out.addmm_(a, b.t())
    return out.add_(linear(a, b))


def linear(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b.T`` for a: (M, K), b: (L, K), accumulated in fp32, output (M, L)
    contiguous in a's dtype, through the backend `choose` picks. oneDNN copies a
    transposed `a` first, so callers keep the transposed operand small (a
    tile, not a whole matrix)."""
    a, b = _operand(a), _operand(b)
    return _RUN[choose(a, b)](a, b)
