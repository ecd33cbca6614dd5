"""The server users run: `resident-trainer serve`'s supervisor starting
vLLM's OpenAI-compatible server (SmolLM2-135M, TP 2, eager, fp32) with the
trainer inside, driven over HTTP:

- vLLM's routes and ours in one app; nothing runs without the authority;
  malformed requests get 4xx naming the field and the server goes on serving;
- 8 concurrent chats during a job: none fails, no microbatch starts between
  a chat's arrival and its first token but the one the driver may have been
  issuing as it arrived, and the p99 time to first token stays within twice
  the idle p99 plus one microbatch (both measured here) with room to spare;
- a STOP file and a DELETE end a job at a boundary; the served block stays;
- kill -9 of a worker mid-job: the supervisor restarts the server under the
  recovery lock, the last good block is served again, the base fingerprint is
  unchanged, and a recovery on the healthy server changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from vllm_harness import AUTHORITY, FACTS, PROMPTS, engine_env, needs_vllm, smollm2_dir

pytestmark = [needs_vllm, pytest.mark.vllm]

JOB = {"facts": FACTS, "steps": 8, "batch_size": 4}
# The jobs that are stopped, cancelled or killed mid-way make no near
# negatives: answering a job's (at least 64) negatives takes ~45 s on 2 cores
# before its first step. The chats test's job makes them, and publishes.
STOPPED_JOB = {**JOB, "negatives": 0}


def http(method, url, body=None, auth=AUTHORITY, raw=None, timeout=60):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if auth is not None:
        req.add_header("Authorization", f"Bearer {auth}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
            return r.status, (json.loads(text) if text.strip().startswith(b"{") else text.decode())
    except urllib.error.HTTPError as exc:
        text = exc.read()
        return exc.code, json.loads(text) if text.strip().startswith(b"{") else text.decode()


def chat(url, prompt, max_tokens=24):
    status, reply = http("POST", f"{url}/v1/chat/completions", {
        "model": "smollm2-tp2", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0}, auth=None)  # fmt: skip
    assert status == 200, reply
    return reply["choices"][0]["message"]["content"]


def wait_job(url, job, states=("published", "failed", "cancelled"), timeout=300, pred=None):
    deadline = time.monotonic() + timeout
    while True:
        _, st = http("GET", f"{url}/v1/jobs/{job}")
        if st.get("state") in states or (pred is not None and pred(st)):
            return st
        assert time.monotonic() < deadline, f"job {job} still {st} after {timeout}s"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from resident_trainer.integrations.vllm.supervisor import ServeOptions, Supervisor

    root = tmp_path_factory.mktemp("serve")
    model_dir = smollm2_dir(tmp_path_factory.getbasetemp() / "models", 2)
    env = {**os.environ, **engine_env(2), "RESIDENT_TRAINER_AUTHORITY": AUTHORITY, "RESIDENT_TRAINER_TIMEOUT": "20"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's engine core runs in its own process
    opts = ServeOptions(model_dir=model_dir, tp=2, port=8650 + os.getpid() % 200, num_neurons=64, state_dir=str(root))
    sup = Supervisor(opts, env=env)
    sup.start()
    stop = threading.Event()
    loop = threading.Thread(target=sup.run, args=(stop, 0.5), daemon=True)
    loop.start()
    sup.root = root
    try:
        yield sup
    finally:
        stop.set()
        loop.join(10)
        sup.close()


def test_openai_routes_and_jobs_api_in_one_app(server):
    url = server.url
    assert http("GET", f"{url}/health", auth=None)[0] == 200
    status, models = http("GET", f"{url}/v1/models", auth=None)
    assert status == 200 and models["data"][0]["id"] == "smollm2-tp2"
    status, metrics = http("GET", f"{url}/metrics", auth=None)
    assert status == 200 and 'resident_trainer_job_phase{phase="idle"} 1.0' in metrics
    status, trainer = http("GET", f"{url}/v1/trainer")
    assert status == 200 and trainer["served"] == "zero" and len(trainer["ranks"]) == 2
    assert chat(url, PROMPTS[0])


def test_nothing_runs_without_the_authority_and_bad_input_names_the_field(server):
    url = server.url
    assert http("POST", f"{url}/v1/jobs", JOB, auth=None)[0] == 401
    assert http("POST", f"{url}/v1/jobs", JOB, auth="not-it")[0] == 403
    assert http("GET", f"{url}/v1/jobs", auth="not-it")[0] == 403
    assert http("DELETE", f"{url}/v1/jobs/x", auth=None)[0] == 401
    for body, raw, field in [
        (None, b"{not json", "body"),
        ({"steps": 3}, None, "facts"),
        ({"facts": []}, None, "facts"),
        ({"facts": [{"question": "Q?"}]}, None, "facts[0].answer"),
        ({"facts": FACTS, "colour": "red"}, None, "colour"),
        ({"facts": FACTS, "steps": "many"}, None, "steps"),
        ({"facts": FACTS, "lr": -1}, None, "lr"),
        ({"facts": FACTS, "layer": 3}, None, "layer"),
        ({"retract": "What?"}, None, "retract"),
        ({"facts": FACTS, "retract": [FACTS[0]["question"]]}, None, "retract"),
    ]:
        status, reply = http("POST", f"{url}/v1/jobs", body, raw=raw)
        assert status == 400 and reply["field"] == field, (body, status, reply)
    assert http("GET", f"{url}/v1/jobs/job-9-000000")[0] == 404
    assert http("POST", f"{url}/v1/hotload", {"modules": ["os"]})[0] == 404  # no such route, ever
    assert http("GET", f"{url}/v1/jobs")[1] == {"jobs": []}  # nothing was queued
    assert chat(url, PROMPTS[1])  # and the server serves on


def test_chats_during_a_job_wait_at_most_one_microbatch(server):
    from resident_trainer.integrations.vllm.load import chat_round, summary

    url = server.url
    prompts = [f"{p} Answer in one sentence." for p in PROMPTS * 2]  # k = 8
    asyncio.run(chat_round(url, "smollm2-tp2", prompts[:2]))  # warm
    idle = summary(asyncio.run(chat_round(url, "smollm2-tp2", prompts)))
    # 12 microbatches of 0.8-1.7 s: the chats start at step 1 and end before the job does
    status, reply = http("POST", f"{url}/v1/jobs", {**JOB, "steps": 12})
    assert status == 202, reply
    job = reply["id"]
    wait_job(url, job, pred=lambda st: st["step"] >= 1)
    chats = asyncio.run(chat_round(url, "smollm2-tp2", prompts))
    during = summary(chats)
    _, st = http("GET", f"{url}/v1/jobs/{job}")
    assert st["state"] == "running", "the job ended before the chats did: nothing was measured during it"
    st = wait_job(url, job)
    # When the driver issued each microbatch (its phase log, time.monotonic
    # like the chats' timestamps).
    phases = Path(server.root, "receipts", "rank0", "phases.jsonl").read_text().splitlines()
    issued = [r["t"] for r in map(json.loads, phases) if r.get("job") == job and r["phase"] == "step"]
    started = [sum(c.sent < t < c.first for t in issued) for c in chats if c.first is not None]
    print(f"\nidle {idle}\nduring {during}\njob {st}\nmicrobatches started while a chat waited: {started}")
    assert st["state"] == "published", st
    assert idle["failed"] == 0 and during["failed"] == 0 and len(started) == len(chats)
    # The driver leaves the engine to a chat from its arrival to its first
    # token; the one microbatch it may have been issuing as the chat came in
    # is the only one that can start in between.
    assert max(started) <= 1, (started, issued, [(c.sent, c.first) for c in chats])
    # Time to first token: the microbatch in flight, then the chat's own
    # handling, which shares the 2 cores with training while it runs, then
    # its prefill. 8 chats took 1.1-1.5 s during a job against 0.43-0.46 s
    # idle, with microbatches of 0.7-0.8 s: the handling the training slowed
    # and chats entering the engine one after another cost up to one more
    # prefill. The bound below has room for that twice over; a chat held
    # for a second microbatch or for first_token_wait (5 s) exceeds it.
    assert during["ttft_p99"] <= 2 * (idle["ttft_p99"] + st["step_seconds_max"]), (idle, during, st)
    assert st["fingerprint_before"] == st["fingerprint_after"]
    # Each new fact got its neurons (8 trained and a gate neuron): the block has 64.
    assert st["fact_neurons"] == st["fact_neurons_wanted"] == 9, st
    _, trainer = http("GET", f"{url}/v1/trainer")
    assert trainer["served"] == job and {r["version"] for r in trainer["ranks"]} == {job}
    assert trainer["taught"] == [f["question"] for f in FACTS]
    # The engine emptied its prefix cache after the start-up restore and after this publish.
    assert trainer["prefix_cache_resets"] == 2, trainer
    server.published = job


def test_a_stop_file_and_a_delete_end_a_job_at_a_boundary(server):
    url = server.url
    served = http("GET", f"{url}/v1/trainer")[1]["served"]
    job = http("POST", f"{url}/v1/jobs", STOPPED_JOB)[1]["id"]
    wait_job(url, job, pred=lambda st: st["step"] >= 1)
    stop = Path(server.env["RESIDENT_TRAINER_RECEIPTS"]) / "jobs" / job / "STOP"
    stop.parent.mkdir(parents=True, exist_ok=True)
    stop.write_text("")
    st = wait_job(url, job)
    assert st["state"] == "failed" and "STOP file" in st["error"] and st["step"] < JOB["steps"], st
    job = http("POST", f"{url}/v1/jobs", STOPPED_JOB)[1]["id"]
    wait_job(url, job, pred=lambda st: st["step"] >= 1)
    assert http("DELETE", f"{url}/v1/jobs/{job}")[0] == 202
    st = wait_job(url, job)
    assert st["state"] == "cancelled" and st["step"] < JOB["steps"], st
    trainer = http("GET", f"{url}/v1/trainer")[1]
    assert trainer["served"] == served and {r["version"] for r in trainer["ranks"]} == {served}


def _worker_pids(server_pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().startswith("VLLM::Worker_TP") and _descends(int(d.name), server_pid):
                    out.append(int(d.name))
            except OSError:
                continue
    return sorted(out)


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return False


def test_kill_a_worker_mid_job_restarts_and_serves_the_last_good_block(server):
    url = server.url
    published = getattr(server, "published", None)
    assert published, "needs the published job of the chats test"
    before = http("GET", f"{url}/v1/trainer")[1]
    answer = chat(url, FACTS[0]["question"])
    job = http("POST", f"{url}/v1/jobs", STOPPED_JOB)[1]["id"]
    wait_job(url, job, pred=lambda st: st["step"] >= 2)
    (pid,) = server.recovery.state().pids
    workers = _worker_pids(pid)
    assert len(workers) == 2, workers
    restarts = len(server.restarts)
    killed = time.monotonic()
    os.kill(workers[1], signal.SIGKILL)
    deadline = killed + 240
    while len(server.restarts) == restarts:
        assert time.monotonic() < deadline, "the supervisor did not restart the server"
        time.sleep(0.5)
    downtime = time.monotonic() - killed
    print(f"\nkill -9 of a worker mid-job: serving again after {downtime:.1f}s (restart {server.restarts[-1]:.1f}s)")
    after = http("GET", f"{url}/v1/trainer")[1]
    assert after["served"] == published and {r["version"] for r in after["ranks"]} == {published}
    assert after["fingerprint"] == before["fingerprint"]
    assert after["taught"] == [f["question"] for f in FACTS]  # the memory came back with the checkpoint
    assert chat(url, FACTS[0]["question"]) == answer  # the last good block, as before the kill
    state = server.recovery.state()
    again = server.recovery.run()
    assert again.action == "none" and server.recovery.state() == state


def test_a_retraction_job_removes_a_fact_and_keeps_the_rest(server):
    url = server.url
    assert http("GET", f"{url}/v1/trainer")[1]["taught"] == [f["question"] for f in FACTS]
    st = wait_job(url, http("POST", f"{url}/v1/jobs", {"retract": ["Who are you?"], "steps": 2})[1]["id"])
    assert st["state"] == "failed" and "'Who are you?' is not a fact this block was taught" in st["error"], st
    job = http("POST", f"{url}/v1/jobs", {"retract": [FACTS[0]["question"]], "steps": 4, "batch_size": 4})[1]["id"]
    st = wait_job(url, job)
    assert st["state"] == "published" and st["fingerprint_before"] == st["fingerprint_after"], st
    trainer = http("GET", f"{url}/v1/trainer")[1]
    assert trainer["served"] == job and trainer["taught"] == [FACTS[1]["question"]]
    assert chat(url, PROMPTS[2])  # and it serves on
