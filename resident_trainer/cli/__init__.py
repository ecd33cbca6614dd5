"""Command line: `resident-trainer <command>` (or `python -m resident_trainer.cli`).

Commands (one module each):
  demo         fingerprint SmolLM2-135M's weights and benchmark the kernel
  teach        teach facts to SmolLM2-135M here, or to a running server
  serve        serve a model with vLLM; it learns through POST /v1/jobs
  fingerprint  fingerprint the tensors of .safetensors files
"""

from __future__ import annotations

import argparse

from resident_trainer.cli import demo, fingerprint, serve, teach
from resident_trainer.cli._common import Parser, bad


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="resident-trainer",
        description="Train added shared-expert neurons inside a live LLM server; kernels and tools.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="command", parser_class=Parser)
    for module in (demo, teach, serve, fingerprint):
        module.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "repeats", 1) < 1:
        return bad(args.command, f"--repeats must be at least 1, got {args.repeats}")
    return args.func(args)


__all__ = ["build_parser", "main"]
