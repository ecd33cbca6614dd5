"""Fingerprint throughput on a 512 MiB tensor, GB/s (bytes read = tensor size).

Providers, one run: ours (C++ on CPU; CUDA and Triton on GPU), t.sum() (the
read-bandwidth reference), torch.hash_tensor (XOR of upcast elements), and
xxh3_64 from the xxhash package (one thread, CPU).

    make bench                  # every benchmark
    pytest bench/bench_fingerprint.py -s
"""

import pytest
import torch

import resident_trainer as rt

SIZE = 512 << 20  # bytes
ROUNDS = 7

CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES, ids=str)
def tensor(request):
    return torch.randn(SIZE // 4, device=request.param, generator=None)


def _run(benchmark, fn, tensor, provider, reference=False):
    sync = torch.cuda.synchronize if tensor.is_cuda else (lambda: None)

    def call():
        out = fn(tensor)
        sync()
        return out

    benchmark.group = f"fingerprint 512 MiB fp32 on {tensor.device.type}"
    benchmark.extra_info.update(provider=provider, bytes=SIZE, reference=reference)
    benchmark.pedantic(call, rounds=ROUNDS, iterations=1, warmup_rounds=1)


def test_ours(benchmark, tensor):
    _run(benchmark, lambda t: rt.fingerprint(t), tensor, "resident_trainer.fingerprint")


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
