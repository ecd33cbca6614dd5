"""The CPU product backend (resident_trainer.ops._gemm): the RESIDENT_TRAINER_GEMM
override, its error, the measured choice cached per shape class, the fallback
where oneDNN does not run a dtype, and both backends' results against fp64
with torch.mm's own error as the yardstick."""

import pytest
import torch

from resident_trainer.ops import _gemm

# Tolerance: err <= K * err_torch.mm + ATOL * max(|a| |b|^T) (one entry's
# scale). Measured on this suite: oneDNN's fp32 error is up to 2.9x torch.mm's
# where K is small and both are a few ulps (the ATOL term, 1e-6 of an entry,
# covers that); a wrong or missing term of a dot product is O(scale).
K = 2.0
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(_gemm.ENV, raising=False)
    _gemm.clear_choices()
    yield
    _gemm.clear_choices()


def _operands(m, k, l_, dtype, gen, layout="nn"):
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(l_, k, generator=gen).to(dtype)
    if layout[0] == "t":
        a = a.t().contiguous().t()
    if layout[1] == "t":
        b = b.t().contiguous().t()
    return a, b


def _avx2_only() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    # oneDNN's bf16 needs AVX-512 (or AVX-NE-CONVERT on newer AVX2 parts).
    return " avx2 " in flags and "avx512" not in flags and "avx_ne_convert" not in flags


def test_bad_setting_names_the_variable(monkeypatch, gen):
    a, b = _operands(4, 3, 5, torch.float32, gen)
    monkeypatch.setenv(_gemm.ENV, "blas")
    with pytest.raises(ValueError, match=r"RESIDENT_TRAINER_GEMM must be one of \('auto', 'mkl', 'onednn'\).*'blas'"):
        _gemm.linear(a, b)
    # checked for dtypes only torch.mm runs too
    with pytest.raises(ValueError, match="RESIDENT_TRAINER_GEMM"):
        _gemm.linear(a.double(), b.double())
    with pytest.raises(ValueError, match="RESIDENT_TRAINER_GEMM"):
        _gemm.choose(a, b)


def _count_runs(monkeypatch):
    ran = []
    for name in _gemm.BACKENDS:
        monkeypatch.setitem(_gemm._RUN, name, lambda a, b, f=_gemm._RUN[name], n=name: ran.append(n) or f(a, b))
    return ran


@pytest.mark.parametrize("setting", ["mkl", "onednn", "MKL", " onednn "])
def test_setting_is_honoured(monkeypatch, setting, gen):
    if not _gemm.onednn_supports(torch.float32):
        pytest.skip("oneDNN's inner product does not run fp32 in this torch build")
    a, b = _operands(33, 17, 9, torch.float32, gen)
    monkeypatch.setenv(_gemm.ENV, setting)
    want = setting.strip().lower()
    ran = _count_runs(monkeypatch)
    for _ in range(3):
        assert _gemm.choose(a, b) == want
        out = _gemm.linear(a, b)
    assert ran == [want] * 3, "a forced backend measures nothing"
    assert not _gemm._CHOICES
    # and the product is that backend's, bit for bit
    assert torch.equal(out, _gemm._RUN[want](a, b))


def test_setting_read_on_every_call(monkeypatch, gen):
    if not _gemm.onednn_supports(torch.float32):
        pytest.skip("oneDNN's inner product does not run fp32 in this torch build")
    a, b = _operands(8, 8, 8, torch.float32, gen)
    for setting in ("mkl", "onednn", "mkl"):
        monkeypatch.setenv(_gemm.ENV, setting)
        assert _gemm.choose(a, b) == setting
    monkeypatch.setenv(_gemm.ENV, "auto")
    assert _gemm.choose(a, b) == _gemm._CHOICES[_gemm.shape_class(a, b)][0]


def test_choice_measured_once_per_class(monkeypatch, gen):
    if not _gemm.onednn_supports(torch.float32):
        pytest.skip("oneDNN's inner product does not run fp32 in this torch build")
    calls = []
    measure = _gemm._measure
    monkeypatch.setattr(_gemm, "_measure", lambda a, b: calls.append((a.shape, b.shape)) or measure(a, b))
    a, b = _operands(100, 60, 200, torch.float32, gen)
    first = _gemm.choose(a, b)
    ran = _count_runs(monkeypatch)
    outs = [_gemm.linear(a, b) for _ in range(4)]
    # measured before the class's first product; every product then runs the
    # choice, so the results are the same bits every time
    assert calls == [((100, 60), (200, 60))] and ran == [first] * 4
    assert all(torch.equal(o, outs[0]) for o in outs)
    name, best = _gemm._CHOICES[_gemm.shape_class(a, b)]
    # oneDNN only when it beats MKL by ONEDNN_MARGIN (a near tie is noise, and MKL stays)
    rule = "onednn" if best["onednn"] < _gemm.ONEDNN_MARGIN * best["mkl"] else "mkl"
    assert name == first == rule and set(best) == set(_gemm.BACKENDS)
    assert all(0 < t < float("inf") for t in best.values())
    # same power-of-two buckets (M 65-128, K 33-64, L 129-256): the same class
    _gemm.linear(*_operands(128, 40, 129, torch.float32, gen))
    assert len(calls) == 1
    # another bucket, another layout: measured once each
    _gemm.linear(*_operands(300, 60, 200, torch.float32, gen))
    for _ in range(2):
        _gemm.linear(*_operands(100, 60, 200, torch.float32, gen, layout="tn"))
    assert len(calls) == 3
    report = _gemm.backend_report()
    assert "RESIDENT_TRAINER_GEMM=(unset: auto)" in report
    assert f"float32 {torch.get_num_threads()} threads nn M<=128 K<=64 L<=256: {first} (mkl " in report
    assert "tn M<=128 K<=64 L<=256" in report


def test_probe_cuts_rows_only(monkeypatch, gen):
    # A large product is probed on the leading rows of `a` (layout kept), the
    # whole of `b`: at most PROBE_FLOPS a product.
    seen = []
    for name in _gemm.BACKENDS:
        monkeypatch.setitem(_gemm._RUN, name, lambda a, b: seen.append((a.shape, a.stride(), b.shape)) or a[:, :1])
    a, b = _operands(4096, 512, 1024, torch.float32, gen, layout="tt")
    _gemm._measure(a, b)
    rows = int(_gemm.PROBE_FLOPS / (2 * 512 * 1024))
    assert {s for s in seen} == {((rows, 512), (1, rows), (1024, 512))}
    assert len(seen) == 2 * (1 + _gemm._PROBE_RUNS)
    seen.clear()
    a, b = _operands(4096, 8192, 8192, torch.float32, gen)
    _gemm._measure(a, b)
    assert {s[0] for s in seen} == {(_gemm._PROBE_MIN_ROWS, 8192)}


def test_unsupported_dtype_falls_back_to_torch_mm(monkeypatch, gen):
    monkeypatch.setenv(_gemm.ENV, "onednn")
    for dtype in (torch.float64, torch.float16):
        a, b = _operands(5, 7, 3, dtype, gen)
        assert _gemm.choose(a, b) == "mkl"
        assert torch.equal(_gemm.linear(a, b), torch.mm(a, b.t()))
    # a CPU whose oneDNN refuses a dtype (bf16 without AVX-512)
    monkeypatch.setattr(_gemm, "onednn_supports", lambda dtype: False)
    for setting in ("auto", "onednn"):
        monkeypatch.setenv(_gemm.ENV, setting)
        a, b = _operands(5, 7, 3, torch.float32, gen)
        assert _gemm.choose(a, b) == "mkl"
        assert torch.equal(_gemm.linear(a, b), torch.mm(a, b.t()))
    assert not _gemm._CHOICES


@pytest.mark.skipif(not _avx2_only(), reason="the fallback case is an AVX2-only CPU")
def test_bf16_on_avx2_only_cpu_is_torch_mm(monkeypatch, gen):
    assert not _gemm.onednn_supports(torch.bfloat16)
    for setting in ("auto", "onednn"):
        monkeypatch.setenv(_gemm.ENV, setting)
        a, b = _operands(40, 30, 20, torch.bfloat16, gen)
        assert _gemm.choose(a, b) == "mkl"
        assert torch.equal(_gemm.linear(a, b), torch.mm(a, b.t()))
    assert not _gemm._CHOICES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("setting", ["auto", "mkl", "onednn"])
@pytest.mark.parametrize("m,k,l_", [(1, 7, 33), (37, 19, 301), (130, 513, 67)])
def test_results_against_fp64(monkeypatch, dtype, layout, setting, m, k, l_, gen):
    monkeypatch.setenv(_gemm.ENV, setting)
    a, b = _operands(m, k, l_, dtype, gen, layout)
    truth = a.double() @ b.double().t()
    err_torch = (torch.mm(a, b.t()).double() - truth).abs().max().item()
    scale = (a.double().abs() @ b.double().abs().t()).max().item()
    for _ in range(2):
        got = _gemm.linear(a, b)
        assert got.shape == (m, l_) and got.dtype == dtype and got.is_contiguous()
        err = (got.double() - truth).abs().max().item()
        assert err <= K * err_torch + ATOL[dtype] * scale, f"err {err:.3g} vs torch.mm {err_torch:.3g}"


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("setting", ["mkl", "onednn"])
def test_accumulate_into_a_view(monkeypatch, out_dtype, layout, setting, gen):
    # out += a @ b.T into rows of a larger tensor (a view, as dW's tiles
    # are), fp32 operands; a bf16 `out` takes the product's add path.
    monkeypatch.setenv(_gemm.ENV, setting)
    a, b = _operands(37, 19, 30, torch.float32, gen, layout)
    big = torch.randn(50, 30, generator=gen).to(out_dtype)
    before = big.clone()
    out = _gemm.linear_acc(big[5:42], a, b)
    assert out.data_ptr() == big[5:42].data_ptr()
    truth = before[5:42].double() + a.double() @ b.double().t()
    err = (big[5:42].double() - truth).abs().max().item()
    scale = (a.double().abs() @ b.double().abs().t()).max().item()
    assert err <= (2.0**-8 * truth.abs().max().item() if out_dtype == torch.bfloat16 else 1e-6 * scale)
    assert torch.equal(big[:5], before[:5]) and torch.equal(big[42:], before[42:])


def test_empty_operands(gen):
    a = torch.zeros(0, 5)
    b = torch.randn(4, 5, generator=gen)
    assert _gemm.linear(a, b).shape == (0, 4) and _gemm.linear(b, torch.zeros(0, 5)).shape == (4, 0)


@pytest.mark.parametrize(("onednn_ms", "want"), [(0.97, "mkl"), (0.89, "onednn"), (0.5, "onednn"), (1.2, "mkl")])
def test_onednn_must_win_by_the_margin(monkeypatch, gen, onednn_ms, want):
    # A fake clock that each backend advances by its own cost: torch.mm 1 ms,
    # oneDNN `onednn_ms`. oneDNN is chosen only when at least 10% faster.
    now = [0.0]
    cost = {"mkl": 1e-3, "onednn": onednn_ms * 1e-3}

    class Clock:
        @staticmethod
        def perf_counter():
            return now[0]

    def fake(name):
        def run(a, b):
            now[0] += cost[name]
            return a @ b.t()

        return run

    monkeypatch.setattr(_gemm, "time", Clock)
    for name in _gemm.BACKENDS:
        monkeypatch.setitem(_gemm._RUN, name, fake(name))
    a, b = _operands(64, 32, 48, torch.float32, gen)
    choice, best = _gemm._measure(a, b)
    assert choice == want
    assert best == pytest.approx(cost)
