"""The trainer on toy models: it learns, publishes only at a job's end, never
changes the base, aborts on NaN keeping the last good weights, checkpoints
atomically and resumes to the same next loss, and gates itself off on anchors."""

import os

import pytest
import torch

from resident_trainer.models import DecoderAdapter
from resident_trainer.models.toy import ByteTokenizer, toy_model
from resident_trainer.ops.fingerprint import FINGERPRINT_VERSION, fingerprint_tensors
from resident_trainer.train import (
    AddedSharedNeurons,
    Fact,
    TrainConfig,
    Trainer,
    TrainingAborted,
    example_ids,
    generate_greedy,
    generate_greedy_batch_ids,
    generate_greedy_ids,
    load_checkpoint,
    make_anchors,
    read_checkpoint,
    rewordings,
    save_checkpoint,
)

FACTS = [Fact("Capital of Zorb?", "Quen."), Fact("Who made glim?", "Elsa.")]
ANCHORS = [("Hello there?", "Hi, how are you?"), ("Count to three.", "One, two, three."), ("Sky color?", "Blue.")]


def setup(arch="llama", anchors=(), seed=0, **cfg):
    model = toy_model(arch, layers=4, hidden=32, seed=seed)
    a = DecoderAdapter(model)
    config = TrainConfig(
        **{
            "layer": 1,
            "num_neurons": 32,
            "steps": 40,
            "lr": 3e-2,
            "batch_size": 4,
            "rewordings": 2,
            "init": "random",
            **cfg,
        }
    )
    block = AddedSharedNeurons(a.hidden_size, config.num_neurons, seed=config.seed)
    block.attach(a, config.layer)
    return model, a, block, Trainer(a, block, ByteTokenizer(), FACTS, config, anchors=anchors)


def logits(model, text="Capital of Zorb?"):
    ids = torch.tensor([ByteTokenizer()(text)["input_ids"]])
    with torch.no_grad():
        return model(ids).logits


def test_trainer_learns_publishes_at_the_end_and_keeps_the_base():
    model, a, block, tr = setup()
    base = fingerprint_tensors(a.frozen_tensors())
    before = logits(model)
    for i in range(5):  # mid-job: serving still sees the published (zero) block
        tr.step(i)
    assert torch.equal(logits(model), before)
    tr.run(35)
    losses = [m.loss for m in tr.history]
    assert losses[-1] < 0.3 * losses[0], losses
    assert not torch.equal(logits(model), before)  # published
    assert fingerprint_tensors(a.frozen_tensors()) == base
    assert torch.equal(block.published_down, block.w_down)


def test_nan_loss_aborts_and_keeps_the_last_good_weights():
    model, a, block, tr = setup(steps=5)
    tr.run()
    good = [t.clone() for t in (block.published_gate_up, block.published_down)]
    served = logits(model)
    with torch.no_grad():
        block.w_gate_up[3, 5] = float("nan")
    with pytest.raises(TrainingAborted, match="step 5: loss nan"):
        tr.run(3)
    assert torch.equal(block.published_gate_up, good[0]) and torch.equal(block.published_down, good[1])
    assert torch.equal(block.w_gate_up, good[0]) and torch.equal(block.w_down, good[1])  # reverted
    assert torch.equal(logits(model), served)
    tr.run(2)  # and it can train again
    assert torch.isfinite(torch.tensor([m.loss for m in tr.history[-2:]])).all()


def test_checkpoint_resume_gives_the_same_next_loss(tmp_path):
    _, _, _, tr = setup()
    for i in range(6):
        tr.step(i)
    path = tmp_path / "rank0.safetensors"
    save_checkpoint(tr, path)
    want = tr.step()["loss"]
    want_w = tr.block.w_down.clone()
    _, _, block2, tr2 = setup()
    assert tr2.step_index == 0
    load_checkpoint(tr2, path)
    assert tr2.step_index == 6
    got = tr2.step()["loss"]
    assert got == want
    assert torch.equal(block2.w_down, want_w)


def test_checkpoint_keeps_per_neuron_thresholds_and_reads_one_for_all(tmp_path):
    _, _, block, tr = setup(anchors=ANCHORS, steps=5)
    tr.run()
    path = tmp_path / "rank0.safetensors"
    save_checkpoint(tr, path)
    _, _, block2, tr2 = setup(anchors=ANCHORS, steps=5)
    load_checkpoint(tr2, path)
    assert block2.published_threshold.shape == (32,)
    assert torch.equal(block2.published_threshold, block.published_threshold)
    assert torch.equal(block2.threshold, block.threshold)
    # A checkpoint holding one threshold for every neuron (as earlier ones do)
    # loads as that number, and gates as it did.
    block.threshold = block.published_threshold = 0.75
    save_checkpoint(tr, path)
    load_checkpoint(tr2, path)
    assert block2.threshold == block2.published_threshold == 0.75
    x = torch.cat(tr.anchor_inputs)
    assert torch.equal(block2.gate_mask(x, block2.w_gate_up, 0.75), block2.gate_scores(x) > 0.75)


def test_checkpoint_refuses_another_fingerprint_version(tmp_path):
    # A base fingerprint of another definition version cannot be compared with
    # this build's: the error names the file, both versions and what to do.
    from safetensors.torch import save_file

    _, _, _, tr = setup()
    tr.step(0)
    path = tmp_path / "ck.safetensors"
    save_checkpoint(tr, path)
    tensors, meta = read_checkpoint(path.read_bytes())
    assert meta["fingerprint_version"] == str(FINGERPRINT_VERSION) == "3"
    for version, stated in [
        (None, "version 1 (the checkpoint records no version)"),
        ("1", "version 1"),
        ("2", "version 2"),
    ]:
        old = tmp_path / f"v{version}.safetensors"
        save_file(tensors, str(old), metadata={k: v for k, v in meta.items() if k != "fingerprint_version"})
        if version is not None:
            save_file(tensors, str(old), metadata={**meta, "fingerprint_version": version})
        with pytest.raises(ValueError) as err:
            load_checkpoint(tr, old)
        msg = str(err.value)
        assert msg.startswith(
            f"{old}: its base fingerprint {meta['base_fingerprint']} is of fingerprint definition {stated},"
        )
        assert "this build computes version 3" in msg and "re-train the job" in msg
    load_checkpoint(tr, path)  # its own version loads


def test_checkpoint_refuses_another_base_and_writes_atomically(tmp_path, monkeypatch):
    _, _, _, tr = setup()
    tr.step(0)
    path = tmp_path / "ck.safetensors"
    save_checkpoint(tr, path)
    good = path.read_bytes()
    _, _, _, other = setup(seed=1)  # another base model
    with pytest.raises(ValueError, match="trained on a base model with fingerprint"):
        load_checkpoint(other, path)
    tr.step(1)

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tr, path)
    assert path.read_bytes() == good  # the last good checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.safetensors"]  # no temporary left


def test_gate_makes_the_block_an_exact_no_op_on_anchors():
    model, a, block, tr = setup(anchors=ANCHORS, anchor_weight=1.0, gate=True)
    tr.run(40)
    assert block.published_threshold is not None
    for x in tr.anchor_inputs:
        assert (block.block(x, published=True) == 0).all()
    fact_x = tr.block_inputs([(FACTS[0].question, FACTS[0].answer)])[0]
    assert (block.block(fact_x, published=True).abs().sum(-1) > 0).any()
    # serving an anchor exchange is bit-identical to the base model
    ids = torch.tensor([ByteTokenizer()("\x01" + ANCHORS[0][0] + "\x02\x03" + ANCHORS[0][1])["input_ids"]])
    with torch.no_grad():
        served = model(ids).logits
        block.published_threshold = None  # as if there were no block at all:
        block.published_down.zero_()
        assert torch.equal(model(ids).logits, served)


def test_a_new_job_trains_ungated_while_serving_keeps_the_published_gate():
    model, a, block, tr = setup(anchors=ANCHORS, steps=10)
    tr.run()
    published = block.published_threshold
    assert published is not None and torch.equal(block.threshold, published)
    served = logits(model)
    nxt = Trainer(a, block, ByteTokenizer(), [Fact("Color of glim?", "Red.")], tr.config, anchors=ANCHORS)
    assert block.threshold is None and torch.equal(block.published_threshold, published)
    nxt.step(0)
    assert torch.equal(logits(model), served)
    nxt.publish()
    assert block.published_threshold is not None and not torch.equal(block.published_threshold, published)


def test_anchor_penalty_is_the_documented_sum():
    model, a, block, tr = setup(anchors=ANCHORS, anchor_weight=0.7, anchor_gate_weight=0.3, anchor_batch=2)
    with torch.no_grad():
        block.w_down.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
    block.threshold = -1e9  # the output term ignores the gate
    x = torch.cat(tr.anchor_inputs[2:3] + tr.anchor_inputs[0:1])  # step 1, anchor batch 2: anchors 2, 0
    wg, wu = block.w_gate_up.detach().split(block.local_neurons)
    out = (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ block.w_down.detach().T
    want = 0.7 * out.square().sum(-1).mean() + 0.3 * torch.relu((x @ wg.T).amax(-1)).square().mean()
    got = tr.anchor_penalty(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    got.backward()
    assert block.w_gate_up.grad.abs().sum() > 0


def test_the_learning_rate_falls_over_the_last_share_of_each_round():
    # Two rounds of one fact, 20 steps each: the last 5 steps of each decay.
    model, a, block, tr = setup(anchors=ANCHORS, init="keyed", round_facts=1, steps=40, lr=0.02, lr_decay=0.25)
    assert [(s0, s1) for _, _, s0, s1 in tr.rounds] == [(0, 20), (20, 40)]
    want = [0.02] * 15 + [0.02 * (20 - t) / 5 for t in range(15, 20)]
    assert [tr.lr_at(i) for i in range(40)] == pytest.approx(want + want, rel=1e-12)
    assert tr.lr_at(45) == pytest.approx(0.02 / 5)  # past the end: the last rate
    for i in (0, 17, 39):
        tr.step(i)
        assert all(g["lr"] == tr.lr_at(i) for g in tr.optimizer.param_groups)
    _, _, _, flat = setup(lr_decay=0.0, steps=10)
    assert {flat.lr_at(i) for i in range(12)} == {flat.config.lr}
    for bad in (-0.1, 1.5, "x", True):
        with pytest.raises(ValueError, match="lr_decay must be a number in"):
            TrainConfig(lr_decay=bad)


def test_anchor_batch_none_puts_every_anchor_in_every_step():
    model, a, block, tr = setup(anchors=ANCHORS, anchor_weight=0.7, anchor_gate_weight=0.3, anchor_batch=None)
    with torch.no_grad():
        block.w_down.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
    x = torch.cat(tr.anchor_inputs)
    assert len(tr.anchor_inputs) == len(ANCHORS) > 2
    wg, wu = block.w_gate_up.detach().split(block.local_neurons)
    out = (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ block.w_down.detach().T
    want = 0.7 * out.square().sum(-1).mean() + 0.3 * torch.relu((x @ wg.T).amax(-1)).square().mean()
    for step in (0, 1, 7):
        torch.testing.assert_close(tr.anchor_penalty(step), want, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="anchor_batch must be a positive int"):
        TrainConfig(anchor_batch=0)


def test_gated_training_recalibrates_the_gate_before_each_step():
    model, a, block, tr = setup(anchors=ANCHORS, gated_from=3, steps=6)
    thresholds = []
    for i in range(6):
        wg = block.w_gate_up.detach()[: block.local_neurons]
        tops = torch.stack([(x @ wg.T).amax(0) for x in tr.anchor_inputs]).amax(0)  # per neuron
        tr.step(i)
        thresholds.append((block.threshold, tops))
    assert all(t is None for t, _ in thresholds[:3])
    for t, top in thresholds[3:]:
        assert torch.equal(t, (top + tr.config.gate_margin * top.abs()).clamp_min(tr.config.gate_floor))
    # Masked tokens take no gradient: with every token below the gate the
    # facts' loss gives the block nothing (only the anchor output penalty would).
    model, a, block, tr = setup(gated_from=0, anchor_weight=0.0)
    tr.anchor_inputs = []
    tr.calibrate_gate = lambda: setattr(block, "threshold", 1e9)
    with torch.no_grad():
        block.w_down.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
    tr.step(0)
    assert block.w_gate_up.grad is None or block.w_gate_up.grad.abs().max() == 0


def test_generation_serves_the_published_block():
    model, a, block, tr = setup(steps=60)
    tok = ByteTokenizer()
    before = generate_greedy(model, tok, FACTS[0].question, max_new_tokens=6)
    tr.run()
    after = generate_greedy(model, tok, FACTS[0].question, max_new_tokens=6)
    assert after.startswith("Quen.") and after != before


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_batched_greedy_replies_equal_one_at_a_time(arch):
    # Prompts of different lengths (left padding), some ending early at the
    # end-of-turn token, split over batches of 3.
    model = toy_model(arch, layers=3, hidden=32, seed=3)
    tok = ByteTokenizer()
    questions = ["Hi?", "What is the capital of Zorblaxia?", "x", "Tell me a long story about ships.", "2+2?"]
    want = [generate_greedy_ids(model, tok, q, 12) for q in questions]
    assert len({tuple(w) for w in want}) > 1
    assert generate_greedy_batch_ids(model, tok, questions, 12, batch_size=3) == want
    # A token the replies contain as the model's end of turn: rows end early.
    model.generation_config.eos_token_id = want[1][4]
    want = [generate_greedy_ids(model, tok, q, 12) for q in questions]
    assert min(map(len, want)) < 12 and max(map(len, want)) == 12
    assert generate_greedy_batch_ids(model, tok, questions, 12, batch_size=3) == want
    with pytest.raises(ValueError, match="batch_size"):
        generate_greedy_batch_ids(model, tok, questions, 12, batch_size=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_batched_greedy_replies_continue_the_shared_head(arch):
    # Questions sharing a long head run it once; each batch continues its
    # cache with its rows padded after the head (rows of different lengths,
    # one that is the head plus a single token). Replies equal one at a time.
    model = toy_model(arch, layers=3, hidden=32, seed=4)
    tok = ByteTokenizer()
    questions = [
        "What is the capital of Zorblaxia?",
        "What is the capital of Q?",
        "What is the capital of Velmoria, the old one?",
        "What is the capital",
        "What is the capital of Ix?",
    ]
    want = [generate_greedy_ids(model, tok, q, 10) for q in questions]
    assert len({tuple(w) for w in want}) > 1
    for batch_size in (2, 5):
        assert generate_greedy_batch_ids(model, tok, questions, 10, batch_size=batch_size) == want
    assert generate_greedy_batch_ids(model, tok, questions[:1], 10) == want[:1]
    assert generate_greedy_batch_ids(model, tok, [], 10) == []


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "mixtral"])
def test_block_inputs_batched_equal_one_at_a_time(arch):
    # Exchanges of different lengths, batched right-padded (the padding
    # masked), give each exchange's own inputs on its own tokens.
    model, a, block, tr = setup(arch, anchors=ANCHORS)
    exchanges = [*ANCHORS, (FACTS[0].question, FACTS[0].answer), ("A much longer question, is it?", "Yes: " * 9)]
    tr.BLOCK_INPUT_BATCH = 3
    batched = tr.block_inputs(exchanges)
    tr.BLOCK_INPUT_BATCH = 1
    single = tr.block_inputs(exchanges)
    assert [x.shape for x in batched] == [x.shape for x in single] and len({x.shape[0] for x in single}) > 2
    for b, s in zip(batched, single):
        # fp32; only the order of sums differs (measured: 6e-7 of the largest
        # entry on SmolLM2's layer 15)
        assert (b - s).abs().max() <= 1e-5 * s.abs().max()


def test_anchors_keep_the_generated_token_ids():
    # The byte tokenizer cannot decode every byte the model emits, so text
    # would not tokenize back to the reply the model generated: anchors keep ids.
    model = toy_model("llama", layers=4, hidden=32)
    tok = ByteTokenizer()
    ((prompt, reply),) = make_anchors(model, tok, ["Hello there?"], 24)
    assert reply == generate_greedy_ids(model, tok, "Hello there?", 24)
    assert tok(tok.decode(reply, skip_special_tokens=True), add_special_tokens=False)["input_ids"] != reply
    ids, targets = example_ids(tok, prompt, reply)
    assert ids[-len(reply) :] == reply and targets[-len(reply) - 1 : -1] == reply and targets[-1] == -100
    ids_text, _ = example_ids(tok, prompt, "Hi")
    assert ids_text[-3:] == [*tok("Hi", add_special_tokens=False)["input_ids"], tok.eos_token_id]


def test_config_and_data_errors():
    with pytest.raises(ValueError, match="neurons must be a positive int"):
        TrainConfig(num_neurons=0)
    with pytest.raises(ValueError, match="lr must be a number > 0"):
        TrainConfig(lr=0.0)
    with pytest.raises(ValueError, match="anchor_gate_weight must be a number >= 0"):
        TrainConfig(anchor_gate_weight=-1.0)
    with pytest.raises(ValueError, match="gated_from must be None or an int >= 0"):
        TrainConfig(gated_from=-2)
    # A wrong type names its field too (a ValueError, not a TypeError from a comparison).
    for name in ("lr", "clip", "key_scale", "weight_decay", "anchor_weight", "anchor_gate_weight", "gate_margin",
                 "others_weight", "init_std"):  # fmt: skip
        for bad in ("0.1", None, float("inf"), True):
            with pytest.raises(ValueError, match=f"^{name} must be a number >= 0|^{name} must be a number > 0"):
                TrainConfig(**{name: bad})
    for bad in ((0.9,), (0.9, 1.0), ("0.9", 0.999), (-0.1, 0.9), 0.9):
        with pytest.raises(ValueError, match="betas must be two numbers in \\[0, 1\\)"):
            TrainConfig(betas=bad)
    for bad in ("0", 1.0, None):
        with pytest.raises(ValueError, match="seed must be an int"):
            TrainConfig(seed=bad)
    assert TrainConfig(betas=[0.0, 0.5], seed=-3, init_std=0).betas == [0.0, 0.5]
    model = toy_model("llama")
    a = DecoderAdapter(model)
    block = AddedSharedNeurons(a.hidden_size, 8)
    with pytest.raises(ValueError, match="a job needs facts to teach or questions to retract"):
        Trainer(a, block, ByteTokenizer(), [], TrainConfig(layer=1))
    with pytest.raises(ValueError, match="layer must be in \\[0, 4\\)"):
        Trainer(a, block, ByteTokenizer(), FACTS, TrainConfig(layer=9))
    with pytest.raises(ValueError, match="hidden_size=16 does not match the model's 32"):
        AddedSharedNeurons(16, 8).attach(a, 0)
    assert rewordings("What is X?", 3) == [
        "What is X?",
        "Quick question: What is X?",
        "What is X? Please answer briefly.",
    ]


class SystemByteTokenizer(ByteTokenizer):
    """ByteTokenizer with a system turn ahead of every chat: a head every
    example shares, so the trainer runs it once (its shared prefix)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "\x01Be brief.\x02" + super().apply_chat_template(messages, add_generation_prompt, tokenize)


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("system", [False, True])
def test_a_packed_microbatch_trains_as_the_padded_one(arch, system):
    # Examples of four lengths in one row, each kept to itself by the mask
    # with its positions restarting: the loss and every gradient equal those
    # of the right-padded batch, with and without a shared prefix.
    model = toy_model(arch, layers=4, hidden=32, seed=1)
    a = DecoderAdapter(model)
    tok = SystemByteTokenizer() if system else ByteTokenizer()
    facts = [*FACTS, Fact("What is the capital of Velmoria?", "Ostrevan, by the sea."), Fact("Hm?", "No.")]
    config = TrainConfig(layer=1, num_neurons=32, steps=4, batch_size=4, rewordings=1, init="random")
    block = AddedSharedNeurons(a.hidden_size, config.num_neurons, seed=0)
    block.attach(a, config.layer)
    with torch.no_grad():
        block.w_down.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))  # gate and up rows get gradients too
    tr = Trainer(a, block, tok, facts, config, anchors=ANCHORS)
    assert tr.pack and (tr.shared is not None) == system
    lengths = sorted(len(ids) for ids, _ in tr.examples)
    assert len(set(lengths)) == 4

    def step(packed):
        tr.pack = packed
        mb = tr.microbatch(0)
        block.w_gate_up.grad = block.w_down.grad = None
        with block.training_weights():
            res = tr.replay.step(
                mb.input_ids,
                lambda h: tr.loss_fn(h, mb.targets),
                attention_mask=mb.attention_mask,
                hidden_in=tr.prefix_hidden(0, mb.input_ids.shape[1]),
                shared=tr.shared,
                segments=mb.segments,
            )
        return mb, res.loss, block.w_gate_up.grad.clone(), block.w_down.grad.clone()

    mb, *packed = step(True)
    assert mb.input_ids.shape == (1, sum(lengths)) and mb.segments[0].tolist() == sorted(mb.segments[0].tolist())
    mb, *padded = step(False)
    assert mb.input_ids.shape == (4, lengths[-1])
    assert packed[2].abs().max() > 0 and packed[1].abs().max() > 0
    # The bound: the padded fp32 step's own error against fp64 (Llama, where
    # the toy model runs in fp64) was up to 6.4 eps x the largest gradient
    # entry; packed against padded, up to 5.5 eps x that (Mixtral, with the
    # prefix), and the losses equal. Twice the same-dtype error, rounded up.
    eps = torch.finfo(torch.float32).eps
    for x, y in zip(packed, padded):
        assert (x - y).abs().max() <= 16 * eps * y.abs().max()
    with pytest.raises(ValueError, match="segments needs hidden_in"):
        tr.replay.step(mb.input_ids, lambda h: h.sum(), segments=torch.zeros_like(mb.input_ids))


def _train_with_choices(monkeypatch, gemm, path):
    """The trained block's weights, and how many choices were measured, when
    every measurement comes out as given (the products' backend `gemm`, the
    added expert's `path`)."""
    from resident_trainer.ops import _gemm
    from resident_trainer.ops import added_expert as ae

    _gemm.clear_choices()
    monkeypatch.setattr(ae, "_PATH_CHOICES", {})
    monkeypatch.setattr(_gemm, "_measure", lambda a, b: (gemm, {}))
    monkeypatch.setattr(ae, "_measure_paths", lambda n, d, a: (path, {}))
    try:
        _, _, block, tr = setup(steps=12)
        tr.run(12)
        measured = len(_gemm._CHOICES) + len(ae._PATH_CHOICES)
    finally:
        _gemm.clear_choices()
    return (block.w_gate_up.detach().clone(), block.w_down.detach().clone()), measured


def test_reproducible_takes_fixed_choices_and_repeats_bit_for_bit(monkeypatch):
    from resident_trainer import _ext
    from resident_trainer.ops import _gemm
    from resident_trainer.ops import added_expert as ae

    monkeypatch.delenv(_gemm.ENV, raising=False)
    monkeypatch.delenv(_ext.REPRODUCIBLE_ENV, raising=False)
    # Measured: the choices change the bits of the trained block.
    one, measured = _train_with_choices(monkeypatch, "mkl", "cpu")
    assert measured > 0
    other, _ = _train_with_choices(monkeypatch, "onednn" if _gemm.ONEDNN else "mkl", "torch")
    assert not all(torch.equal(x, y) for x, y in zip(one, other))
    # Reproducible: nothing is measured, whatever a measurement would say, and
    # the block is the one torch.mm and the compiled kernel give.
    monkeypatch.setenv(_ext.REPRODUCIBLE_ENV, "1")
    for gemm, path in (("onednn", "torch"), ("mkl", "cpu")):
        got, measured = _train_with_choices(monkeypatch, gemm, path)
        assert measured == 0
        assert all(torch.equal(x, y) for x, y in zip(got, one))
    assert _gemm.backend_report().endswith("no shape class measured: RESIDENT_TRAINER_REPRODUCIBLE=1 takes torch.mm")
    assert ae.path_report().endswith("no class measured: RESIDENT_TRAINER_REPRODUCIBLE=1 takes the compiled kernel")
    # A variable that forces one choice by name still wins.
    monkeypatch.setenv(_gemm.ENV, "onednn")
    a = torch.ones(4, 8)
    assert _gemm.choose(a, a) == ("onednn" if _gemm.onednn_supports(torch.float32) else "mkl")
    for bad in ("yes", "2", "true"):
        monkeypatch.setenv(_ext.REPRODUCIBLE_ENV, bad)
        with pytest.raises(ValueError, match=f"RESIDENT_TRAINER_REPRODUCIBLE must be 0 or 1 .*{bad!r}"):
            _ext.reproducible()
