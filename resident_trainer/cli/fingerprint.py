"""`resident-trainer fingerprint FILE.safetensors ...`: the digests the
trainer records, of tensors on disk."""

from __future__ import annotations

import argparse
import os

from resident_trainer.cli._common import bad


def add_parser(sub) -> None:
    f = sub.add_parser(
        "fingerprint",
        help="fingerprint the tensors of .safetensors files",
        description="Print the combined 64-bit fingerprint of each .safetensors file "
        "(per tensor with -v), after a first line naming the fingerprint definition's version. "
        "Identical to what the trainer records in its receipts, and to what a server reports for the "
        "model it serves from that file, when those record the same version.",
    )
    f.add_argument("files", nargs="+", help=".safetensors files")
    f.add_argument("-v", "--verbose", action="store_true", help="also print every tensor's digest")
    f.set_defaults(func=cmd_fingerprint)


def cmd_fingerprint(args: argparse.Namespace) -> int:
    from resident_trainer import FINGERPRINT_VERSION, fingerprint_tensors

    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        return bad("fingerprint", "reading .safetensors files needs safetensors: pip install safetensors")
    # Every file is opened (its header parsed) before any is hashed.
    for path in args.files:
        if os.path.isdir(path):
            return bad("fingerprint", f"{path}: is a directory, not a .safetensors file")
        if not os.path.exists(path):
            return bad("fingerprint", f"{path}: no such file")
        try:
            with safe_open(path, framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            return bad("fingerprint", f"{path}: not a readable .safetensors file ({exc})")
    # Digests of different definition versions are unrelated: say which this is.
    print(f"# fingerprint definition version {FINGERPRINT_VERSION}")
    for path in args.files:
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        table = fingerprint_tensors(tensors)
        print(f"{table.hex}  {path}")
        if args.verbose:
            for name in sorted(table.digests):
                print(f"  {table.digests[name]:016x}  {name}")
    return 0
