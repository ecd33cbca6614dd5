"""A bounded chat load on an OpenAI-compatible server: concurrent streaming
chats, each timed from the request to its first token (TTFT) and between
tokens (ITL). Used by the demo, the serving tests and the serving benchmark.
Loopback only by default; the count and the tokens of every round are fixed."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class ChatResult:
    prompt: str
    ok: bool
    text: str = ""
    ttft: float | None = None  # seconds from the request to the first token
    itl: list[float] = field(default_factory=list)  # seconds between tokens
    tokens: int = 0
    seconds: float = 0.0
    error: str | None = None
    sent: float = 0.0  # time.monotonic() when the request went out
    first: float | None = None  # time.monotonic() at its first token


async def _one(client, url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> ChatResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    out = ChatResult(prompt, ok=False, sent=time.monotonic())
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                delta = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
                if not delta:
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft, out.first = now - t0, time.monotonic()
                else:
                    out.itl.append(now - last)
                last = now
                out.text += delta
                out.tokens += 1
        out.ok = out.ttft is not None
        if not out.ok:
            out.error = "no token streamed"
    except Exception as exc:  # a failed request is a result, not a crash of the load
        out.error = f"{type(exc).__name__}: {exc}"
    out.seconds = time.perf_counter() - t0
    return out


async def chat_round(
    url: str, model: str, prompts: list[str], *, max_tokens: int = 16, timeout: float = 120.0
) -> list[ChatResult]:
    """Send every prompt at once as a streaming chat; wait for all."""
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts) + 2)) as client:
        return list(await asyncio.gather(*(_one(client, url, model, p, max_tokens, timeout) for p in prompts)))


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(results: list[ChatResult], seconds: float | None = None) -> dict:
    """Failed requests and TTFT / ITL p50 and p99 (seconds) of some rounds;
    tokens_per_s over `seconds` of wall time (default: the slowest request,
    the wall time of a single round)."""
    ttft = [r.ttft for r in results if r.ttft is not None]
    itl = [x for r in results for x in r.itl]
    return {
        "requests": len(results),
        "failed": sum(not r.ok for r in results),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "tokens": sum(r.tokens for r in results),
        "tokens_per_s": sum(r.tokens for r in results)
        / max(seconds if seconds is not None else max((r.seconds for r in results), default=0.0), 1e-9),
        "mean_ttft": statistics.fmean(ttft) if ttft else None,
    }
