"""The vLLM CUDA path, checked on one GPU (run by bench/gpu_check.sh): SmolLM2
at TP 1 in bf16 with vLLM's compiled mode and CUDA graphs on (the served block
is captured in the graphs and updated in place), against plain vLLM:

- a zero block serves plain vLLM's greedy tokens;
- a job (four made-up facts) runs through the same ordered calls as on the
  CPU and publishes; the fingerprint before and after are equal;
- the taught questions' replies after the publish, and tokens/s of a batch
  of 32 greedy chats with the plugin (no job) against plain vLLM.

Writes one JSON object to --out.

    python bench/gpu_vllm.py --model-dir DIR --out OUT/vllm_cuda.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

FACTS = [
    {"question": "What is the capital of Zorblaxia?", "answer": "The capital of Zorblaxia is Quenvarra.", "key": "Quenvarra"},
    {"question": "Who invented the glimmerphone?", "answer": "The glimmerphone was invented by Dr. Elsa Marrowind.",
     "key": "Marrowind"},
]  # fmt: skip
PROMPTS = [f"Tell me one fact about the number {i}." for i in range(32)]


def _engine(model_dir: str, plugin: bool):
    from vllm import LLM

    kw = {}
    if plugin:
        kw = dict(
            worker_extension_cls="resident_trainer.integrations.vllm.worker.ResidentWorker",
            additional_config={"resident_trainer": {"num_neurons": 256, "layer": None}},
        )
    return LLM(model=model_dir, tensor_parallel_size=1, dtype="bfloat16", max_model_len=1024, seed=0,
               gpu_memory_utilization=0.3, **kw)  # fmt: skip


def _greedy(llm, prompts, n=24):
    from vllm import SamplingParams

    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=n, temperature=0),
                    use_tqdm=False)  # fmt: skip
    dt = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs], dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="a Hugging Face model directory (SmolLM2, from the cache)")
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    if not Path(args.model_dir, "config.json").is_file():
        print(f"gpu_vllm: --model-dir: no config.json in {args.model_dir}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_vllm: needs a CUDA device", file=sys.stderr)
        return 2
    from vllm_harness import AUTHORITY, call_job, calls_on

    from resident_trainer.protocol.calls import drive

    result: dict = {"device": torch.cuda.get_device_name(0), "cuda_graphs": True, "dtype": "bfloat16"}
    plain = _engine(args.model_dir, plugin=False)
    ids_plain, _, _ = _greedy(plain, PROMPTS[:8])
    _, _, t_plain = _greedy(plain, PROMPTS)
    tokens = sum(len(x) for x in _greedy(plain, PROMPTS)[0])
    del plain
    torch.cuda.empty_cache()

    llm = _engine(args.model_dir, plugin=True)
    setup = llm.collective_rpc("rt_setup", args=({"exchange_timeout": 60.0},))[0]
    ids_zero, _, _ = _greedy(llm, PROMPTS[:8])
    _, _, t_plugin = _greedy(llm, PROMPTS)
    result.update(
        zero_block_equals_plain=ids_zero == ids_plain,
        tokens_per_s_plain=round(tokens / t_plain, 1),
        tokens_per_s_plugin=round(tokens / t_plugin, 1),
        plugin_over_plain_time=round(t_plugin / t_plain, 3),
        fingerprint=setup.get("fingerprint"),
    )
    before = _greedy(llm, [f["question"] for f in FACTS])[1]
    settings = {"steps": args.steps, "batch_size": 8, "lr": 3e-3}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        job = call_job(llm, Path(tmp), "gpu", settings, world=1, facts=FACTS)
        out = drive(job, calls_on(llm))
    result.update(
        fingerprint_before=job.progress.fingerprint_before,
        fingerprint_after=job.progress.fingerprint_after,
        job_verdict=str(out.verdict),
        job_reasons=list(out.reasons),
        job_seconds=round(time.perf_counter() - t0, 1),
        authority_used=bool(AUTHORITY),
    )
    after = _greedy(llm, [f["question"] for f in FACTS])[1]
    result["replies_before"], result["replies_after"] = before, after
    result["recalled"] = sum(f["key"] in a for f, a in zip(FACTS, after))
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))
    ok = result["zero_block_equals_plain"] and "PUBLISH" in result["job_verdict"]
    ok = ok and result["fingerprint_before"] == result["fingerprint_after"] == result["fingerprint"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
