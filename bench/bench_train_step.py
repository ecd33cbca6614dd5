"""One training microbatch on SmolLM2-135M with an added block of 256 neurons
at layer 15 (of 30): ours vs plain autograd through the whole model, peak
memory above the loaded model and step time, both measured in one run.

Providers:
- ours: ``LayerReplay`` (prefix without grad, suffix without grad keeping its
  boundary states, backward replaying the suffix one layer at a time) with
  ``StreamedCrossEntropy`` (vocabulary-tiled loss over the model's tied head)
  and the fused added-expert op;
- ours, bf16 suffix: the same with ``suffix_dtype=torch.bfloat16`` (the
  layers after the block compute in bf16 under autocast, in the first pass
  and the replay; ``TrainConfig.suffix_dtype``): its loss and gradients
  within bf16's rounding of the fp32 ones (checked before timing);
- plain autograd (the reference): the Hugging Face model's own forward with
  ``labels`` (logits materialized, the loss in fp32) and ``.backward()``, the
  block running as plain torch autograd; autograd keeps every activation
  from layer 15 on, since only the block requires grad.

Both compute the same loss and the same gradients (checked before timing).
Microbatch: 8 sequences of 128 tokens, every position a target.

Peak memory: the resident set's high-water mark during one step above what was
resident before it (model, block, optimizer state and inputs loaded), each
provider in a fresh process after a warm-up step; see bench/_memory.py.
Goals (docs/RESULTS.md): ours at most 15% of plain autograd's extra memory and
at most 1.4x its time (the replay runs the suffix forward twice: about 1.33x
is the floor at a middle layer when the loss costs the same).

    pytest bench/bench_train_step.py -s
    RT_BENCH_STEP_LAYER=5 pytest bench/bench_train_step.py -s   # another layer
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _memory import peak_bytes_of

LAYER = int(os.environ.get("RT_BENCH_STEP_LAYER", "15"))
NEURONS = 256
BATCH, SEQ = 8, 128
ROUNDS = 3
PROVIDERS = ("ours", "ours, bf16 suffix", "plain autograd (reference)")


def setup():
    """(model, adapter, block, ids, targets, step functions by provider)."""
    import torch.nn.functional as F

    from resident_trainer.models import DecoderAdapter, load_smollm2
    from resident_trainer.train import AddedSharedNeurons, LayerReplay, StreamedCrossEntropy

    model, _ = load_smollm2()
    for p in model.parameters():
        p.requires_grad_(False)
    a = DecoderAdapter(model)
    block = AddedSharedNeurons(a.hidden_size, NEURONS, seed=0)
    with torch.no_grad():  # a trained-looking block: nonzero down projection
        block.w_down.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    block.attach(a, LAYER)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab_size, (BATCH, SEQ + 1), generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    loss_fn = StreamedCrossEntropy(a)
    replay = LayerReplay(a, LAYER)
    replay_bf16 = LayerReplay(a, LAYER, suffix_dtype=torch.bfloat16)

    def zero():
        block.w_gate_up.grad = block.w_down.grad = None

    def ours():
        zero()
        block.impl = "auto"
        with block.training_weights():
            return replay.step(inputs, lambda h: loss_fn(h, targets)).loss

    def ours_bf16():
        zero()
        block.impl = "auto"
        with block.training_weights():
            return replay_bf16.step(inputs, lambda h: loss_fn(h, targets)).loss

    def plain():
        zero()
        block.impl = "reference"
        with block.training_weights():
            logits = model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
        return loss.detach()

    return block, {"ours": ours, "ours, bf16 suffix": ours_bf16, "plain autograd (reference)": plain}


def measure_peak_mib(provider: str) -> float:
    torch.set_num_threads(int(os.environ.get("RT_BENCH_THREADS", torch.get_num_threads())))
    _, steps = setup()
    steps[provider]()  # warm-up
    return peak_bytes_of(steps[provider]) / 2**20


def _peak_in_subprocess(provider: str):
    cmd = [sys.executable, __file__, "--peak", provider]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    return round(json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_mib"], 1)


@pytest.fixture(scope="module")
def prepared():
    pytest.importorskip("transformers")
    block, steps = setup()
    # Same loss and gradients before anything is timed.
    got = {}
    for name, fn in steps.items():
        loss = fn()
        got[name] = (loss, block.w_gate_up.grad.clone(), block.w_down.grad.clone())
    (l1, g1, d1), (lb, gb, db), (l2, g2, d2) = got.values()
    assert torch.allclose(l1, l2, rtol=1e-5), (l1, l2)
    for x, y in ((g1, g2), (d1, d2)):
        assert (x - y).abs().max() <= 1e-4 * y.abs().max(), (x - y).abs().max()
    assert torch.allclose(lb, l2, rtol=1e-2), (lb, l2)
    for x, y in ((gb, g2), (db, d2)):
        rel = ((x - y).norm() / y.norm()).item()
        print(f"bf16 suffix: gradient's relative distance from fp32 {rel:.2e}")
        assert rel <= 5e-2, rel
    return steps


@pytest.mark.parametrize("provider", PROVIDERS)
def test_train_step(benchmark, prepared, provider):
    benchmark.group = f"SmolLM2-135M train step, {BATCH}x{SEQ} tokens, {NEURONS} neurons at layer {LAYER}, fp32 cpu"
    benchmark.extra_info.update(provider=provider, reference=provider == PROVIDERS[-1])
    benchmark.extra_info["peak_extra_MiB"] = _peak_in_subprocess(provider)
    benchmark.pedantic(prepared[provider], rounds=ROUNDS, warmup_rounds=1)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--peak":
    print(json.dumps({"peak_extra_mib": measure_peak_mib(sys.argv[2])}))
