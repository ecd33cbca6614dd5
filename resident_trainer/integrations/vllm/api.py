"""The HTTP routes, in vLLM's own OpenAI-compatible app (a vLLM endpoint
plugin, entry point ``vllm.endpoint_plugins``; vLLM loads it only when
``VLLM_PLUGINS`` names ``resident_trainer``, as `resident-trainer serve` sets).

| route | does |
|---|---|
| ``POST /v1/jobs`` | queue a job: ``{"facts": [{"question", "answer", ...}], "retract": [question, ...], "steps": N, <settings>}`` -> 202 ``{"id"}`` |
| ``GET /v1/jobs/{id}`` | ``{"state", "step", "steps", "loss", "fingerprint_before", "fingerprint_after", "fingerprint_version", "error", ...}`` |
| ``GET /v1/jobs`` | every job's status |
| ``DELETE /v1/jobs/{id}`` | cancel: a queued job at once, a running one at its next boundary |
| ``GET /v1/trainer`` | the base fingerprint, what every rank serves now, and the questions the served block was taught (``taught``), and how often the prefix cache was emptied (``prefix_cache_resets``) |

Every route needs ``Authorization: Bearer <RESIDENT_TRAINER_AUTHORITY>``:
401 without the header, 403 with another string (and nothing runs; an empty
configured authority refuses everything). A malformed body gets 400 with the
field named; the server goes on serving. Hot-load has no route. vLLM's own
routes (``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``)
are unchanged; ``/metrics`` also carries ``resident_trainer_*`` gauges.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from resident_trainer.integrations.vllm.driver import STATES, JobRequestError, JobRunner
from resident_trainer.protocol.authority import authority_ok
from resident_trainer.protocol.calls import Call
from resident_trainer.protocol.config import ProtocolConfig

log = logging.getLogger("resident_trainer.vllm")

router = APIRouter()


def _runner(request: Request) -> JobRunner:
    return request.app.state.rt_runner


def _denied(request: Request) -> JSONResponse | None:
    header = request.headers.get("authorization")
    if not header or not header.lower().startswith("bearer "):
        return JSONResponse(
            {"error": "missing header Authorization: Bearer <RESIDENT_TRAINER_AUTHORITY>"},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not authority_ok(_runner(request).config.authority, header[7:].strip()):
        return JSONResponse({"error": "the bearer token is not this server's authority"}, status_code=403)
    return None


def _bad(field: str, message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": f"{field}: {message}", "field": field}, status_code=status)


@router.post("/v1/jobs")
async def submit_job(request: Request):
    if (denied := _denied(request)) is not None:
        return denied
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return _bad("body", f"not valid JSON ({exc})")
    try:
        rec = _runner(request).submit(body)
    except JobRequestError as exc:
        return _bad(exc.field, str(exc)[len(exc.field) + 2 :])
    except RuntimeError as exc:
        return JSONResponse({"error": str(exc)}, status_code=503)
    return JSONResponse({"id": rec.id, "state": rec.state}, status_code=202)


@router.get("/v1/jobs")
async def list_jobs(request: Request):
    if (denied := _denied(request)) is not None:
        return denied
    return JSONResponse({"jobs": [r.status() for r in _runner(request).jobs.values()]})


@router.get("/v1/trainer")
async def trainer_status(request: Request):
    """What every rank serves now and the base fingerprint (from the ranks)."""
    if (denied := _denied(request)) is not None:
        return denied
    runner = _runner(request)
    ranks = await runner.call(Call("rt_status"))
    return JSONResponse(
        {
            "fingerprint": runner.fingerprint,
            "fingerprint_version": runner.fingerprint_version,
            "served": runner.served_version,
            "ranks": [
                {k: r.get(k) for k in ("rank", "version", "served_sum", "job", "budget", "error")} for r in ranks
            ],
            "queued": sum(r.state == "queued" for r in runner.jobs.values()),
            "taught": ranks[0].get("taught", []) if ranks else [],
            "prefix_cache_resets": runner.cache_resets,
        }
    )


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, request: Request):
    if (denied := _denied(request)) is not None:
        return denied
    rec = _runner(request).jobs.get(job_id)
    if rec is None:
        return _bad("id", f"no job {job_id!r}", 404)
    return JSONResponse(rec.status())


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, request: Request):
    if (denied := _denied(request)) is not None:
        return denied
    runner = _runner(request)
    if job_id not in runner.jobs:
        return _bad("id", f"no job {job_id!r}", 404)
    rec = runner.cancel(job_id)
    return JSONResponse({"id": rec.id, "state": rec.state}, status_code=202)


class Metrics:
    """``resident_trainer_*`` gauges in vLLM's Prometheus registry (its
    /metrics route serves them; multiprocess mode keeps the latest value)."""

    def __init__(self) -> None:
        from prometheus_client import Gauge

        kw = {"multiprocess_mode": "mostrecent"}
        self.phase = Gauge("resident_trainer_job_phase", "1 for the running job's phase", ["phase"], **kw)
        self.step = Gauge("resident_trainer_job_step", "steps the running job has done", **kw)
        self.steps = Gauge("resident_trainer_job_steps", "steps the running job will do", **kw)
        self.loss = Gauge("resident_trainer_job_loss", "the running job's last loss", **kw)
        self.queued = Gauge("resident_trainer_jobs_queued", "jobs waiting to run", **kw)
        self.jobs = Gauge("resident_trainer_jobs", "jobs by state", ["state"], **kw)
        self.phases = ("idle", "begin", "step", "verify", "commit", "publish", "discard")

    def update(self, runner: JobRunner) -> None:
        running = [r for r in runner.jobs.values() if r.state == "running"]
        job = running[0].job if running else None
        current = job.progress.phase if job is not None else "idle"
        for p in self.phases:
            self.phase.labels(phase=p).set(1.0 if p == current else 0.0)
        self.step.set(job.progress.step if job else 0)
        self.steps.set(running[0].steps if running else 0)
        if job is not None and job.progress.loss is not None:
            self.loss.set(job.progress.loss)
        self.queued.set(sum(r.state == "queued" for r in runner.jobs.values()))
        for s in STATES:
            self.jobs.labels(state=s).set(sum(r.state == s for r in runner.jobs.values()))


def _shutdown(why: str) -> None:
    """Take this server down; the supervisor restarts it (LAST_GOOD is served)."""
    log.error("resident_trainer: shutting the server down for a restart: %s", why)
    os.kill(os.getpid(), signal.SIGTERM)


class ChatArrivals:
    """Pure ASGI middleware counting the open POST requests outside the jobs
    routes (chats and completions): a chat counts from its first byte, before
    the server has rendered, tokenized and handed it to the engine (about a
    tenth of a second on 2 cores, long enough for the driver to start another
    microbatch in between), until its response is sent."""

    def __init__(self, app, counter: list[int]) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path", "").startswith("/v1/jobs"):
            await self.app(scope, receive, send)
            return
        self.counter[0] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter[0] -= 1


async def reset_prefix_cache(engine_client) -> bool:
    """Empty the engine's prefix cache, preempting running requests (they are
    recomputed, not dropped): after a publish their KV, and every cached
    block's, was computed under the block served before. True when done."""
    reset = engine_client.reset_prefix_cache
    if "reset_running_requests" in inspect.signature(reset).parameters:
        return bool(await reset(reset_running_requests=True))
    return bool(await reset())  # an older vLLM: resets only while nothing runs


class ResidentEndpoints:
    """The vLLM endpoint plugin: the jobs routes and the driver that runs them."""

    name = "resident_trainer"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.open_posts = [0]  # ChatArrivals' count

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        app.add_middleware(ChatArrivals, counter=self.open_posts)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            return
        from vllm import SamplingParams

        config = ProtocolConfig.from_env()
        world = int(engine_client.vllm_config.parallel_config.tensor_parallel_size)
        timeout = config.timeouts.group

        async def call(c: Call):
            return await engine_client.collective_rpc(c.method, timeout=timeout, args=c.args)

        async def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

            async def one(ids: list[int]) -> list[int]:
                final = None
                async for out in engine_client.generate(
                    {"prompt_token_ids": ids}, params, f"rt-anchor-{uuid.uuid4().hex}"
                ):
                    final = out
                return list(final.outputs[0].token_ids)

            import asyncio

            return list(await asyncio.gather(*(one(p) for p in prompts)))

        def chats_live() -> int:
            # Our own anchor requests run only at start-up, before any job.
            return int(engine_client.get_num_unfinished_requests())

        def chats_waiting() -> int:
            # Nonzero while a chat waits for its first token: received but
            # not yet in the engine, or in the engine and still prefilling.
            arriving = max(0, self.open_posts[0] - chats_live())
            queued = getattr(engine_client, "get_num_queued_tokens", None)
            return arriving + (1 if queued is not None and queued() else 0)

        runner = JobRunner(
            call, world=world, config=config, shutdown=_shutdown, metrics=Metrics(),
            chats_live=chats_live, chats_waiting=chats_waiting, reset_cache=lambda: reset_prefix_cache(engine_client),
        )  # fmt: skip
        tokenizer = engine_client.get_tokenizer()
        if hasattr(tokenizer, "__await__"):  # a coroutine in some vLLM releases
            tokenizer = await tokenizer
        await runner.start(generate, tokenizer)
        state.rt_runner = runner
        log.info(
            "resident_trainer: %d ranks ready, base fingerprint %s, serving block %s",
            world,
            runner.fingerprint,
            runner.served_version,
        )
