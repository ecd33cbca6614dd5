"""Fingerprint: every implementation bit-identical to the numpy oracle, which
itself matches a word-by-word pure-Python statement of the spec; invariance to
tiling, threads, contiguity and offset; sensitivity to every bit; shards."""

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import resident_trainer as rt
from resident_trainer.ops import fingerprint as fp

ROOT = Path(__file__).resolve().parents[1]

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
] + ([torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else [])

# 0-d, empty, one element, byte counts that are not a multiple of 4 for 1- and
# 2-byte dtypes, odd 2-D/3-D sizes, and one row longer than a Triton tile.
SHAPES = [(), (0,), (1,), (3,), (7, 5), (2, 3, 5), (1, 1025), (0, 4)]

CPU_IMPLS = ["cpu", "triton", "reference"]


def rand_tensor(shape, dtype, gen):
    numel = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


# --- the spec, word by word, in plain Python ints: a second oracle ------------


def _mum(a, m):
    p = a * m  # exact: both factors are below 2^32
    return (p ^ (p >> 32)) & 0xFFFFFFFF


def spec_lanes(data: bytes, word_offset: int):
    data = data + b"\0" * ((-len(data)) % 4)
    s0 = s1 = 0
    for i in range(len(data) // 4):
        w = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        g = word_offset + i
        lo, hi = g & 0xFFFFFFFF, g >> 32
        k = (lo * fp.KEY_MUL + _mum(hi ^ fp.HI_SEED, fp.HI_MUL)) & 0xFFFFFFFF
        p = (w ^ k) * ((2 * k + 1) & 0xFFFFFFFF)
        s0 += p & 0xFFFFFFFF
        s1 += p >> 32
    return s0 & 0xFFFFFFFF, s1 & 0xFFFFFFFF


@pytest.mark.parametrize("nbytes", [0, 1, 2, 3, 4, 5, 11, 64, 257])
@pytest.mark.parametrize("word_offset", [0, 7, 2**32 - 3, 2**40 + 1])
def test_oracle_matches_spec(nbytes, word_offset, gen):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    assert fp.fingerprint_lanes_reference(data, word_offset) == spec_lanes(data, word_offset)


def test_digest_format_is_stable():
    # Receipts and checkpoints store digests: changing the algorithm must be a
    # deliberate, visible break (a new FINGERPRINT_VERSION), so the digest of
    # version 3 is pinned here.
    assert fp.FINGERPRINT_VERSION == 3
    t = torch.arange(10, dtype=torch.int32).reshape(2, 5)
    l0, l1 = spec_lanes(t.numpy().tobytes(), 0)
    assert rt.fingerprint(t) == fp.finalize(l0, l1, torch.int32, (2, 5))
    assert f"{rt.fingerprint(t):016x}" == "65e395f18d30eaca"


def test_constants_agree_with_header():
    header = (ROOT / "csrc" / "fingerprint.h").read_text()
    defines = {k: int(v, 16) for k, v in re.findall(r"#define RT_FP_(\w+) (0x[0-9A-Fa-f]+)u", header)}
    names = ["KEY_MUL", "HI_SEED", "HI_MUL"]
    assert defines == {n: getattr(fp, n) for n in names}
    from resident_trainer.triton_kernels import fingerprint as tk

    assert {n: int(getattr(tk, n)) for n in names} == defines
    # The version the header states is the one the Python layer records, and
    # its tags carry it.
    assert int(re.search(r"#define RT_FP_VERSION (\d+)\n", header).group(1)) == fp.FINGERPRINT_VERSION
    assert (fp._TENSOR_TAG >> 8) & 0xFF == (fp._TABLE_TAG >> 8) & 0xFF == fp.FINGERPRINT_VERSION
    # Every kernel's multiplier is 2k + 1 (the one formula that is not a define).
    assert "return 2u * k + 1u;" in header
    assert "m = k * 2 + 1" in (ROOT / "triton_kernels" / "fingerprint.py").read_text()


# Byte counts around the vector widths (8 words for AVX2, 16 for AVX-512),
# with and without a 1..3-byte tail.
ISA_SIZES = [0, 1, 3, 4, 5, 28, 31, 32, 33, 36, 60, 63, 64, 65, 68, 127, 128, 131, 1000, 4099]
# 2^32 - 9 and 2^32 - 1: the 2^32-word run boundary falls inside the buffer,
# off the vector grid, so both runs have a scalar remainder.
ISA_OFFSETS = [0, 1, 7, 2**32 - 9, 2**32 - 1, 2**40 + 3]


def test_cpu_isas_listed():
    isas = fp.cpu_isas()
    assert isas[-1] == "scalar" and set(isas) <= {"avx512", "avx2", "scalar"}
    t = torch.arange(100, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="isa must be 'auto', 'avx512', 'avx2' or 'scalar', got 'sse'"):
        torch.ops.resident_trainer.fingerprint_lanes_many([t], [0], "sse")
    for isa in {"avx512", "avx2"} - set(isas):
        with pytest.raises(RuntimeError, match=f"isa='{isa}' is not supported by this CPU"):
            torch.ops.resident_trainer.fingerprint_lanes_many([t], [0], isa)


@pytest.mark.parametrize("word_offset", ISA_OFFSETS)
def test_every_cpu_isa_matches_oracle(word_offset, gen):
    # Each instruction set this CPU runs (the AVX-512 path is exercised on
    # machines that have it), every size at once in one call.
    datas = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in ISA_SIZES]
    want = [list(spec_lanes(d.numpy().tobytes(), word_offset)) for d in datas]
    for isa in ("auto", *fp.cpu_isas()):
        got = torch.ops.resident_trainer.fingerprint_lanes_many(datas, [word_offset] * len(datas), isa).tolist()
        assert got == want, isa
    for d, w in zip(datas, want):
        assert list(fp.fingerprint_lanes_reference(d.numpy(), word_offset)) == w


@pytest.mark.parametrize("word_offset", [0, 2**32 - 9, 2**40 + 3])
def test_triton_matches_oracle_on_awkward_sizes(word_offset, gen):
    for n in ISA_SIZES:
        d = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        part = rt.fingerprint_partial(d, offset=4 * word_offset, impl="triton")
        assert [part.lane0, part.lane1] == list(spec_lanes(d.numpy().tobytes(), word_offset)), n


def test_cpu_isas_agree_on_many_tasks(gen):
    # 300k words at an offset 1000 words below 2^32: several 64 Ki-word tasks,
    # one of them split at the run boundary.
    d = torch.randint(0, 256, (1_200_003,), dtype=torch.uint8, generator=gen)
    off = 2**32 - 1000
    want = list(fp.fingerprint_lanes_reference(d.numpy(), off))
    for isa in fp.cpu_isas():
        for prefetch in fp.PREFETCH_MODES:
            got = torch.ops.resident_trainer.fingerprint_lanes_many([d], [off], isa, prefetch)[0].tolist()
            assert got == want, (isa, prefetch)


@pytest.mark.parametrize("prefetch", ["l1", "l2"])
def test_every_prefetch_target_matches_oracle(prefetch, gen):
    datas = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in ISA_SIZES]
    for word_offset in (0, 2**32 - 9):
        want = [list(spec_lanes(d.numpy().tobytes(), word_offset)) for d in datas]
        for isa in fp.cpu_isas():
            got = torch.ops.resident_trainer.fingerprint_lanes_many(datas, [word_offset] * len(datas), isa, prefetch)
            assert got.tolist() == want, (isa, word_offset)


def test_prefetch_setting_is_checked(monkeypatch):
    t = torch.arange(100, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="prefetch must be 'auto', 'l1' or 'l2', got 'l3'"):
        torch.ops.resident_trainer.fingerprint_lanes_many([t], [0], "auto", "l3")
    monkeypatch.setenv(fp.PREFETCH_ENV, "L3")
    with pytest.raises(ValueError, match=r"RESIDENT_TRAINER_FINGERPRINT_PREFETCH must be one of .*'l3'"):
        rt.fingerprint(t)
    monkeypatch.setenv(fp.PREFETCH_ENV, "L2")
    assert rt.fingerprint(t) == rt.fingerprint(t, impl="reference")
    assert "prefetch l2 (set by RESIDENT_TRAINER_FINGERPRINT_PREFETCH)" in fp.cpu_choice()


def test_prefetch_auto_is_measured_on_a_large_call(monkeypatch, gen):
    # A call of 64 MiB or more measures both targets on its own first tasks
    # and keeps the faster; the probe's mixed targets give the same lanes as
    # either one alone and as the scalar loop (no prefetches at all).
    monkeypatch.delenv(fp.PREFETCH_ENV, raising=False)
    d = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=gen)
    ops = torch.ops.resident_trainer
    got = ops.fingerprint_lanes_many([d], [3], "auto", "auto")[0].tolist()
    assert got == ops.fingerprint_lanes_many([d], [3], "scalar", "l1")[0].tolist()
    for prefetch in ("l1", "l2"):
        assert got == ops.fingerprint_lanes_many([d], [3], "auto", prefetch)[0].tolist()
    choice = fp.cpu_choice()
    assert choice.startswith(fp.cpu_isas()[0] + ", prefetch ")
    if fp.cpu_isas()[0] != "scalar":
        assert re.search(r"prefetch (l1|l2) \(measured on 32 tasks of 256 KiB: l1 [\d.]+ GB/s, l2 [\d.]+ GB/s", choice)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_every_impl_matches_oracle(impl, dtype, shape, gen):
    t = rand_tensor(shape, dtype, gen)
    part = rt.fingerprint_partial(t, offset=0, impl=impl)
    lanes = [part.lane0, part.lane1]
    want = list(spec_lanes(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(), 0))
    assert lanes == want
    assert rt.fingerprint(t, impl=impl) == fp.finalize(*want, dtype, shape)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("word_offset", [2**32 - 5, 3 * 2**32 - 1, 2**44 + 12345])
def test_64bit_positions_do_not_wrap(impl, word_offset, gen):
    # 64 words straddling a 2^32-word (16 GiB) boundary, or far above it.
    data = torch.randint(0, 256, (64 * 4 + 3,), dtype=torch.uint8, generator=gen)
    part = rt.fingerprint_partial(data, offset=4 * word_offset, impl=impl)  # uint8: the offset is in bytes
    got = [part.lane0, part.lane1]
    assert got == list(spec_lanes(data.numpy().tobytes(), word_offset))
    if word_offset >= 2**32:  # the high half of the position enters the hash
        assert got != list(spec_lanes(data.numpy().tobytes(), word_offset & 0xFFFFFFFF))


@pytest.mark.parametrize("block", [16, 64, 1024])
def test_triton_any_tile_size(block, gen):
    from resident_trainer.triton_kernels.fingerprint import fingerprint_lanes_triton

    words = torch.randint(-(2**31), 2**31, (3001,), dtype=torch.int32, generator=gen)
    want = list(spec_lanes(words.numpy().tobytes(), 99))
    assert fingerprint_lanes_triton(words, 99, block=block).tolist() == want


def test_cpu_any_thread_count(gen):
    # 300k words: several of the C++ kernel's 64 Ki-word tasks.
    t = torch.randint(-(2**31), 2**31, (300_001,), dtype=torch.int32, generator=gen)
    want = rt.fingerprint(t, impl="reference")
    saved = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert rt.fingerprint(t, impl="cpu") == want
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_views_hash_their_logical_contents(impl, gen, monkeypatch):
    base = rand_tensor((9, 14), torch.bfloat16, gen)
    views = [
        base.t(),  # transposed
        base[1:, 3:],  # storage offset, non-contiguous
        base.reshape(-1)[1:],  # 2-byte storage offset: not 4-byte aligned
        base[:, ::3],  # strided
        base[2].expand(5, 14),  # zero stride
        rand_tensor((41,), torch.uint8, gen)[1:38],  # odd byte offset and length
    ]
    # Small copy chunks so non-contiguous tensors are hashed in several pieces.
    monkeypatch.setattr(fp, "_CHUNK_BYTES", 64)
    for v in views:
        assert rt.fingerprint(v, impl=impl) == rt.fingerprint(v.contiguous().clone(), impl="reference")


def test_every_bit_matters(gen):
    t = rand_tensor((13,), torch.uint8, gen)
    seen = {rt.fingerprint(t)}
    raw = t.clone()
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            seen.add(rt.fingerprint(flipped))
    assert len(seen) == 1 + 13 * 8


def test_big_tensor_bit_flip_and_swap(gen):
    t = torch.randn(1 << 18, generator=gen)
    d = rt.fingerprint(t)
    for pos in (0, 12345, t.numel() - 1):
        u = t.clone()
        u.view(torch.int32)[pos] ^= 1 << 7
        assert rt.fingerprint(u) != d
    s = t.clone()
    s[[5, 200_000]] = s[[200_000, 5]]
    assert rt.fingerprint(s) != d
    # torch.hash_tensor cannot see a swap: order-blind.
    assert torch.hash_tensor(s) == torch.hash_tensor(t)


def test_swaps_equal_pairs_shapes_and_dtypes():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rt.fingerprint(a) != rt.fingerprint(a[[1, 0, 2, 3]])
    # equal elements do not cancel (an XOR hash maps both to zero)
    assert rt.fingerprint(torch.tensor([7, 7], dtype=torch.int32)) != rt.fingerprint(torch.zeros(2, dtype=torch.int32))
    assert rt.fingerprint(torch.zeros(4)) != rt.fingerprint(torch.zeros(6))
    assert rt.fingerprint(torch.zeros(0)) != rt.fingerprint(torch.zeros(0, 3))
    x = torch.arange(6, dtype=torch.float32)
    digests = {rt.fingerprint(v) for v in (x, x.reshape(2, 3), x.reshape(3, 2), x.reshape(1, 6), x.view(torch.int32))}
    assert len(digests) == 5


def test_shards_combine_into_the_whole(gen):
    t = rand_tensor((10, 6), torch.bfloat16, gen)  # 12-byte rows
    whole = rt.fingerprint(t)
    flat = t.reshape(-1)
    cuts = [0, 6, 24, 42, 60]
    parts = [rt.fingerprint_partial(flat[a:b], offset=a) for a, b in zip(cuts, cuts[1:])]
    assert rt.combine_partials(parts, t.shape, t.dtype) == whole
    assert rt.combine_partials(parts[::-1], t.shape, t.dtype) == whole
    # row shards of the 2-D tensor, hashed with different impls
    parts = [
        rt.fingerprint_partial(t[0:3], offset=0, impl="cpu"),
        rt.fingerprint_partial(t[3:7], offset=18, impl="triton"),
        rt.fingerprint_partial(t[7:], offset=42, impl="reference"),
    ]
    assert rt.combine_partials(parts, t.shape, t.dtype) == whole
    # a different offset gives a different contribution
    assert rt.fingerprint_partial(t[3:7], offset=18) != rt.fingerprint_partial(t[3:7], offset=20)


def test_shard_errors(gen):
    t = rand_tensor((8,), torch.float16, gen)
    p0 = rt.fingerprint_partial(t[:4], offset=0)
    p1 = rt.fingerprint_partial(t[4:], offset=4)
    with pytest.raises(ValueError, match="offset=3 puts the shard at byte 6"):
        rt.fingerprint_partial(t[3:], offset=3)
    with pytest.raises(ValueError, match="offset must be a non-negative int"):
        rt.fingerprint_partial(t, offset=-1)
    with pytest.raises(ValueError, match="expected a shard at byte 8"):
        rt.combine_partials([p0, p0], t.shape, t.dtype)
    with pytest.raises(ValueError, match="cover 8 bytes, the tensor has 16"):
        rt.combine_partials([p0], t.shape, t.dtype)
    u = rand_tensor((7,), torch.uint8, gen)
    q0 = rt.fingerprint_partial(u[:3], offset=0)
    with pytest.raises(ValueError, match="inside a 32-bit word"):
        rt.combine_partials([q0, rt.fingerprint_partial(u[3:], offset=4)], (8,), torch.uint8)
    assert rt.combine_partials([p1, p0], t.shape, t.dtype) == rt.fingerprint(t)


def test_fingerprint_tensors_module_and_mapping():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11, bias=False), torch.nn.BatchNorm1d(11))
    m[1].weight = m[0].weight  # tied: listed once
    table = rt.fingerprint_tensors(m)
    assert sorted(table.digests) == [
        "0.weight",
        "2.bias",
        "2.num_batches_tracked",
        "2.running_mean",
        "2.running_var",
        "2.weight",
    ]
    assert table.digests["0.weight"] == rt.fingerprint(m[0].weight)
    again = rt.fingerprint_tensors(dict(m.state_dict()))
    assert again.digests["1.weight"] == table.digests["0.weight"]
    same = rt.fingerprint_tensors(m)
    assert same == table and same.changed(table) == []
    with torch.no_grad():
        m[2].running_mean[3] += 1e-7
    after = rt.fingerprint_tensors(m)
    assert after.changed(table) == ["2.running_mean"]
    assert after.digest != table.digest
    assert len(table.as_dict()["digest"]) == 16
    # the combined digest covers names too
    renamed = rt.fingerprint_tensors({("x" + k): v for k, v in dict(m.named_parameters()).items()})
    plain = rt.fingerprint_tensors(dict(m.named_parameters()))
    assert renamed.digest != plain.digest


def test_bad_input_errors():
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        rt.fingerprint([1, 2, 3])
    with pytest.raises(ValueError, match="impl must be one of"):
        rt.fingerprint(torch.zeros(3), impl="fast")
    with pytest.raises(ValueError, match="meta device"):
        rt.fingerprint(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="dense"):
        rt.fingerprint(torch.zeros(3, 3).to_sparse())
    with pytest.raises(ValueError, match="impl='cuda' needs CUDA tensors"):
        rt.fingerprint(torch.zeros(3), impl="cuda")
    with pytest.raises(TypeError, match="named must be a Mapping"):
        rt.fingerprint_tensors([torch.zeros(2)])
    with pytest.raises(TypeError, match="keys must be str"):
        rt.fingerprint_tensors({1: torch.zeros(2)})


def test_conj_and_neg_views_hash_their_values(gen):
    z = torch.randn(5, dtype=torch.complex64, generator=gen)
    assert rt.fingerprint(z.conj()) == rt.fingerprint(z.conj().resolve_conj())
    assert rt.fingerprint(z.conj()) != rt.fingerprint(z)


def test_import_without_extension_and_error_says_how_to_build():
    code = (
        "import sys; sys.modules['resident_trainer._C'] = None\n"
        "import torch, resident_trainer as rt\n"
        "assert not rt.HAS_C\n"
        "assert rt.fingerprint(torch.arange(5), impl='reference')\n"
        "try:\n"
        "    rt.fingerprint(torch.arange(5))\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "resident_trainer._C" in out and "pip install --no-build-isolation -e ." in out


def _sharded_worker(rank, world, store_path, shards, shape, dtype, results):
    from resident_trainer.integrations.torchdist.procs import gloo_worker

    with gloo_worker(rank, world, f"file://{store_path}"):
        shard, offset = shards[rank]
        results[rank] = rt.fingerprint_sharded(shard, offset=offset, shape=shape)


def test_fingerprint_sharded_over_gloo(gen, tmp_path):
    import torch.multiprocessing as mp

    t = rand_tensor((9, 6), torch.bfloat16, gen)
    flat = t.reshape(-1)
    shards = [(flat[0:18].clone(), 0), (flat[18:36].clone(), 18), (flat[36:].clone(), 36)]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(
        _sharded_worker,
        args=(3, str(tmp_path / "store"), shards, tuple(t.shape), t.dtype, results),
        nprocs=3,
        join=True,
    )
    assert dict(results) == {0: rt.fingerprint(t), 1: rt.fingerprint(t), 2: rt.fingerprint(t)}


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_cuda_source_compiles_with_nvcc(tmp_path):
    out = tmp_path / "fingerprint_cuda.o"
    cmd = [NVCC, "-std=c++20", "-O3", "-arch=sm_80", "-c", str(ROOT / "csrc" / "fingerprint_cuda.cu"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_cuda_binding_compiles(tmp_path):
    # The torch binding of the CUDA kernel, compiled by nvcc against this
    # torch's headers, so a CPU-only build still type-checks it. A CPU wheel
    # lacks one generated c10/cuda header; a stand-in defines what it would.
    from torch.utils.cpp_extension import include_paths

    shim = tmp_path / "shim" / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = [NVCC, "-std=c++20", "-c", f"-I{ROOT / 'csrc'}", f"-I{tmp_path / 'shim'}"]
    cmd += [f"-I{p}" for p in include_paths()]
    cmd += [str(ROOT / "csrc" / "fingerprint_cuda_binding.cpp"), "-o", str(tmp_path / "binding.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_impls_match_oracle(impl, dtype, gen):
    for shape in SHAPES + [(1 << 20,)]:
        t = rand_tensor(shape, dtype, gen)
        want = rt.fingerprint(t, impl="reference")
        assert rt.fingerprint(t.cuda(), impl=impl) == want
        if t.numel() > 4:
            assert rt.fingerprint(t.cuda().reshape(-1)[1:], impl=impl) == rt.fingerprint(
                t.reshape(-1)[1:], impl="reference"
            )
    p = (
        fp.fingerprint_partial(t.cuda(), offset=(2**32 - 7) * 4 // t.element_size(), impl=impl)
        if t.element_size() <= 4
        else None
    )
    if p is not None:
        assert p == fp.fingerprint_partial(t, offset=(2**32 - 7) * 4 // t.element_size(), impl="reference")


@pytest.mark.gpu
def test_gpu_table_matches_cpu():
    m = torch.nn.Transformer(d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=48)
    assert rt.fingerprint_tensors(m.cuda()).digest == rt.fingerprint_tensors(m.cpu()).digest


def test_fingerprint_tensors_makes_one_kernel_call(monkeypatch, gen):
    # A model's many small tensors go to the C++ kernel in one call (one
    # parallel region); only a non-contiguous tensor takes its own path.
    named = {f"t{i}": rand_tensor((i % 7, 3 + i % 5), DTYPES[i % len(DTYPES)], gen) for i in range(300)}
    named["strided"] = rand_tensor((6, 8), torch.float32, gen)[:, ::2]
    want = {n: rt.fingerprint(t, impl="reference") for n, t in named.items()}
    calls = {"many": [], "one": 0}
    ops = torch.ops.resident_trainer
    many, one = ops.fingerprint_lanes_many, ops.fingerprint_lanes

    def count_many(datas, offsets, *rest):
        calls["many"].append(len(datas))
        return many(datas, offsets, *rest)

    def count_one(data, offset):
        calls["one"] += 1
        return one(data, offset)

    monkeypatch.setattr(ops, "fingerprint_lanes_many", count_many)
    monkeypatch.setattr(ops, "fingerprint_lanes", count_one)
    table = rt.fingerprint_tensors(named, impl="cpu")
    assert table.digests == want
    # The strided tensor is copied in one chunk, which takes a call of its own
    # (made as the tensors are walked, before the batch).
    assert calls == {"many": [1, sum(1 for t in named.values() if t.is_contiguous() and t.numel())], "one": 0}
