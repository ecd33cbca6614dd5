"""Fingerprint throughput, GB/s (bytes read = tensor size).

One 512 MiB fp32 tensor. Providers, one run: ours (C++ on CPU, with the
instruction set it picked; CUDA and Triton on GPU), t.sum() (the
read-bandwidth reference), torch.hash_tensor (XOR of upcast elements), and
xxh3_64 from the xxhash package (one thread, CPU).

A model's many tensors (272 tensors shaped like a 135M-parameter decoder,
bf16, 269 MB): fingerprint_tensors (one call into the kernel for all of
them) against a Python loop of fingerprint() per tensor and against t.sum()
of each tensor.

    make bench                  # every benchmark
    pytest bench/bench_fingerprint.py -s
"""

import pytest
import torch

import resident_trainer as rt
from resident_trainer.ops import fingerprint as fp

SIZE = 512 << 20  # bytes
ROUNDS = 7

CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES, ids=str)
def tensor(request):
    return torch.randn(SIZE // 4, device=request.param, generator=None)


def _group(tensor):
    where = f"cpu, {fp.cpu_isas()[0]}" if tensor.device.type == "cpu" else tensor.device.type
    return f"fingerprint 512 MiB fp32 on {where}"


def _run(benchmark, fn, tensor, provider, reference=False, group=None, nbytes=SIZE):
    sync = torch.cuda.synchronize if tensor.is_cuda else (lambda: None)

    def call():
        out = fn(tensor)
        sync()
        return out

    benchmark.group = group or _group(tensor)
    benchmark.extra_info.update(provider=provider, bytes=nbytes, reference=reference)
    benchmark.pedantic(call, rounds=ROUNDS, iterations=1, warmup_rounds=1)


def test_ours(benchmark, tensor):
    _run(benchmark, lambda t: rt.fingerprint(t), tensor, f"resident_trainer.fingerprint (v{fp.FINGERPRINT_VERSION})")
    if tensor.device.type == "cpu":
        # The prefetch target chosen by measurement in the warm-up round.
        benchmark.extra_info["path"] = fp.cpu_choice()


def test_triton(benchmark, tensor):
    if not tensor.is_cuda:
        pytest.skip("the Triton kernel runs on GPUs only (the interpreter is a test tool)")
    _run(benchmark, lambda t: rt.fingerprint(t, impl="triton"), tensor, "resident_trainer (triton)")


def test_sum(benchmark, tensor):
    _run(benchmark, lambda t: t.sum(), tensor, "t.sum() (read bandwidth)", reference=True)


def test_hash_tensor(benchmark, tensor):
    _run(benchmark, lambda t: torch.hash_tensor(t), tensor, "torch.hash_tensor")


def test_xxh3(benchmark, tensor):
    xxhash = pytest.importorskip("xxhash")
    if tensor.is_cuda:
        pytest.skip("xxh3 is a CPU hash")
    view = memoryview(tensor.view(torch.uint8).numpy())
    _run(benchmark, lambda t: xxhash.xxh3_64_intdigest(view), tensor, "xxh3_64 (one thread)")


# --- many tensors ---------------------------------------------------------------


def _decoder_like() -> dict[str, torch.Tensor]:
    # 30 layers of (q, k, v, o, gate, up, down, two norms), an embedding and a
    # final norm: the tensor count and sizes of a 135M-parameter decoder.
    d, ff, kv = 576, 1536, 192
    shapes = {"embed": (49152, d), "norm": (d,)}
    for i in range(30):
        layer = {"q": (d, d), "k": (kv, d), "v": (kv, d), "o": (d, d), "gate": (ff, d), "up": (ff, d)}
        layer.update({"down": (d, ff), "ln1": (d,), "ln2": (d,)})
        shapes.update({f"{i}.{n}": s for n, s in layer.items()})
    return {n: torch.randn(s).bfloat16() for n, s in shapes.items()}


@pytest.fixture(scope="module")
def model_tensors():
    return _decoder_like()


def _run_many(benchmark, fn, named, provider, reference=False):
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    benchmark.group = f"{len(named)} tensors, {nbytes / 1e6:.0f} MB bf16 on cpu"
    benchmark.extra_info.update(provider=provider, bytes=nbytes, reference=reference)
    benchmark.pedantic(fn, args=(named,), rounds=ROUNDS, iterations=1, warmup_rounds=1)


def test_many_ours(benchmark, model_tensors):
    _run_many(benchmark, rt.fingerprint_tensors, model_tensors, "fingerprint_tensors (one kernel call)")
    benchmark.extra_info["path"] = fp.cpu_choice()


def test_many_loop(benchmark, model_tensors):
    _run_many(benchmark, lambda m: [rt.fingerprint(t) for t in m.values()], model_tensors, "fingerprint() per tensor")


def test_many_sum(benchmark, model_tensors):
    _run_many(benchmark, lambda m: [t.sum() for t in m.values()], model_tensors, "t.sum() per tensor", reference=True)
