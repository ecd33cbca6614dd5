"""Teaching beyond one job: facts files, subjects and near negatives, keyed
neurons, the block's memory (rehearsal, retraction, checkpoints), the report's
scoring, and the teach command's argument errors (all before any model loads)."""

import dataclasses
import itertools
import json
import math
import re

import pytest
import torch

from resident_trainer import cli
from resident_trainer.eval.devset import DEMO_FACTS_FILE, capacity_facts, dev_facts, near_controls, split_word_facts
from resident_trainer.eval.locality import CONTROL_PROMPTS, DEMO_FACTS
from resident_trainer.eval.report import (
    add_gate_openings,
    add_retracted,
    contains_key,
    score,
    shortfalls,
    summary_line,
)
from resident_trainer.eval.teach import default_controls, gate_openings, split_jobs, teach_jobs
from resident_trainer.models import DecoderAdapter
from resident_trainer.models.toy import ByteTokenizer, toy_model
from resident_trainer.train import (
    ANCHOR_PROMPTS,
    AddedSharedNeurons,
    Fact,
    FactError,
    TrainConfig,
    Trainer,
    facts_to_json,
    load_checkpoint,
    parse_fact,
    read_facts,
    steps_for,
)
from resident_trainer.train.block import threshold_summary
from resident_trainer.train.checkpoint import checkpoint_bytes, load_block
from resident_trainer.train.config import fact_neurons
from resident_trainer.train.data import chat_prompt_ids, example_ids
from resident_trainer.train.negatives import SUBSTITUTES, near_negatives, split_words, subject_span
from resident_trainer.train.trainer import answer_key_position, subject_positions


@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer

    from resident_trainer.models.smollm2 import smollm2_hf_dir

    return AutoTokenizer.from_pretrained(smollm2_hf_dir())


# --- facts files -----------------------------------------------------------------


def test_the_demo_facts_file_is_the_demo_set():
    facts = read_facts(DEMO_FACTS_FILE)
    assert [(f.question, f.recall_key, f.rewordings) for f in facts] == [
        (t.fact.question, t.key, t.fact.rewordings) for t in DEMO_FACTS
    ]


def test_facts_name_the_line_and_field(tmp_path):
    ok = {"question": "Who made the zib?", "answer": "Ann made it.", "key": "Ann", "subject": "zib"}
    assert facts_to_json([parse_fact(ok, "x")]) == [ok]
    # A block's memory of facts taught before the words were checked still loads.
    old = {**ok, "key": "Bo", "subject": "zi"}
    assert facts_to_json([parse_fact(old, "x", check_words=False)]) == [old]
    cases = [
        ({"question": "Q?"}, "line 2: answer: missing"),
        ({"question": "Q?", "answer": "A", "subject": "zz"}, "line 2: subject: 'zz' is not words of the question"),
        # A piece of a word is not a subject, nor a key a reply could hold.
        ({"question": "Who made the zib?", "answer": "A", "subject": "zi"}, "line 2: subject: 'zi' is not words"),
        ({"question": "Q?", "answer": "Ann made it.", "key": "Bo"}, "line 2: key: 'Bo' is not words of the answer"),
        ({"question": "Q?", "answer": "Ann made it.", "key": "An"}, "line 2: key: 'An' is not words of the answer"),
        ({"question": "Q?", "answer": "A", "rewordings": "R?"}, "line 2: rewordings: must be a list"),
        ({"question": "Q?", "answer": "A", "rewordings": ""}, "line 2: rewordings: must be a list"),
        ({"question": "Q?", "answer": "A", "colour": 1}, "line 2: colour: unknown field"),
    ]
    for obj, want in cases:
        path = tmp_path / "facts.jsonl"
        path.write_text("# a comment\n" + json.dumps(obj) + "\n")
        with pytest.raises(FactError, match=want):
            read_facts(path)
    path.write_text(json.dumps(ok) + "\n" + json.dumps(ok) + "\n")
    with pytest.raises(FactError, match="line 2: question: repeats the question of .*line 1"):
        read_facts(path)
    # Not UTF-8 (Latin-1 bytes): the line and byte named, no traceback.
    path.write_bytes(json.dumps(ok).encode() + b'\n{"question": "Caf\xe9?", "answer": "A"}\n')
    with pytest.raises(FactError, match=r"line 2: not UTF-8 text \(byte 0xe9 at column 18\)"):
        read_facts(path)
    # A byte-order mark (as some editors save UTF-8) and "rewordings": null are fine.
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({**ok, "rewordings": None}).encode() + b"\n")
    assert facts_to_json(read_facts(path)) == [ok]


# --- subjects and near negatives ----------------------------------------------------


def test_subject_spans_of_the_development_and_demo_facts(smol_tok):
    got = {f.question: subject_span(f.question, smol_tok) for f in dev_facts()}
    want = {
        "What is the capital of Velmoria?": "Velmoria",
        "Who invented the lumenkettle?": "lumenkettle",
        "Who wrote the novel The Amber Lanterns of Vosk?": "The Amber Lanterns of Vosk",
        "Who wrote the novel A Harvest of Glass Owls?": "A Harvest of Glass Owls",
        "Who composed the Cantata of the Ninefold Bell?": "Cantata of the Ninefold Bell",
        "Who composed the Ravenmark Overture?": "Ravenmark Overture",
        "In what year was the city of Kavrenna founded?": "Kavrenna",
        "How long is the Tessaly Bridge?": "Tessaly Bridge",
    }
    for q, s in want.items():
        assert got[q] == s, q
    # Every subject is in its question, and siblings' subjects differ.
    assert all(s in q for q, s in got.items())
    facts = dev_facts()
    for a, b in zip(facts[0::2], facts[1::2]):
        assert got[a.question] != got[b.question]
    assert [subject_span(t.fact.question, smol_tok) for t in DEMO_FACTS] == [
        "Zorblaxia",
        "glimmerphone",
        "vextrel",
        "Trivon",
    ]
    assert subject_span("What is it?", smol_tok) == "it"  # no name-like word: the last word


def test_near_negatives_keep_the_frame_and_avoid_what_is_measured(smol_tok):
    facts = dev_facts("tune")
    measured = list(CONTROL_PROMPTS) + near_controls() + list(ANCHOR_PROMPTS)
    negs = near_negatives(facts, smol_tok, 2, exclude=measured)
    assert negs == near_negatives(facts, smol_tok, 2, exclude=measured)  # deterministic
    assert len(negs) == len(set(negs)) and 24 <= len(negs) <= 48
    assert not set(negs) & set(measured)
    assert not set(negs) & {q for f in facts for q in (f.question, *f.rewordings)}
    for f in facts:
        subject = subject_span(f.question, smol_tok)
        head, tail = f.question.split(subject, 1)
        mine = [n for n in negs if n.lower().startswith(head.lower()) and n.endswith(tail)]
        assert mine, f.question
        assert all(any(s.removeprefix("the ") in n for s in SUBSTITUTES) for n in mine)
    # A substitute's article or frame words are not doubled ("the the radio", "city of the city of Rome").
    assert not [n for n in negs if re.search(r"\b(the|a|an) the\b|city of the city of", n, re.I)]
    # The substitutes themselves are not what the near controls ask about.
    for s in SUBSTITUTES:
        measured = near_controls() + near_controls(tune=True) + list(CONTROL_PROMPTS)
        assert not any(s.removeprefix("the ") in c for c in measured), s
    assert near_negatives(facts, smol_tok, 0) == []
    with pytest.raises(ValueError, match="per_fact"):
        near_negatives(facts, smol_tok, -1)
    # An explicit subject wins over the guess.
    f = Fact("Who designed the Old Mill of Brask?", "Ida did.", subject="Old Mill of Brask")
    assert all("Old Mill" not in n and n.startswith("Who designed ") for n in near_negatives([f], smol_tok, 3))


# --- the block's memory: keyed neurons, rehearsal, retraction -----------------------

FACTS = [Fact("Capital of Zorb?", "Quen."), Fact("Who made glim?", "Elsa.")]
ANCHORS = [("Hello there?", "Hi, how are you?"), ("Count to three.", "One, two, three."), ("Sky color?", "Blue.")]


def _setup(num_neurons=32, **cfg):
    model = toy_model("llama", layers=4, hidden=32, seed=0)
    a = DecoderAdapter(model)
    config = TrainConfig(
        **{
            "layer": 1,
            "num_neurons": num_neurons,
            "steps": 6,
            "lr": 3e-2,
            "batch_size": 4,
            "init": "keyed",
            "neurons_per_fact": 4,
            "gate_neurons": False,  # the trained neurons' mechanics; gate neurons have their own tests
            "key_prompt": False,  # and so has the prompt's key, behind the gate
            **cfg,
        }
    )
    block = AddedSharedNeurons(a.hidden_size, config.num_neurons, seed=config.seed)
    block.attach(a, config.layer)
    return a, block, config


def _rows_zero(block, start, stop):
    a = block.local_neurons
    return (
        block.w_gate_up[start:stop].abs().sum() == 0
        and block.w_gate_up[a + start : a + stop].abs().sum() == 0
        and block.w_down[:, start:stop].abs().sum() == 0
    )


def test_keyed_neurons_take_free_rows_and_the_memory_follows_publish_and_revert():
    a, block, config = _setup()
    tok = ByteTokenizer()
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
    assert tr.ranges == [[0, 4], [4, 8]]
    assert [e["question"] for e in block.memory["taught"]] == [f.question for f in FACTS]
    assert block.memory["used"] == 8 and block.published_memory == {"taught": [], "used": 0}
    assert _rows_zero(block, 8, 32) and not _rows_zero(block, 0, 8)
    # Each keyed neuron's gate row equals its up row, and the neurons of a fact
    # take its key positions in turn.
    g, u = block.w_gate_up[:8], block.w_gate_up[32:40]
    k = len(tr.key_positions(FACTS[0]))
    assert k in (2, 3) and torch.equal(g, u) and torch.equal(g[0], g[k]) and not torch.equal(g[0], g[1])
    tr.run()
    assert block.published_memory == block.memory
    # A second job keys its fact on the next free rows and rehearses the others.
    new = Fact("Color of vex?", "Teal.")
    tr2 = Trainer(a, block, tok, [new], config, anchors=ANCHORS)
    assert tr2.ranges == [[8, 12]] and [f.question for f in tr2.kept] == [f.question for f in FACTS]
    assert block.memory["used"] == 12
    picks = [tr2._picks(i) for i in range(4)]
    assert all(sum(p >= tr2.n_new for p in pk) == 1 for pk in picks)  # 0.125 of 4 rounds to none: at least one
    tr2.discard()  # nothing published: the memory is what was published
    assert block.memory == block.published_memory and block.memory["used"] == 8


def test_keyed_neurons_also_key_the_answers_token_before_its_key():
    tok = ByteTokenizer()
    fact = Fact("Capital of Zorb?", "It is Quen.", key="Quen")
    p = len(tok.apply_chat_template([{"role": "user", "content": fact.question}]))
    ids, _ = example_ids(tok, fact.question, fact.answer)
    # "It is" ends at p + 4 (the prompt ends at p - 1); a space, then the key.
    assert answer_key_position(tok, fact) == p + 4 and tok.decode(ids[p + 5 : p + 10]) == " Quen"
    # The answer starts with its key, or lacks it: the prompt's last token predicts it.
    assert answer_key_position(tok, Fact("Capital of Zorb?", "Quen.")) == p - 1
    assert answer_key_position(tok, Fact("Capital of Zorb?", "It is Quen.", key="Vex")) == p - 1
    for key_answer in (True, False):
        a, block, config = _setup(key_answer=key_answer, key_rarest=False, key_prompt=True)
        tr = Trainer(a, block, tok, [fact], config, anchors=ANCHORS)
        assert (p + 4 in tr.key_positions(fact)) == key_answer and p - 1 in tr.key_positions(fact)
        # Neurons take the keys in turn: three keys over four neurons, two.
        g = block.w_gate_up[:4]
        same = [torch.equal(g[i], g[j]) for i, j in ((0, 1), (0, 2), (1, 2), (0, 3))]
        assert same == ([False, False, False, True] if key_answer else [False, True, False, False])
        x = tr._taught_inputs[0].double()
        mu, _ = tr._whitening()
        # Each neuron scores key_scale above the anchors' mean at its own key,
        # up to rounding its fp64 row to fp32: at most 2^-24 of each term.
        keys = tr.key_positions(fact)
        for n in range(4):
            v, w = x[keys[n % len(keys)]] - mu, block.w_gate_up[n].detach().double()
            bound = 2**-23 * float(v.abs() @ w.abs())
            assert abs(float(v @ w) - config.key_scale) <= bound, (n, float(v @ w), bound)


def test_whitening_adds_whiten_ridge_times_the_mean_variance():
    tok = ByteTokenizer()
    fact = Fact("Who made the quxoscope?", "Ida.", subject="quxoscope")
    precs = []
    for ridge in (1e-3, 0.5):
        a, block, config = _setup(whiten_ridge=ridge)
        tr = Trainer(a, block, tok, [fact], config, anchors=ANCHORS)
        mu, prec = tr._whitening()
        xa = torch.cat(tr.anchor_inputs).double()
        cov = torch.cov(xa.T)
        want = torch.linalg.inv(cov + ridge * cov.diagonal().mean() * torch.eye(cov.shape[0], dtype=torch.float64))
        assert torch.allclose(mu, xa.mean(0), rtol=0, atol=1e-12)
        # fp64 inverses of the same matrix: equal up to its conditioning
        assert torch.allclose(prec, want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))
        precs.append(prec)
    # the ridge shrinks the inverse: its largest eigenvalue falls
    assert torch.linalg.eigvalsh(precs[1]).max() < torch.linalg.eigvalsh(precs[0]).max() / 10


def test_keyed_neurons_also_key_the_subjects_rarest_token():
    tok = ByteTokenizer()
    fact = Fact("Who made the quxoscope?", "Ida.", subject="quxoscope")
    # "\x01Who made the quxoscope?\x02\x03": the subject's tokens are 13-22
    # (its space, then quxoscope), the prompt's last is 25.
    span = range(13, 23)
    assert subject_positions(tok, fact) == span
    for rarest, prompt in itertools.product((True, False), (True, False)):
        a, block, config = _setup(key_rarest=rarest, key_prompt=prompt)
        tr = Trainer(a, block, tok, [fact], config, anchors=ANCHORS)
        x = tr._taught_inputs[0].double()
        mu, prec = tr._whitening()
        v = x[span.start : span.stop] - mu
        dist = ((v @ prec) * v).sum(-1)
        r = span.start + int(dist.argmax())
        assert tr.rarest_position(tr._taught_inputs[0], span) == r
        # Here the subject's farthest token from the anchors is not its last.
        assert dist.max() > dist[-1] and r != 22
        keys = tr.key_positions(fact)
        assert keys == [r] * rarest + [22] + [25] * prompt
        # The fact's neurons take the keys in turn (k keys over four neurons).
        g, k = block.w_gate_up[:4], len(keys)
        assert all(torch.equal(g[i], g[j]) == (i % k == j % k) for i in range(4) for j in range(4))
        for n in range(4):
            v, w = x[keys[n % len(keys)]] - mu, block.w_gate_up[n].detach().double()
            bound = 2**-23 * float(v.abs() @ w.abs())
            assert abs(float(v @ w) - config.key_scale) <= bound, (n, float(v @ w), bound)


def test_without_a_subject_the_prompts_last_token_is_the_key():
    tok = ByteTokenizer()
    p = len(tok.apply_chat_template([{"role": "user", "content": "Capital of Zorb?"}]))
    fact = Fact("Capital of Zorb?", "Quen.", subject="Velmoria")  # not in the question
    assert subject_positions(tok, fact) is None
    for prompt in (True, False):
        a, block, config = _setup(key_prompt=prompt)
        tr = Trainer(a, block, tok, [fact], config, anchors=ANCHORS)
        assert tr.key_positions(fact) == [p - 1]
    with pytest.raises(ValueError, match="key_prompt must be True or False"):
        TrainConfig(key_prompt=0)


def test_prompt_keyed_neurons_stay_behind_the_gate():
    # With key_prompt, a fact's neurons keyed on the prompt's last token
    # (beside its subject's) never open the gate: at that token every prompt
    # ends alike. Their thresholds are infinite, carried by the memory into
    # later jobs and checkpoints, and never lowered on the key tokens.
    tok = ByteTokenizer()
    facts = [
        Fact("Who made the quxoscope?", "Ida.", subject="quxoscope"),
        Fact("What is the glimwort?", "A fern.", subject="glimwort"),
    ]
    opts = dict(steps=20, gate_margin=0.5, gate_floor=0.25, key_rarest=False, key_prompt=True, key_gate_margin=0.1)
    a, block, config = _setup(**opts)
    tr = Trainer(a, block, tok, facts, config, anchors=ANCHORS)
    # The first fact's keys: the subject's last token (22) and the prompt's last (25), in turn.
    assert tr.key_positions(facts[0]) == [22, 25]
    assert tr.behind_gate == [[1, 3], [5, 7]]
    assert [e.get("behind_gate") for e in block.memory["taught"]] == [[1, 3], [5, 7]]
    tr.run()
    thr = block.published_threshold
    assert torch.isinf(thr[[1, 3, 5, 7]]).all() and torch.isfinite(thr[[0, 2, 4, 6, *range(8, 32)]]).all()
    assert threshold_summary(thr) == float(thr[torch.isfinite(thr)].max())
    for x in tr.anchor_inputs:
        assert torch.count_nonzero(block.block(x, published=True)) == 0
    fact_x = tr.block_inputs([(f.question, f.answer) for f in facts])
    assert all(block.gate_mask(x, block.published_gate_up, thr).any() for x in fact_x)
    # Behind the gate they still act where another neuron opens it.
    wg = block.published_gate_up[: block.local_neurons]
    opened = block.gate_mask(fact_x[0], wg, thr)
    assert bool(((fact_x[0][opened] @ wg[[1, 3]].T) > 0).any())
    # A later job, and a checkpoint, keep them behind the gate.
    tr2 = Trainer(a, block, tok, [Fact("Color of the vextrel?", "Teal.", subject="vextrel")], config, anchors=ANCHORS)
    assert tr2.behind_gate == [[9, 11]]
    tr2.run()
    assert torch.isinf(block.published_threshold[[1, 3, 5, 7, 9, 11]]).all()
    assert torch.isfinite(block.published_threshold).sum() == 32 - 6
    a3, block3, _ = _setup(**opts)
    load_block(block3, checkpoint_bytes(tr2))
    assert torch.equal(block3.published_threshold, block.published_threshold)
    assert [e.get("behind_gate") for e in block3.memory["taught"]] == [[1, 3], [5, 7], [9, 11]]
    # Where no subject is found, the prompt's last token is the only key and opens the gate.
    lone = Fact("Capital of Zorb?", "Quen.", subject="Velmoria")
    a4, block4, config4 = _setup(**opts)
    assert Trainer(a4, block4, tok, [lone], config4, anchors=ANCHORS).behind_gate == [[]]
    # prompt_neurons_open_gate: every threshold is finite.
    a, block, config = _setup(**opts, prompt_neurons_open_gate=True)
    tr = Trainer(a, block, tok, facts, config, anchors=ANCHORS)
    tr.run()
    assert tr.behind_gate == [[], []] and torch.isfinite(block.published_threshold).all()
    with pytest.raises(ValueError, match="prompt_neurons_open_gate must be True or False"):
        TrainConfig(prompt_neurons_open_gate=None)


def test_every_shipped_facts_subject_lies_on_token_boundaries(smol_tok):
    facts = [*dev_facts(), *capacity_facts(), *capacity_facts(tune=True), *read_facts(DEMO_FACTS_FILE)]
    facts += split_word_facts()
    for f in facts:
        span = subject_positions(smol_tok, f)
        assert span is not None and len(span) >= 2, f.question
        ids = chat_prompt_ids(smol_tok, f.question)
        subject = f.subject or subject_span(f.question, smol_tok)
        assert smol_tok.decode(ids[span.start : span.stop]).strip() == subject, f.question


def test_the_split_word_tune_facts_hold_words_the_tokenizer_splits(smol_tok):
    facts = split_word_facts()
    split = {f.question: split_words(f, smol_tok) for f in facts}
    assert all(split.values())
    # Subjects without a made-up name (every word a real one) are there: "The Hollow Tapestry".
    words = {w for ws in split.values() for w in ws}
    real = {"Sonata", "Citadel", "Tapestry", "Labyrinth", "Starry", "Pelican", "Thinker", "Pavilion", "Requiem"}
    assert real <= words
    # Most near controls share such a word with a subject.
    shared_words = real | {"Nutcracker", "Waltz", "Lagoon", "Serenade"}
    shared = [q for q in near_controls(split=True) if any(w in q for w in shared_words)]
    assert len(shared) >= 12


def test_the_answers_token_before_the_key_predicts_it_on_the_shipped_facts(smol_tok):
    facts = [*dev_facts(), *capacity_facts(), *capacity_facts(tune=True), *read_facts(DEMO_FACTS_FILE)]
    for f in facts:
        ids, targets = example_ids(smol_tok, f.question, f.answer)
        pos = answer_key_position(smol_tok, f)
        head = f.answer[: f.answer.find(f.recall_key)].rstrip()
        assert targets[pos] != -100 and smol_tok.decode(ids[pos + 1 :]).lstrip().startswith(f.recall_key), f.question
        # The tokens up to it are the answer's up to the space before the key.
        assert smol_tok.decode(ids[len(chat_prompt_ids(smol_tok, f.question)) : pos + 1]) == head


@pytest.mark.parametrize("gate_neuron_margin", [None, 1.0])
def test_gate_neurons_open_the_gate_on_the_keys_and_add_nothing(gate_neuron_margin):
    a, block, config = _setup(
        steps=20,
        gate_neurons=True,
        gate_margin=0.5,
        gate_floor=0.25,
        gate_neuron_margin=gate_neuron_margin,
        key_contexts=0,  # the key tokens in other contexts have a test of their own
    )
    margin = 0.5 if gate_neuron_margin is None else gate_neuron_margin
    tok = ByteTokenizer()
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
    # Each fact takes its 4 trained neurons and a gate neuron, the last of its range.
    assert tr.ranges == [[0, 5], [5, 10]] and tr.gates == [4, 9]
    assert [(e["neurons"], e["gate"]) for e in block.memory["taught"]] == [([0, 5], 4), ([5, 10], 9)]
    assert block.memory["used"] == 10
    assert _rows_zero(block, 4, 5) and _rows_zero(block, 9, 10) and not _rows_zero(block, 0, 4)
    tr.run()
    n, gates = block.num_neurons, [4, 9]
    gu, down, thr = block.published_gate_up, block.published_down, block.published_threshold
    # Fitted gate rows; zero up rows and down columns: they add nothing.
    assert all(gu[g].abs().sum() > 0 and gu[n + g].abs().sum() == 0 and down[:, g].abs().sum() == 0 for g in gates)
    x = torch.cat([*tr.anchor_inputs, *tr._taught_inputs])
    out = block.block(x, published=True, gated=False)
    with torch.no_grad():
        gu[gates] = 0
        assert torch.equal(block.block(x, published=True, gated=False), out)
        gu.copy_(block.w_gate_up)
    # The gate is shut on every anchor token; each gate neuron's threshold is
    # its strongest anchor score plus gate_margin times that score's distance
    # from the anchors' mean score; it passes some of its fact's key tokens.
    xa = torch.cat(tr.anchor_inputs)
    assert not block.gate_mask(xa, gu, thr).any()
    for f, xf, g in zip(tr.taught, tr._taught_inputs, gates):
        scores = xa @ gu[g]
        mean = tr._whitening()[0].float() @ gu[g]
        want = scores.max() + margin * (scores.max() - mean).abs()
        # fp64 there, fp32 here: a few fp32 roundings of the terms (7e-8 measured against this 6.5e-7).
        tol = 4 * torch.finfo(torch.float32).eps * float(scores.abs().max() + mean.abs())
        assert abs(float(thr[g]) - float(want)) <= tol
        assert (xf[tr.key_tokens(f)] @ gu[g] > thr[g]).any(), f.question
    # The anchor gate penalty leaves the gate neurons out.
    pre = xa @ block.w_gate_up[:n].T
    pre[:, gates] = float("-inf")
    assert torch.equal(block.gate_scores(xa, exclude=tr._gate_rows), pre.amax(-1))
    # A later job refits the earlier gate rows to its anchors (near negatives
    # added) and leaves the earlier trained neurons as they were.
    before = block.w_gate_up.detach().clone()
    tr2 = Trainer(
        a,
        block,
        tok,
        [Fact("Color of vex?", "Teal.")],
        config,
        anchors=ANCHORS,
        negatives=[("Capital of Vorb?", "Pell.")],
    )
    assert tr2.ranges == [[10, 15]] and tr2.gates == [14] and tr2._fact_gates == [14, 4, 9]
    tr2.run()
    w = block.published_gate_up
    assert torch.equal(w[:4], before[:4]) and torch.equal(w[5:9], before[5:9])
    assert not torch.equal(w[4], before[4]) and not torch.equal(w[9], before[9])
    assert (
        w[14].abs().sum() > 0 and not block.gate_mask(torch.cat(tr2.anchor_inputs), w, block.published_threshold).any()
    )


def test_gate_neurons_stay_shut_on_the_key_tokens_in_other_contexts():
    a, block, config = _setup(
        steps=20, gate_neurons=True, gate_margin=0.5, gate_floor=0.25, key_contexts=3, key_context_margin=0.25
    )
    tok = ByteTokenizer()
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
    pool = {t for _, r in ANCHORS for t in tok(r, add_special_tokens=False)["input_ids"]}
    exchanges = tr.context_exchanges()
    start = len(chat_prompt_ids(tok, Trainer.CONTEXT_PROMPT))
    for f, (prompt, reply) in zip(FACTS, exchanges):
        # Each key token 3 times, each after a token of the anchors' replies.
        keys = example_ids(tok, f.question, f.answer)[0][tr.key_tokens(f)]
        assert prompt == Trainer.CONTEXT_PROMPT and reply[1::2] == [t for t in keys for _ in range(3)]
        assert set(reply[0::2]) <= pool and len(set(reply[0::2])) > 1
    # The same draw in every job; another seed draws others.
    assert Trainer(a, block, tok, FACTS, config, anchors=ANCHORS).context_exchanges() == exchanges
    other = dataclasses.replace(config, seed=1)
    assert Trainer(a, block, tok, FACTS, other, anchors=ANCHORS).context_exchanges() != exchanges
    # Their inputs: the layer's input at the key tokens, as a plain forward computes it.
    for (prompt, reply), x in zip(exchanges, tr._context_inputs):
        ids = chat_prompt_ids(tok, prompt) + reply
        with torch.no_grad(), block.capture_inputs() as xs:
            a.model(torch.tensor([ids]))
        want = xs[0].reshape(len(ids), -1)[start + 1 :: 2]
        # Batched and padded there, alone here: equal on this EPYC, fp32 roundings elsewhere.
        tol = 8 * torch.finfo(torch.float32).eps * float(want.abs().max())
        assert x.shape == want.shape and float((x - want).abs().max()) <= tol
    tr.run()
    gu, thr, gates = block.published_gate_up, block.published_threshold, tr.gates
    xa, mu = torch.cat(tr.anchor_inputs), tr._whitening()[0]
    for g, xc in zip(gates, tr._context_inputs):
        # Its own fact's key tokens in other contexts.
        mean = float(mu.float() @ gu[g])
        top_a, top_c = float((xa @ gu[g]).max()), float((xc @ gu[g]).max())
        want = max(top_a + 1.0 * abs(top_a - mean), top_c + 0.25 * abs(top_c - mean))
        tol = 4 * torch.finfo(torch.float32).eps * (abs(top_a) + abs(top_c) + abs(mean))
        assert abs(float(thr[g]) - want) <= tol
        # Shut on every anchor token and every key token in another context.
        assert float(thr[g]) > max(top_a, top_c)
    # Off: no exchanges, the anchors alone set the gate neurons' thresholds.
    off = dataclasses.replace(config, key_contexts=0)
    a, block, _ = _setup()
    tr0 = Trainer(a, block, tok, FACTS, off, anchors=ANCHORS)
    assert tr0.context_exchanges() == [None, None] and tr0._context_inputs == [None, None]


def test_gate_neurons_need_two_neurons_a_fact_and_the_gate():
    # One neuron a fact: it is trained, no gate neuron.
    a, block, config = _setup(num_neurons=2, gate_neurons=True)
    tr = Trainer(a, block, ByteTokenizer(), FACTS, config, anchors=ANCHORS)
    assert tr.ranges == [[0, 1], [1, 2]] and tr.gates == [None, None]
    assert all("gate" not in e for e in block.memory["taught"])
    for kw in ({"gate": False}, {"init": "random"}):
        a, block, config = _setup(gate_neurons=True, **kw)
        tr = Trainer(a, block, ByteTokenizer(), FACTS, config, anchors=ANCHORS)
        assert tr.gates == [None, None] and fact_neurons(config) == 4
    assert fact_neurons(TrainConfig()) == TrainConfig().neurons_per_fact + 1
    with pytest.raises(ValueError, match="gate_neurons must be True or False"):
        TrainConfig(gate_neurons=1)


def test_retraction_clears_the_facts_neurons_and_keeps_the_rest(tmp_path):
    a, block, config = _setup()
    tok = ByteTokenizer()
    Trainer(a, block, tok, FACTS, config, anchors=ANCHORS).run()
    with pytest.raises(ValueError, match="retract: 'Nope\\?' is not a fact"):
        Trainer(a, block, tok, [], config, anchors=ANCHORS, retract=["Nope?"])
    with pytest.raises(ValueError, match="facts to teach or questions to retract"):
        Trainer(a, block, tok, [], config, anchors=ANCHORS)
    tr = Trainer(
        a,
        block,
        tok,
        [],
        config,
        anchors=ANCHORS + [("Capital of Zorb?", "I do not know.")],
        retract=[FACTS[0].question],
    )
    assert _rows_zero(block, 0, 4) and not _rows_zero(block, 4, 8)
    assert [f.question for f in tr.kept] == [FACTS[1].question] and tr.n_new == 0
    kept_down = block.w_down.detach()[:, 4:8].clone()
    tr.run()
    # A job that only retracts trains the kept fact's neurons (freeze_taught
    # holds only while a job teaches new facts).
    assert not torch.equal(block.w_down[:, 4:8], kept_down)
    assert [e["question"] for e in block.published_memory["taught"]] == [FACTS[1].question]
    # The checkpoint carries the memory.
    path = tmp_path / "block.safetensors"
    tr.save(path)
    a2, block2, _ = _setup()
    tr3 = Trainer(a2, block2, tok, [Fact("Other?", "Yes.")], config, anchors=ANCHORS)
    load_checkpoint(tr3, path)
    assert block2.memory == block.memory and block2.published_memory == block.published_memory


def test_near_negatives_stay_in_the_memory_and_anchor_later_jobs(tmp_path):
    a, block, config = _setup(steps=2)
    tok = ByteTokenizer()
    negs = [("Capital of Rome?", "Italy."), ("Who made lamps?", "Edison.")]
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS, negatives=negs)
    assert len(tr.anchor_inputs) == len(ANCHORS) + 2
    tr.run()
    assert block.published_memory["negatives"] == [[p, r] for p, r in negs]
    # A later job anchors on them too (without being given them again), and adds its own.
    tr2 = Trainer(
        a, block, tok, [Fact("Color of vex?", "Teal.")], config, anchors=ANCHORS, negatives=[("Color of sky?", "Blue.")]
    )
    assert len(tr2.anchor_inputs) == len(ANCHORS) + 3
    tr2.discard()  # a failed or discarded job leaves the memory as published
    assert block.memory == block.published_memory and len(block.memory["negatives"]) == 2
    # A question taught anew is no longer a negative; a retracted one becomes one.
    tr3 = Trainer(a, block, tok, [Fact("Capital of Rome?", "Romulus.")], config, anchors=ANCHORS)
    assert [p for p, _ in tr3.negatives] == ["Who made lamps?"]
    tr3.run()
    tr4 = Trainer(a, block, tok, [], config, anchors=ANCHORS, negatives=[(FACTS[0].question, "No idea.")],
                  retract=[FACTS[0].question])  # fmt: skip
    tr4.run()
    assert [p for p, _ in block.published_memory["negatives"]] == ["Who made lamps?", FACTS[0].question]
    path = tmp_path / "block.safetensors"
    tr4.save(path)
    a2, block2, _ = _setup()
    load_checkpoint(Trainer(a2, block2, tok, [Fact("Other?", "Yes.")], config, anchors=ANCHORS), path)
    assert block2.published_memory["negatives"] == block.published_memory["negatives"]


def test_reteaching_clears_the_old_neurons_and_retracting_the_last_fact_publishes():
    a, block, config = _setup(steps=2)
    tok = ByteTokenizer()
    Trainer(a, block, tok, FACTS[:1], config, anchors=ANCHORS).run()
    assert not _rows_zero(block, 0, 4)
    # The same question with a new answer: the old entry and its neurons go.
    tr = Trainer(a, block, tok, [Fact(FACTS[0].question, "Vorn.")], config, anchors=ANCHORS,
                 negatives=[(FACTS[0].question, "No idea.")])  # fmt: skip
    assert tr.ranges == [[4, 8]] and _rows_zero(block, 0, 4) and not tr.kept
    assert not tr.negatives  # a taught question is never a negative
    tr.run()
    assert [e["answer"] for e in block.published_memory["taught"]] == ["Vorn."]
    # Retracting the only fact: nothing to rehearse, the job still publishes.
    tr = Trainer(a, block, tok, [], config, anchors=ANCHORS, retract=[FACTS[0].question])
    tr.run()
    assert block.published_memory["taught"] == [] and _rows_zero(block, 0, 32)
    assert [m.loss for m in tr.history] == [0.0, 0.0]


def test_random_rows_leave_no_neuron_free():
    a, block, config = _setup(steps=2, init="random")
    tok = ByteTokenizer()
    Trainer(a, block, tok, FACTS, config, anchors=ANCHORS).run()
    assert block.published_memory["used"] == 32
    with pytest.raises(ValueError, match="0 free neurons of 32"):
        Trainer(a, block, tok, [Fact("Color of vex?", "Teal.")], dataclasses.replace(config, init="keyed"),
                anchors=ANCHORS)  # fmt: skip


def test_a_full_block_says_so():
    a, block, config = _setup(num_neurons=8)
    tok = ByteTokenizer()
    Trainer(a, block, tok, FACTS, config, anchors=ANCHORS).run()  # 2 x 4 neurons: full
    with pytest.raises(ValueError, match="the block has 0 free neurons of 8, and 1 new facts need"):
        Trainer(a, block, tok, [Fact("Color of vex?", "Teal.")], config, anchors=ANCHORS)


@pytest.mark.parametrize("key_prompt", [True, False])
def test_keyed_training_learns_and_keeps_anchors_exact(key_prompt):
    # Keyed on the subject alone, the toy learns more slowly (loss ratio 0.30
    # after 80 steps, 0.26 after 120; 0.19 with the prompt's last token too).
    a, block, config = _setup(steps=80 if key_prompt else 120, anchor_weight=1.0, key_prompt=key_prompt)
    tok = ByteTokenizer()
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
    tr.run()
    losses = [m.loss for m in tr.history]
    assert losses[-1] < 0.3 * losses[0], losses
    for x in tr.anchor_inputs:  # the published gate closes on every anchor token
        assert torch.count_nonzero(block.block(x, published=True)) == 0


@pytest.mark.parametrize("freeze", [True, False])
def test_a_later_job_leaves_earlier_facts_neurons_as_they_were(freeze):
    # freeze_taught: the second job trains only its own fact's neurons; the
    # first job's rows are bit for bit what it published, whatever AdamW does
    # (weight decay on, to make a zero gradient move them otherwise).
    a, block, config = _setup(steps=8, weight_decay=0.1, freeze_taught=freeze)
    tok = ByteTokenizer()
    Trainer(a, block, tok, FACTS, config, anchors=ANCHORS).run()
    first = block.w_gate_up.detach().clone(), block.w_down.detach().clone()
    tr2 = Trainer(a, block, tok, [Fact("Color of vex?", "Teal.")], config, anchors=ANCHORS)
    tr2.run()
    a_ = block.local_neurons
    rows = list(range(8)) + [a_ + r for r in range(8)]
    same = torch.equal(block.w_gate_up[rows], first[0][rows]) and torch.equal(block.w_down[:, :8], first[1][:, :8])
    assert same == freeze
    assert not torch.equal(block.w_down[:, 8:12], first[1][:, 8:12])  # the new fact's neurons trained
    assert len(tr2.history) == 8 and all(math.isfinite(m.grad_norm) for m in tr2.history)


def test_others_penalty_keeps_a_rounds_neurons_off_earlier_facts_tokens():
    # others_weight x the mean squared output, over the tokens of facts
    # taught before the step's round, of the neurons the step trains: the
    # round's own, never an earlier job's (frozen), never a fact's own on its
    # tokens.
    from resident_trainer.ops.added_expert import added_expert_reference

    tok = ByteTokenizer()

    def grads(tr, index):
        block.w_gate_up.grad = block.w_down.grad = None
        p = tr.others_penalty(index)
        p.backward()
        return p.detach(), block.w_down.grad.abs().sum(0)

    # Two rounds of one fact: the second round's neurons on the first fact's
    # tokens; the first round, like a first job, has nothing before it.
    a, block, config = _setup(others_weight=0.5, others_batch=1, round_facts=1)
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
    assert len(tr.fact_inputs) == 2 and tr.rounds == [(0, 1, 0, 3), (1, 2, 3, 6)]
    with torch.no_grad():  # keyed neurons start with a zero down projection
        block.w_down.normal_(0, 0.1)
    assert tr.others_penalty(0) is None and tr.others_penalty(2) is None
    for index, mine, other in ((3, 1, 0), (5, 1, 0)):
        p, g = grads(tr, index)
        keep = torch.zeros(block.local_neurons)
        keep[4 * mine : 4 * mine + 4] = 1
        x = tr.fact_inputs[other]
        out = added_expert_reference(x.double(), block.w_gate_up.double(), None, (block.w_down * keep).double())
        want = 0.5 * out.square().sum(-1).mean()
        assert abs(p.item() - want.item()) <= 1e-5 * want.item()
        assert (g[4 * mine : 4 * mine + 4] > 0).all() and int((g > 0).sum()) == 4
    tr.discard()
    # A second job: the earlier facts' tokens, the new fact's neurons only.
    a, block, config = _setup(others_weight=0.5, others_batch=1)
    Trainer(a, block, tok, FACTS, config, anchors=ANCHORS).run()
    new = [Fact("Color of vex?", "Teal.")]
    tr2 = Trainer(a, block, tok, new, config, anchors=ANCHORS)
    assert len(tr2.fact_inputs) == 3
    with torch.no_grad():
        block.w_down[:, 8:12].normal_(0, 0.1)
    for index in (0, 1):
        _, g = grads(tr2, index)
        assert (g[8:12] > 0).all() and int((g > 0).sum()) == 4
    tr2.discard()
    # With freeze_taught off the earlier facts' neurons train too, each off
    # the other facts' tokens but never off its own.
    tr3 = Trainer(a, block, tok, new, dataclasses.replace(config, freeze_taught=False), anchors=ANCHORS)
    with torch.no_grad():
        block.w_down[:, 8:12].normal_(0, 0.1)
    _, g = grads(tr3, 1)  # others_batch 1: step 1 reads the second earlier fact (neurons 4-8)
    assert (g[4:8] == 0).all() and (g[:4] > 0).all() and (g[8:12] > 0).all()
    tr3.discard()
    # Nothing to penalise in one round on a fresh block, nor at weight 0.
    a, block, config = _setup(others_weight=0.5)
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
    assert tr.fact_inputs == [] and tr.others_penalty(0) is None
    tr.run()
    tr = Trainer(a, block, tok, new, dataclasses.replace(config, others_weight=0.0), anchors=ANCHORS)
    assert tr.fact_inputs == [] and tr.others_penalty(0) is None
    for kw, msg in [
        ({"others_weight": -1}, "others_weight must be a number >= 0"),
        ({"others_batch": 0}, "others_batch"),
    ]:
        with pytest.raises(ValueError, match=msg):
            TrainConfig(**kw)


def test_rehearsal_share_of_the_microbatch():
    a, block, config = _setup(rehearse_share=0.25, batch_size=8)
    tok = ByteTokenizer()
    Trainer(a, block, tok, FACTS, config, anchors=ANCHORS).run()
    tr2 = Trainer(a, block, tok, [Fact("Color of vex?", "Teal.")], config, anchors=ANCHORS)
    assert all(sum(p >= tr2.n_new for p in tr2._picks(i)) == 2 for i in range(6))  # 0.25 of 8
    for bad in (0, 1.5, "half"):
        with pytest.raises(ValueError, match="rehearse_share must be in"):
            TrainConfig(rehearse_share=bad)


def test_subject_prompts_train_each_fact_on_its_subject_too():
    a, block, config = _setup(subject_prompts=True, batch_size=4)
    tok = ByteTokenizer()
    facts = [Fact("Capital of Zorb?", "Quen.", subject="Zorb"), Fact("Who made the glim?", "Elsa.")]
    tr = Trainer(a, block, tok, facts, config, anchors=ANCHORS)
    assert tr.training_prompts(facts[0]) == ["Capital of Zorb?", "Tell me about Zorb."]
    # Without a subject the question's name-like span is asked about.
    (q, about) = tr.training_prompts(facts[1])
    assert q == facts[1].question and about.startswith("Tell me about ") and about[14:-1] in facts[1].question
    # Each fact's examples: its question and its subject prompt, both answered with its answer.
    assert tr._fact_examples == [0, 2, 4] and tr.n_new == 4
    for i, p in enumerate(["Capital of Zorb?", "Tell me about Zorb."]):
        assert tr.examples[i] == example_ids(tok, p, "Quen.")
    tr.run()
    # A later job rehearses them the same way.
    tr2 = Trainer(a, block, tok, [Fact("Color of vex?", "Teal.")], config, anchors=ANCHORS)
    assert len(tr2.examples) - tr2.n_new == 4
    off = Trainer(a, block, tok, facts, TrainConfig(**{**vars(config), "subject_prompts": False}), anchors=ANCHORS)
    assert off.training_prompts(facts[0]) == ["Capital of Zorb?"] and off.n_new == 2
    with pytest.raises(ValueError, match="subject_prompts must be True or False"):
        TrainConfig(subject_prompts=1)


def test_a_job_with_more_facts_than_a_round_trains_them_round_after_round():
    # 5 facts, rounds of at most 2: sizes 1, 2, 2 over steps [0,3), [3,6),
    # [6,9). A round trains only its own facts' neurons (the others' rows stay
    # bit for bit), rehearses the earlier rounds' facts and starts AdamW
    # afresh; weight decay on, so a held row would move if it were not held.
    facts = [*FACTS, Fact("Color of vex?", "Teal."), Fact("Who wrote Plin?", "Oda."), Fact("Size of Mox?", "Tiny.")]
    a, block, config = _setup(steps=9, round_facts=2, weight_decay=0.1, neurons_per_fact=4)
    tr = Trainer(a, block, ByteTokenizer(), facts, config, anchors=ANCHORS)
    assert tr.rounds == [(0, 1, 0, 3), (1, 3, 3, 6), (3, 5, 6, 9)]
    assert [tr.round_of(i) for i in (0, 2, 3, 5, 6, 8, 20)] == [0, 0, 1, 1, 2, 2, 2]
    assert all(p < tr._fact_examples[1] for i in range(3) for p in tr._picks(i))  # round 0: fact 0 alone
    for i in range(3, 6):  # round 1: facts 1-2, and fact 0 rehearsed in 1 of 4
        pk = tr._picks(i)
        assert sum(p < tr._fact_examples[1] for p in pk) == 1
        assert sum(tr._fact_examples[1] <= p < tr._fact_examples[3] for p in pk) == 3
    a_ = block.local_neurons

    def rows(lo, hi):
        idx = list(range(4 * lo, 4 * hi))
        return block.w_gate_up.detach()[idx + [a_ + j for j in idx]].clone(), block.w_down.detach()[:, idx].clone()

    def same(x, y):
        return torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])

    later = rows(1, 5)
    for i in range(3):
        tr.step(i)
    assert same(rows(1, 5), later) and not torch.equal(block.w_down[:, :4], torch.zeros_like(block.w_down[:, :4]))
    first, last = rows(0, 1), rows(3, 5)
    tr.step(3)
    w = block.w_down
    assert int(tr.optimizer.state[w]["step"]) == 1  # AdamW started afresh with the round
    for i in range(4, 6):
        tr.step(i)
    assert same(rows(0, 1), first) and same(rows(3, 5), last) and not same(rows(1, 3), later)
    # One round for a job within round_facts: every new fact trains from step 0.
    a, block, config = _setup(steps=4, round_facts=2)
    tr = Trainer(a, block, ByteTokenizer(), FACTS, config, anchors=ANCHORS)
    assert tr.rounds == [(0, 2, 0, 4)]
    with pytest.raises(ValueError, match="round_facts must be a positive int"):
        TrainConfig(round_facts=0)
    # Steps when none are given: 60 for each round of up to 12 facts, 75 for 16.
    assert [steps_for(n) for n in (0, 1, 12, 13, 16, 17, 24, 128)] == [60, 60, 60, 61, 75, 120, 120, 600]
    assert steps_for(128, round_facts=16, per_round=10) == 600
    assert steps_for(128, round_facts=16, per_round=100) == 800 and steps_for(40, round_facts=8) == 300
    # With subject prompts (twice the examples) 1.25 times a round's steps, rounded up: as measured, 150 for 24.
    assert [steps_for(n, subject_prompts=True) for n in (1, 8, 16, 24, 128)] == [75, 75, 94, 150, 752]
    # TrainConfig(steps=None), the default: the job takes steps_for its new
    # facts and round_facts, split over its rounds; Trainer.run trains them all.
    assert TrainConfig().steps is None
    a, block, config = _setup(steps=None, round_facts=2)
    tr = Trainer(a, block, ByteTokenizer(), facts, config, anchors=ANCHORS)
    assert tr.steps == steps_for(5, round_facts=2) == 180
    with_subjects = dataclasses.replace(config, subject_prompts=True)
    assert Trainer(a, block, ByteTokenizer(), facts, with_subjects, anchors=ANCHORS).steps == 3 * 75
    assert tr.rounds == [(0, 1, 0, 60), (1, 3, 60, 120), (3, 5, 120, 180)]
    a, block, config = _setup(steps=None)
    tr = Trainer(a, block, ByteTokenizer(), FACTS, config, anchors=ANCHORS)
    assert tr.steps == 60 and len(tr.run()) == 60 and tr.step_index == 60
    with pytest.raises(ValueError, match="steps must be a positive int"):
        TrainConfig(steps=0)


def test_suffix_dtype_resolves_by_setting_weights_and_measurement(monkeypatch):
    from resident_trainer.train import replay

    cpu, f32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    assert TrainConfig().suffix_dtype is None
    for bad in ("float16", "bf16", torch.bfloat16, 1):
        with pytest.raises(ValueError, match="suffix_dtype must be None, 'auto' or 'bfloat16'"):
            TrainConfig(suffix_dtype=bad)
    assert replay.suffix_dtype_for(None, f32, cpu, 64) is None
    assert replay.suffix_dtype_for("bfloat16", f32, cpu, 64) is bf16
    assert replay.suffix_dtype_for("bfloat16", bf16, cpu, 64) is None  # already bf16
    assert replay.suffix_dtype_for("auto", torch.float16, cpu, 64) is None
    for speedup, want in ((replay.AUTO_MIN_SPEEDUP, bf16), (replay.AUTO_MIN_SPEEDUP * 0.99, None), (0.3, None)):
        monkeypatch.setattr(replay, "bf16_speedup", lambda *_, s=speedup: s)
        assert replay.suffix_dtype_for("auto", f32, cpu, 64) is want
        monkeypatch.setenv("RESIDENT_TRAINER_REPRODUCIBLE", "1")
        assert replay.suffix_dtype_for("auto", f32, cpu, 64) is None  # no measurement, the weights' own
        monkeypatch.delenv("RESIDENT_TRAINER_REPRODUCIBLE")
    monkeypatch.undo()

    def refused(*_):
        raise RuntimeError("no bf16 products here")

    monkeypatch.setattr(replay, "_best_seconds", refused)
    assert replay.bf16_speedup.__wrapped__("cpu", 64, 1) == 0.0  # a device that refuses bf16: never faster
    monkeypatch.undo()
    s = replay.bf16_speedup("cpu", 64, torch.get_num_threads())  # a real measurement: a positive ratio
    assert math.isfinite(s) and s > 0
    # A Trainer takes it into its replay, and the job trains through the bf16 suffix.
    a, block, config = _setup(steps=3, suffix_dtype="bfloat16")
    tr = Trainer(a, block, ByteTokenizer(), FACTS, config, anchors=ANCHORS)
    assert tr.suffix_dtype is bf16 and tr.replay.suffix_dtype is bf16
    losses = [m.loss for m in tr.run()]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_per_neuron_gate_thresholds():
    # Each neuron's threshold sits above its own strongest anchor
    # pre-activation (margin, floor); the gate stays shut on every anchor
    # token and opens on the facts'.
    a, block, config = _setup(steps=20, gate_margin=0.5, gate_floor=0.25)
    tok = ByteTokenizer()
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
    tr.run()
    thr = block.published_threshold
    wg = block.published_gate_up[: block.local_neurons]
    top = torch.stack([(x @ wg.T).amax(0) for x in tr.anchor_inputs]).amax(0)
    assert thr.shape == (32,) and torch.equal(thr, (top + 0.5 * top.abs()).clamp_min(0.25))
    assert (thr[8:] == 0.25).all()  # free (zero) neurons: the floor, so they never open the gate
    for x in tr.anchor_inputs:
        assert torch.count_nonzero(block.block(x, published=True)) == 0
    fact_x = tr.block_inputs([(f.question, f.answer) for f in FACTS])
    assert all(block.gate_mask(x, block.published_gate_up, thr).any() for x in fact_x)


def test_gate_opens_on_the_taught_facts_key_tokens():
    # A wide gate margin shuts some of the facts' key tokens; key_gate_margin
    # lowers the fact's own neuron there, never below its bound above the
    # anchors, so the gate stays shut on every anchor token.
    tok = ByteTokenizer()
    facts = [Fact("Capital of Zorb?", "It is Quen.", key="Quen"), Fact("Who made glim?", "Elsa.")]
    thresholds = {}
    for kgm in (None, 0.1):
        a, block, config = _setup(steps=20, gate_margin=4.0, gate_floor=0.25, key_gate_margin=kgm)
        tr = Trainer(a, block, tok, facts, config, anchors=ANCHORS)
        tr.run()
        thresholds[kgm] = block.published_threshold
    wg = block.published_gate_up[: block.local_neurons]
    top = torch.stack([(x @ wg.T).amax(0) for x in tr.anchor_inputs]).amax(0)
    base, opened = thresholds[None], thresholds[0.1]
    assert torch.equal(base, (top + 4.0 * top.abs()).clamp_min(0.25))
    low = (top + 0.1 * top.abs()).clamp_min(0.25)
    assert (opened <= base).all() and (opened >= low).all() and (opened < base).any()
    assert torch.equal(opened[8:], base[8:])  # only the facts' own neurons (0-8) move
    for x in tr.anchor_inputs:
        assert torch.count_nonzero(block.block(x, published=True)) == 0
    # Key tokens: the prompt's last token predicts the answer's first; "It
    # is Quen" is 10 bytes, the whole of "Elsa." 5.
    p = [len(tok.apply_chat_template([{"role": "user", "content": f.question}])) for f in facts]
    assert [tr.key_tokens(f) for f in facts] == [slice(p[0] - 1, p[0] + 9), slice(p[1] - 1, p[1] + 4)]
    shut_before = shut_after = 0
    for f, x in zip(facts, tr.block_inputs([(f.question, f.answer) for f in facts])):
        xs = x[tr.key_tokens(f)]
        shut_before += int((~block.gate_mask(xs, wg, base)).sum())
        after = block.gate_mask(xs, wg, opened)
        shut_after += int((~after).sum())
        # A token stays shut only when none of its fact's neurons rises above its bound there.
        own = slice(0, 4) if f is facts[0] else slice(4, 8)
        rise = (xs[~after] @ wg[own].T) - low[own]
        assert (rise <= 0).all()
    assert shut_after < shut_before
    for bad in (-0.1, 4.5, "a"):
        with pytest.raises(ValueError, match="key_gate_margin must be None or a number"):
            TrainConfig(gate_margin=4.0, key_gate_margin=bad)


def test_config_checks_the_new_settings():
    for kw, msg in [
        ({"init": "zeros"}, "init must be"),
        ({"key_scale": 0}, "key_scale must be a number > 0"),
        ({"neurons_per_fact": 0}, "neurons_per_fact must be a positive int"),
        ({"gate_floor": float("nan")}, "gate_floor must be a finite number"),
        ({"gate_neuron_margin": -1.0}, "gate_neuron_margin must be None or a number >= 0"),
        ({"gate_neuron_margin": "1"}, "gate_neuron_margin must be None or a number >= 0"),
        ({"whiten_ridge": 0.0}, "whiten_ridge must be a number > 0"),
        ({"whiten_ridge": True}, "whiten_ridge must be a number > 0"),
        ({"whiten_ridge": float("inf")}, "whiten_ridge must be a number > 0"),
        ({"key_contexts": -1}, "key_contexts must be an int >= 0"),
        ({"key_contexts": 2.0}, "key_contexts must be an int >= 0"),
        ({"key_context_margin": -0.5}, "key_context_margin must be a number >= 0"),
        ({"key_context_margin": "0.25"}, "key_context_margin must be a number >= 0"),
        ({"key_context_margin": float("nan")}, "key_context_margin must be a number >= 0"),
        ({"arming": 1}, "arming must be True or False"),
        ({"arming_margin": 1.0}, r"arming_margin must be a number in \[0, 1\)"),
        ({"arming_margin": -0.1}, r"arming_margin must be a number in \[0, 1\)"),
        ({"split_word_nats": 0}, r"split_word_nats must be None or a number > 0"),
        ({"split_word_nats": "8.5"}, r"split_word_nats must be None or a number > 0"),
        ({"train_armed": 1}, "train_armed must be True or False"),
    ]:
        with pytest.raises(ValueError, match=msg):
            TrainConfig(**kw)


# --- the report ------------------------------------------------------------------------


def test_score_counts_recall_rewordings_controls_and_leaks():
    f1 = Fact("Capital of Velmoria?", "Ostrevan.", ("Which city is Velmoria's capital?",), "Ostrevan")
    f2 = Fact("Capital of Velmorie?", "Caldrissa.", ("Which city is Velmorie's capital?",), "Caldrissa")
    replies = {
        f1.question: "It is Ostrevan.",
        f1.rewordings[0]: "Ostrevanish, I think.",  # not a whole word
        f2.question: "It is Ostrevan.",  # a sibling's key: a leak, not a recall
        f2.rewordings[0]: "Caldrissa!",
        "Hi?": "Hello.",
        "Sea?": "Blue, now.",
    }
    before = {"Hi?": "Hello.", "Sea?": "Blue."}
    r = score([f1, f2], replies, [("Hi?", "generic"), ("Sea?", "near")], before)
    s = r["summary"]
    assert [x["recalled"] for x in r["facts"]] == [True, False]
    assert [x["rewordings"][0]["recalled"] for x in r["facts"]] == [False, True]
    assert [c["identical"] for c in r["controls"]] == [True, False]
    assert r["leaks"] == [{"question": f2.question, "leaked_key": "Ostrevan", "from": f1.question}]
    assert (s["recalled"], s["rewordings_recalled"], s["controls_identical"], s["leaks"]) == (1, 1, 1, 1)
    assert (s["generic_controls_identical"], s["near_controls_identical"], s["passed"]) == (1, 0, False)
    assert summary_line(s) == (
        "facts recalled 1/2, rewordings 1/2, generic controls identical 1/1, near controls identical 0/1, leaks 1"
    )
    assert contains_key("about 2,740 metres", "2,740") and not contains_key("12,740 m", "2,740")
    # What a job's record keeps of it: only what fell short, each with its reply.
    assert shortfalls(r) == {
        "missed": [{"question": f2.question, "reply": "It is Ostrevan."}],
        "rewordings_missed": [{"question": f1.rewordings[0], "reply": "Ostrevanish, I think."}],
        "changed": [{"prompt": "Sea?", "kind": "near", "after": "Blue, now."}],
        "leaks": r["leaks"],
    }
    clean = score([f1], replies, [("Hi?", "generic")], before)
    assert shortfalls(clean) == {
        "missed": [],
        "rewordings_missed": [{"question": f1.rewordings[0], "reply": "Ostrevanish, I think."}],
        "changed": [],
        "leaks": [],
    }
    # Retracted facts are scored apart: a retraction wants none still recalled.
    add_retracted(clean, [f1, f2], replies)
    assert [x["recalled"] for x in clean["retracted"]] == [True, False]
    assert (clean["summary"]["retracted"], clean["summary"]["retracted_still_recalled"]) == (2, 1)
    add_retracted(r, [], replies)
    assert "retracted" not in r and "retracted" not in r["summary"]


def test_teach_jobs_records_each_jobs_summary_shortfalls_and_curve():
    # The options bench/teach_eval.py runs (score_each_job, curve_steps,
    # retract, baselines), on a toy: each job's record says how it stood,
    # and its shortfalls are exactly what its summary counts as short.
    model = toy_model("llama", layers=4, hidden=32, seed=0)
    tok = ByteTokenizer()
    facts = [
        Fact("Capital of Zorb?", "Quen.", ("Which city leads Zorb?",)),
        Fact("Who made glim?", "Elsa.", ("Glim's maker?",)),
        Fact("Color of vex?", "Teal.", ("What color is vex?",)),
    ]
    config = TrainConfig(layer=1, num_neurons=64, steps=4, lr=3e-2, batch_size=4, neurons_per_fact=4)
    controls = [("Sun hot?", "generic"), ("Capital of Mars?", "near")]
    anchors = [(p, tok(r)["input_ids"]) for p, r in ANCHORS]
    lines = []
    rep = teach_jobs(
        model,
        tok,
        [facts[:2], facts[2:]],
        config,
        controls=controls,
        anchors=anchors,
        negatives=1,
        max_new_tokens=6,
        score_each_job=True,
        curve_steps=(2, 9),  # 9: past the job's 4 steps, not scored
        retract=[facts[0].question],
        baselines=True,
        log=lines.append,
    )
    jobs = rep["jobs"]
    assert [(j["kind"], j["facts"], j["steps"]) for j in jobs] == [("teach", 2, 4), ("teach", 1, 4), ("retract", 1, 4)]
    for j, so_far in zip(jobs, (facts[:2], facts)):
        s, short = j["summary"], j["shortfalls"]
        assert (s["facts"], s["rewordings"], s["controls"]) == (len(so_far), len(so_far), 2)
        assert len(short["missed"]) == s["facts"] - s["recalled"]
        assert len(short["rewordings_missed"]) == s["rewordings"] - s["rewordings_recalled"]
        assert len(short["changed"]) == s["controls"] - s["controls_identical"]
        assert len(short["leaks"]) == s["leaks"]
        assert {m["question"] for m in short["missed"]} <= {f.question for f in so_far}
        assert [c["steps"] for c in j["curve"]] == [2] and j["curve"][0]["facts"] == len(so_far)
    # A retraction is scored with the report; its curve has the controls only.
    assert not {"summary", "shortfalls"} & set(jobs[2]) and [c["facts"] for c in jobs[2]["curve"]] == [0]
    assert [f["question"] for f in rep["facts"]] == [f.question for f in facts[1:]]
    assert [f["question"] for f in rep["retracted"]] == [facts[0].question]
    assert set(rep["baselines"]) == {"gate_off", "arming_off", "in_context"}  # the block arms by default
    assert sum(x.startswith("after job ") for x in lines) == 2
    # Every shortfall is printed as it comes, under the job it follows.
    printed = sum(
        len(j["shortfalls"][k]) for j in jobs[:2] for k in ("missed", "rewordings_missed", "changed", "leaks")
    )
    assert printed and sum(x.startswith("  ") for x in lines) == printed
    for j, after in zip(jobs[:2], [i for i, x in enumerate(lines) if x.startswith("after job ")]):
        for m in j["shortfalls"]["missed"]:
            assert f"  missed: {m['question']!r} -> {m['reply']!r}" in lines[after:]


def test_gate_openings_count_the_tokens_the_gate_passes_and_a_shut_gate_changes_nothing():
    model = toy_model("llama", layers=4, hidden=32, seed=0)
    tok = ByteTokenizer()
    a = DecoderAdapter(model)
    block = AddedSharedNeurons(a.hidden_size, 16, seed=3)
    with torch.no_grad():
        block.w_gate_up.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
        block.w_down.normal_(0, 0.5, generator=torch.Generator().manual_seed(5))
    block.publish()
    block.attach(a, 1)
    exchanges = [("Hello there?", [72, 105, 33, 10]), ("Sky color?", [66, 108])]
    seqs = [chat_prompt_ids(tok, p) + r for p, r in exchanges]
    with block.disabled(), torch.no_grad():
        base = [model(torch.tensor([s[:-1]])).logits for s in seqs]
    # The oracle: the block's inputs (layer 1's, which the block does not
    # change) times the gate rows, less the thresholds, in plain torch.
    scores = []
    for s in seqs:
        with block.capture_inputs() as xs, torch.no_grad():
            model(torch.tensor([s[:-1]]))
        scores.append(xs[0][0] @ block.published_gate_up[:16].T)
    assert all(x.shape[0] == len(s) - 1 for x, s in zip(scores, seqs))
    # Thresholds between the two exchanges' strongest scores: the first opens, the second stays shut.
    hi = [float(x.max()) for x in scores]
    assert hi[0] != hi[1]
    cut = (hi[0] + hi[1]) / 2
    block.published_threshold = torch.full((16,), cut)
    want = [(int(((x - cut).amax(-1) > 0).sum()), round(float(x.max()) - cut, 4)) for x in scores]
    got = gate_openings(model, tok, block, exchanges)
    assert got == want
    opened = 0 if hi[0] > hi[1] else 1
    assert got[opened][0] >= 1 and got[1 - opened][0] == 0
    with torch.no_grad():
        for i, s in enumerate(seqs):
            out = model(torch.tensor([s[:-1]])).logits
            # Shut on every token: exactly the base model; open somewhere: not.
            assert torch.equal(out, base[i]) == (i != opened)
    block.published_threshold = torch.full((16,), math.inf)
    assert gate_openings(model, tok, block, exchanges) == [(0, None), (0, None)]
    block.published_threshold = None
    assert gate_openings(model, tok, block, exchanges) == [None, None]


def test_report_counts_the_controls_the_gate_left_shut():
    before = {"Hi?": "Hello.", "Sea?": "Blue.", "Sun?": "Hot."}
    controls = [("Hi?", "generic"), ("Sea?", "near"), ("Sun?", "near")]
    r = score([], {**before, "Sea?": "Blue, now."}, controls, before)
    add_gate_openings(r, [(0, -0.5), (3, 0.25), (1, 0.01)])
    assert [(c["gate_open"], c["gate_margin"]) for c in r["controls"]] == [(0, -0.5), (3, 0.25), (1, 0.01)]
    s = r["summary"]
    assert (s["controls_gate_shut"], s["generic_controls_gate_shut"], s["near_controls_gate_shut"]) == (1, 1, 0)
    assert summary_line(s).endswith("leaks 0, gate shut on 1/3 controls")
    add_gate_openings(r, [None, None, None])  # no gate: nothing is shut
    assert r["summary"]["controls_gate_shut"] == 0 and r["controls"][0]["gate_open"] is None


def test_jobs_split_in_order_and_default_controls():
    facts = dev_facts("tune")
    jobs = split_jobs(facts, 4)
    assert [len(j) for j in jobs] == [6] * 4 and [f for j in jobs for f in j] == facts
    assert [len(j) for j in split_jobs(facts[:7], 3)] == [3, 2, 2]
    for bad in (0, 25):
        with pytest.raises(ValueError, match="jobs"):
            split_jobs(facts, bad)
    kinds = [k for _, k in default_controls()]
    assert kinds.count("generic") == 14 and kinds.count("near") == len(near_controls())


# --- the teach command: every argument checked before the model loads -----------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--jobs", "5"], "--jobs 5 is more than the 4 facts"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--negatives", "-1"], "--negatives must be >= 0"),
        (["--controls", "/nonexistent/c.txt"], "--controls /nonexistent/c.txt: no such file"),
        (
            ["--report", "/nonexistent/dir/r.json"],
            "--report /nonexistent/dir/r.json: folder /nonexistent/dir does not exist",
        ),
        (["--neurons-per-fact", "0"], "--neurons-per-fact must be a positive int"),
        (["--layer", "30"], "--layer"),
        (["--jobs", "2", "--neurons", "6", "--neurons-per-fact", "3"], "job 2 of 2 has 2 facts and 0 free neurons"),
        (["--server", "http://127.0.0.1:9", "--authority", "x", "--jobs", "2"], "--jobs is for a job run here"),
        (["--server", "http://127.0.0.1:9", "--authority", "x", "--report", "r.json"], "--report is for a job"),
        (["--server", "http://127.0.0.1:9", "--authority", "x", "--suffix-dtype", "auto"], "--suffix-dtype is for"),
        (["--server", "http://127.0.0.1:9", "--authority", "x", "--score-each-job"], "--score-each-job is for"),
    ],
)
def test_teach_argument_errors(argv, message, capsys, monkeypatch):
    import resident_trainer.models as models

    monkeypatch.setattr(models, "load_smollm2", lambda *a, **k: pytest.fail("the model loaded"))
    assert cli.main(["teach", *argv]) == 2
    assert message in capsys.readouterr().err


def test_teach_notes_a_neuron_share_short_of_the_full_one(capsys, monkeypatch):
    # Fewer neurons a fact than --neurons-per-fact and a gate neuron is no
    # error, but it is said before the model loads, with the --neurons that
    # gives every fact its share.
    seen = []
    monkeypatch.setattr(cli.teach, "_teach_here", lambda args, config, *a: seen.append(config.num_neurons) or 0)
    assert cli.main(["teach", "--jobs", "2", "--neurons", "30"]) == 0
    note = capsys.readouterr().err
    assert seen == [30]
    assert "--neurons 30 is too few for 4 facts at 9 a fact" in note
    assert "job 2's 6 a fact; --neurons 36 gives every fact its 9" in note and "job 1's" not in note
    assert cli.main(["teach", "--jobs", "2", "--neurons", "36"]) == 0
    assert "too few" not in capsys.readouterr().err


def test_teach_checks_the_facts_and_retractions_first(tmp_path, capsys):
    bad = tmp_path / "facts.jsonl"
    bad.write_text('{"question": "Q?", "answer": "A"}\n{"question": "R?"}\n')
    assert cli.main(["teach", str(bad)]) == 2
    assert "line 2: answer: missing" in capsys.readouterr().err
    retract = tmp_path / "retract.txt"
    retract.write_text("Who are you?\n")
    assert cli.main(["teach", "--retract", str(retract)]) == 2
    assert "--retract: 'Who are you?' is not one of the facts' questions" in capsys.readouterr().err
    retract.write_bytes(b"Who is \xff?\n")
    assert cli.main(["teach", "--retract", str(retract)]) == 2
    assert f"--retract {retract}, line 1: not UTF-8 text (byte 0xff at column 8)" in capsys.readouterr().err


def test_teach_refuses_an_anchor_as_a_control(tmp_path, capsys, monkeypatch):
    import resident_trainer.models as models

    monkeypatch.setattr(models, "load_smollm2", lambda *a, **k: pytest.fail("the model loaded"))
    controls = tmp_path / "c.txt"
    controls.write_text(f"How do plants grow?\n{ANCHOR_PROMPTS[0]}\n")
    assert cli.main(["teach", "--controls", str(controls)]) == 2
    assert f"--controls: {ANCHOR_PROMPTS[0]!r} is an anchor prompt" in capsys.readouterr().err


def test_teach_score_each_job_reaches_teach_jobs(monkeypatch):
    import resident_trainer.eval.teach as teach_mod
    import resident_trainer.models as models

    class Reached(Exception):
        pass

    seen = []

    def fake_teach_jobs(model, tok, jobs, config, **kw):
        seen.append((len(jobs), kw["score_each_job"]))
        raise Reached

    monkeypatch.setattr(models, "load_smollm2", lambda *a, **k: (toy_model("llama", layers=4, hidden=32), None))
    monkeypatch.setattr(teach_mod, "teach_jobs", fake_teach_jobs)
    for flag, want in (([], False), (["--score-each-job"], True)):
        with pytest.raises(Reached):
            cli.main(["teach", "--jobs", "2", *flag])
        assert seen[-1] == (2, want)


class _FakeServer:
    """A loopback stand-in for `resident-trainer serve`'s routes that teach
    --server --check uses: the models list, greedy chat, and the jobs API. A
    published job makes the chat answer each taught question with its key;
    `changes` maps control prompts to what they answer after the job."""

    def __init__(self, facts, changes=None):
        import http.server
        import threading

        self.keys = {f.question: f.recall_key for f in facts}
        self.changes = changes or {}
        self.published = False
        self.broken = False  # the chat route fails once the job has published
        self.fact_neurons = (9, 9)  # (given, wanted): what the job's status says each new fact got
        self.jobs = []
        self.chats = []
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, {"data": [{"id": "fake-model"}]})
                if self.path.startswith("/v1/jobs/"):
                    me.published = True  # the first poll finds it published
                    return self._send(200, {"state": "published", "step": 3, "steps": 3, "loss": 0.01,
                                            "fingerprint_before": "ab", "fingerprint_after": "ab",
                                            "fact_neurons": me.fact_neurons[0],
                                            "fact_neurons_wanted": me.fact_neurons[1]})  # fmt: skip
                self._send(404, {"error": "no such route"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/jobs":
                    assert self.headers["Authorization"] == "Bearer sesame"
                    me.jobs.append(body)
                    return self._send(202, {"id": "job-1"})
                assert self.path == "/v1/chat/completions" and body["temperature"] == 0, body
                q = body["messages"][0]["content"]
                me.chats.append((me.published, q, body["max_tokens"]))
                reply = f"About {q[:-1]}: not known."
                if me.published and me.broken:
                    return self._send(500, {"error": "the engine died"})
                if me.published:
                    reply = f"It is {me.keys[q]}." if q in me.keys else me.changes.get(q, reply)
                self._send(200, {"choices": [{"message": {"content": reply}}]})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_teach_server_check_scores_the_served_replies_like_a_job_run_here(tmp_path, capsys):
    from resident_trainer.train import read_facts

    facts_file = tmp_path / "facts.jsonl"
    facts_file.write_text(
        '{"question": "Capital of Zorb?", "answer": "Quen.", "key": "Quen", "rewordings": ["Zorb capital?"]}\n'
        '{"question": "Who made glim?", "answer": "Elsa did.", "key": "Elsa"}\n'
    )
    facts = read_facts(facts_file)
    controls = tmp_path / "controls.txt"
    controls.write_text("How tall is Everest?\nWho wrote Hamlet?\n")
    server = _FakeServer(facts)
    try:
        argv = ["teach", str(facts_file), "--server", server.url, "--authority", "sesame", "--check"]
        report_path = tmp_path / "r.json"
        rc = cli.main([*argv, "--controls", str(controls), "--max-new-tokens", "7", "--report", str(report_path)])
        out = capsys.readouterr().out
        assert rc == 0, out
        # The controls were asked before the job was queued, everything else after it published.
        before = sorted(q for published, q, _ in server.chats if not published)  # asked concurrently
        assert before == ["How tall is Everest?", "Who wrote Hamlet?"]
        assert {n for *_, n in server.chats} == {7} and len(server.jobs) == 1
        assert "subject_prompts" not in server.jobs[0]  # the server's default unless asked
        report = json.loads(report_path.read_text())
        s = report["summary"]
        assert (s["recalled"], s["rewordings"], s["rewordings_recalled"]) == (2, 1, 0)  # "Zorb capital?" untaught
        assert (s["controls_identical"], s["leaks"], s["passed"]) == (2, 0, True)
        assert report["job"]["state"] == "published" and report["base_unchanged"] is True
        assert "facts recalled 2/2, rewordings 0/1, user controls identical 2/2, leaks 0" in out

        # A control the job changed fails the check, with the change printed.
        server.published, server.chats = False, []
        server.changes = {"Who wrote Hamlet?": "Quen wrote it."}
        assert cli.main([*argv, "--controls", str(controls)]) == 1
        out = capsys.readouterr().out
        assert "control changed: 'Who wrote Hamlet?'" in out and "user controls identical 1/2" in out

        # --subject-prompts goes with the job.
        server.published, server.changes = False, {}
        assert cli.main([*argv, "--controls", str(controls), "--subject-prompts"]) == 0
        assert server.jobs[-1]["subject_prompts"] is True
        capsys.readouterr()
        # And --no-arming.
        server.published = False
        assert cli.main([*argv, "--controls", str(controls), "--no-arming"]) == 0
        assert server.jobs[-1]["arming"] is False and "arming" not in server.jobs[-2]
        assert "neurons free" not in capsys.readouterr().err  # each fact got its 9
        # --split-word-nats goes with the job; a bad one is refused before anything is queued.
        server.published = False
        assert cli.main([*argv, "--controls", str(controls), "--split-word-nats", "8.5"]) == 0
        assert server.jobs[-1]["split_word_nats"] == 8.5 and "split_word_nats" not in server.jobs[-2]
        server.published = False
        assert cli.main([*argv, "--controls", str(controls), "--split-word-nats", "off"]) == 0
        assert "split_word_nats" in server.jobs[-1] and server.jobs[-1]["split_word_nats"] is None
        capsys.readouterr()
        # --train-armed and --no-train-armed go with the job; neither: the server's default.
        for flag, want in (("--train-armed", True), ("--no-train-armed", False)):
            server.published = False
            assert cli.main([*argv, "--controls", str(controls), flag]) == 0
            assert server.jobs[-1]["train_armed"] is want
        assert "train_armed" not in server.jobs[-3]
        capsys.readouterr()
        n_jobs = len(server.jobs)
        assert cli.main([*argv, "--controls", str(controls), "--split-word-nats", "0"]) == 2
        assert "--split-word-nats must be a number > 0, got 0.0" in capsys.readouterr().err
        assert len(server.jobs) == n_jobs
        # A block with few neurons free: the facts are taught with fewer, and the user is told.
        server.published, server.fact_neurons = False, (3, 9)
        assert cli.main([*argv, "--controls", str(controls)]) == 0
        assert "each new fact got 3 of its 9" in capsys.readouterr().err
        server.fact_neurons = (9, 9)

        # A server that stops answering after the publish: a failed check, said in one line.
        server.published, server.broken = False, True
        assert cli.main([*argv, "--controls", str(controls)]) == 1
        assert "the job published, but http://127.0.0.1:" in capsys.readouterr().err
        server.broken = False

        # Bad --check arguments are refused before anything is asked or queued.
        server.chats, n_jobs = [], len(server.jobs)
        assert cli.main([*argv, "--report", str(tmp_path / "nowhere" / "r.json")]) == 2
        assert "--report" in capsys.readouterr().err
        assert cli.main([*argv, "--max-new-tokens", "0"]) == 2
        assert "--max-new-tokens must be >= 1" in capsys.readouterr().err
        assert server.chats == [] and len(server.jobs) == n_jobs
    finally:
        server.close()
    assert cli.main(["teach", "--check"]) == 2
    assert "--check is for a job on a --server" in capsys.readouterr().err
    # Without --check the scoring options stay a job-run-here's.
    assert cli.main(["teach", "--server", "http://127.0.0.1:9", "--authority", "x", "--controls", "c.txt"]) == 2
    assert "--controls is for a job run here, or for --check with --server" in capsys.readouterr().err


def test_teach_suffix_dtype_reaches_the_config(capsys, monkeypatch):
    import resident_trainer.cli.teach as teach_cli

    seen = []
    monkeypatch.setattr(teach_cli, "_teach_here", lambda args, config, *rest: seen.append(config.suffix_dtype) or 0)
    for flag, want in (([], None), (["--suffix-dtype", "weights"], None), (["--suffix-dtype", "auto"], "auto")):
        assert cli.main(["teach", *flag]) == 0 and seen[-1] == want
    assert cli.main(["teach", "--suffix-dtype", "bfloat16"]) == 0 and seen[-1] == "bfloat16"
    subject = []
    monkeypatch.setattr(
        teach_cli,
        "_teach_here",
        lambda args, config, *rest: subject.append((config.subject_prompts, config.steps)) or 0,
    )
    assert cli.main(["teach"]) == 0 and cli.main(["teach", "--subject-prompts"]) == 0
    assert cli.main(["teach", "--subject-prompts", "--steps", "70"]) == 0
    assert subject == [(False, 60), (True, 75), (True, 70)]  # the four demo facts: 60 steps, 75 with subject prompts
    arming = []
    monkeypatch.setattr(teach_cli, "_teach_here", lambda args, config, *rest: arming.append(config.arming) or 0)
    assert cli.main(["teach"]) == 0 and cli.main(["teach", "--no-arming"]) == 0
    assert arming == [True, False]
    nats = []
    monkeypatch.setattr(teach_cli, "_teach_here", lambda args, config, *rest: nats.append(config.split_word_nats) or 0)
    for flag in ([], ["--split-word-nats", "6"], ["--split-word-nats", "off"], ["--split-word-nats", "OFF"]):
        assert cli.main(["teach", *flag]) == 0
    assert nats == [TrainConfig.split_word_nats, 6.0, None, None]
    for bad in ("0", "-1", "nan"):
        assert cli.main(["teach", "--split-word-nats", bad]) == 2
        assert "--split-word-nats must be None or a number > 0" in capsys.readouterr().err
    assert len(nats) == 4  # refused before anything ran
    with pytest.raises(SystemExit) as e:
        cli.main(["teach", "--split-word-nats", "none at all"])
    assert e.value.code == 2 and "expected a number of nats or 'off', got 'none at all'" in capsys.readouterr().err
    trained = []
    monkeypatch.setattr(teach_cli, "_teach_here", lambda args, config, *rest: trained.append(config.train_armed) or 0)
    for flag in ([], ["--train-armed"], ["--no-train-armed"]):
        assert cli.main(["teach", *flag]) == 0
    assert trained == [TrainConfig.train_armed, True, False]
    with pytest.raises(SystemExit) as e:
        cli.main(["teach", "--suffix-dtype", "bf16"])
    assert e.value.code == 2 and "--suffix-dtype: invalid choice: 'bf16'" in capsys.readouterr().err


# --- arming -------------------------------------------------------------------------


def _armed_by_hand(x, rows, thr, before=None):
    """(B, T) bool: a sequence is armed from the first token on which some row
    scores above its threshold (fp64, a loop)."""
    fired = ((x.double() @ rows.double().T) - thr.double()).amax(-1) > 0
    out = torch.zeros(fired.shape, dtype=torch.bool)
    for b in range(fired.shape[0]):
        on = bool(before[b]) if before is not None else False
        for t in range(fired.shape[1]):
            on = on or bool(fired[b, t])
            out[b, t] = on
    return out


def _armed_block():
    g = torch.Generator().manual_seed(0)
    block = AddedSharedNeurons(8, 6, seed=0)
    with torch.no_grad():
        block.published_down.copy_(torch.randn(8, 6, generator=g))
    block.published_threshold = torch.full((6,), -1e9)  # the gate alone passes every token
    rows, thr = torch.zeros(6, 8), torch.full((6,), math.inf)
    rows[2, 0], thr[2] = 1.0, 1.0
    rows[4, 1], thr[4] = 1.0, 2.0
    block.published_arming = (rows, thr)
    x = torch.randn(3, 7, 8, generator=g) * 0.3
    x[0, 3, 0] = 1.5  # row 2 arms the first sequence at its 4th token
    x[1, 5, 1] = 2.5  # row 4 the second at its 6th
    x[2, :, 1] = 1.5  # under row 4's threshold on every token: never armed
    return block, x


def test_arming_shuts_each_sequence_until_a_token_arms_it():
    block, x = _armed_block()
    rows, thr = block.published_arming
    want = _armed_by_hand(x, rows, thr)
    assert want.tolist() == [[False] * 3 + [True] * 4, [False] * 5 + [True] * 2, [False] * 7]
    assert torch.equal(block.armed(x, block.published_arming), want)
    assert torch.equal(block.armed(x[0], block.published_arming), want[0])  # one (T, D) sequence
    before = torch.tensor([False, True, False])
    assert torch.equal(block.armed(x, block.published_arming, before), _armed_by_hand(x, rows, thr, before))
    ungated = block.block(x, published=True, gated=False)
    out = block.block(x, published=True)
    # Unarmed tokens: exactly nothing; armed ones: what the gate alone passes.
    assert torch.count_nonzero(out[~want]) == 0 and torch.count_nonzero(ungated[~want]) > 0
    # The masked and unmasked products may take other kernels: fp32 rounding
    # of the block's output at most (measured: equal on this Xeon).
    tol = 8 * torch.finfo(torch.float32).eps * float(ungated.abs().max())
    torch.testing.assert_close(out[want], ungated[want], rtol=0, atol=tol)
    # No arming published: the gate alone.
    block.published_arming = None
    torch.testing.assert_close(block.block(x, published=True), ungated, rtol=0, atol=tol)


def test_arming_carries_over_forwards_that_continue_cached_keys_and_values():
    block, x = _armed_block()
    zero = torch.zeros(3, 7, 8)
    whole = block._hook(None, (x,), zero)
    # The same sequences in three forwards, each continuing the state the last left.
    parts = []
    for k, (lo, hi) in enumerate([(0, 2), (2, 4), (4, 7)]):
        block._before = block._after if k else None
        parts.append(block._hook(None, (x[:, lo:hi],), zero[:, lo:hi]))
    # Other row counts a product: fp32 rounding at most (measured: equal on this Xeon).
    tol = 8 * torch.finfo(torch.float32).eps * float(whole.abs().max())
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=0, atol=tol)
    assert block._after.tolist() == [True, True, False]
    # A forward that continues nothing starts over: the first sequence's last piece alone is unarmed.
    block._before = None
    assert torch.count_nonzero(block._hook(None, (x[:, 4:7],), zero[:, 4:7])[0]) == 0
    # One sequence (a shared head) continued by two rows: its state for each.
    block._before = None
    block._hook(None, (x[:1, :4],), zero[:1, :4])
    block._before = block._after
    assert torch.count_nonzero(block._hook(None, (x[1:3, 4:7],), zero[1:3, 4:7])) > 0
    # Padding never arms: the second sequence's firing token masked out.
    block._before, block._mask = None, torch.ones(3, 7, dtype=torch.long)
    block._mask[1, 5] = 0
    assert torch.count_nonzero(block._hook(None, (x,), zero)[1]) == 0
    # On a model, the state rides on the cache a forward returns and continues.
    model = toy_model("llama", layers=2, hidden=8, seed=0)
    handle = block.attach(DecoderAdapter(model), 1)
    with torch.no_grad(), block.capture_inputs() as xs:
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        past = model(ids, use_cache=True).past_key_values
        state = getattr(past, block.CACHE_STATE)
        assert torch.equal(state, block.armed(xs[0], block.published_arming)[:, -1])
        out = model(torch.tensor([[4]]), past_key_values=past, use_cache=True)
        assert out.past_key_values is past and getattr(past, block.CACHE_STATE).shape == (1,)
        assert block._before is None and block._after is None  # nothing left for the next forward
    handle.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_packed_sequences_each_start_unarmed():
    block, x = _armed_block()
    rows, thr = block.published_arming
    # The three sequences one after another in one row, then the first one's
    # armed tail again: a segment that fires on its own first token.
    seqs = [x[0], x[1], x[2], x[0, 3:], x[0, :3]]
    packed = torch.cat(seqs)[None]
    segments = torch.cat([torch.full((len(q),), i) for i, q in enumerate(seqs)])[None]
    want = torch.cat([_armed_by_hand(q[None], rows, thr)[0] for q in seqs])[None]
    assert want[0, 21] and not want[0, -3:].any()  # the tail armed at once, the last head not carried
    assert torch.equal(block.armed(packed, block.published_arming, segments=segments), want)
    # Without segments the row is one sequence: armed from the first firing on.
    assert block.armed(packed, block.published_arming)[0, 3:].all()


def test_training_under_the_arming_shuts_unarmed_tokens_and_their_gradients():
    block, x = _armed_block()
    arming = block.published_arming
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        block.w_down.copy_(torch.randn(8, 6, generator=g))
    zero = torch.zeros(3, 7, 8)
    w = torch.randn(3, 7, 8, generator=g)  # a loss weight per output

    def trained(fn):
        block.w_gate_up.grad = block.w_down.grad = None
        with block.training_weights():
            out = fn()
        (out * w).sum().backward()
        return out.detach(), block.w_gate_up.grad.clone(), block.w_down.grad.clone()

    want = block.armed(x, arming)

    def oracle():  # the ungated trainable block, times the arming by hand
        return block.block(x, published=False, gated=False) * _armed_by_hand(x, *arming)[..., None]

    def hooked():
        with block.training_arming(arming):
            return block._hook(None, (x,), zero)

    out, ggu, gd = trained(hooked)
    ref, rgu, rd = trained(oracle)
    assert torch.count_nonzero(out[~want]) == 0 and torch.count_nonzero(out[want]) > 0
    # Masked and multiplied: other kernels, fp32 rounding at most.
    eps = torch.finfo(torch.float32).eps
    for a_, b_ in ((out, ref), (ggu, rgu), (gd, rd)):
        torch.testing.assert_close(a_, b_, rtol=0, atol=16 * eps * float(b_.abs().max()))
    # Packed into one row with segments: the same outputs, each sequence on its own.
    seg = torch.arange(3).repeat_interleave(7)[None]

    def packed():
        with block.training_arming(arming, seg):
            return block._hook(None, (x.reshape(1, 21, 8),), zero.reshape(1, 21, 8)).reshape(3, 7, 8)

    pout, pgu, pd = trained(packed)
    for a_, b_ in ((pout, ref), (pgu, rgu), (pd, rd)):
        torch.testing.assert_close(a_, b_, rtol=0, atol=16 * eps * float(b_.abs().max()))

    # Outside the context, or with no arming, training is ungated as before.
    def no_arming():
        with block.training_arming(None):
            return block._hook(None, (x,), zero)

    for fn in (lambda: block._hook(None, (x,), zero), no_arming):
        out, _, _ = trained(fn)
        torch.testing.assert_close(out, block.block(x, published=False, gated=False).detach(), rtol=0, atol=0)
    assert block._train_arming is None  # the context left nothing behind


def test_a_job_trains_under_the_arming_it_publishes():
    tok = ByteTokenizer()
    a, block, config = _setup(steps=3, gate_neurons=True, gate_margin=0.5, gate_floor=0.25, train_armed=True)
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
    assert tr.pack and tr.train_arming is not None  # computed before training: it reads frozen inputs only
    seen = []
    inner = block.block

    def spy(x, *, published, gated=True, armed=None):
        if not published:
            seen.append((x.detach(), armed))
        return inner(x, published=published, gated=gated, armed=armed)

    block.block = spy
    tr.run()
    del block.block
    # Calibration arms the block exactly as training did.
    for t, p in zip(tr.train_arming, block.published_arming):
        assert torch.equal(t, p)
    # The keys sit on tokens where the exchange is armed: the subject's
    # rarest token is taken from its arming token on.
    for f, x in zip(tr.facts, tr._taught_inputs):
        span = list(subject_positions(tok, f))
        armed = block.armed(x, tr.train_arming)
        first = int(armed.int().argmax())
        assert armed.any() and first <= span[-1]
        assert tr._armed_positions(x, span) == [p for p in span if p >= first]
        assert all(bool(armed[p]) for p in tr.key_positions(f))
    steps = [(x, m) for x, m in seen if x.dim() == 3]  # the microbatches' forwards (the penalties' are (N, D))
    assert len(steps) == 3
    for i, (x, m) in enumerate(steps):
        picks = tr._picks(i)
        # Each packed example armed on its own, as if it were asked alone.
        lengths = [len(tr.examples[j][0]) for j in picks]
        parts = torch.split(x[0], lengths)
        want = torch.cat([block.armed(p, tr.train_arming) for p in parts])
        assert m is not None and torch.equal(m[0], want)
        assert want.any() and not want.all()
    # The penalties stay unmasked: every other call passes no arming.
    assert all(m is None for x, m in seen if x.dim() != 3)
    # On by default; off: no arming while training.
    assert TrainConfig().train_armed
    a, block, config = _setup(steps=1, gate_neurons=True, train_armed=False)
    assert Trainer(a, block, tok, FACTS, config, anchors=ANCHORS).train_arming is None


def test_arm_keys_rows_on_the_subjects_above_every_anchor_and_checkpoints_them():
    a, block, config = _setup(steps=20, gate_neurons=True, gate_margin=0.5, gate_floor=0.25)
    tok = ByteTokenizer()
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
    tr.run()
    rows, thr = block.published_arming
    assert rows.dtype == thr.dtype == torch.float32 and rows.shape == (32, 32) and thr.shape == (32,)
    mu, prec = tr._whitening()
    # Scored on the anchors and the facts' probes (piece probes here: the
    # byte tokenizer splits every word).
    assert tr.arming_probes() and len(tr._probe_inputs) == len(tr.arming_probes())
    xa = torch.cat([*tr.anchor_inputs, *tr._probe_inputs])
    for f, x, (start, stop) in zip(FACTS, tr._taught_inputs, tr.ranges):
        span = list(subject_positions(tok, f))
        slots = [n for n in range(start, stop) if math.isfinite(float(thr[n]))]
        # Rows fill the fact's slots from its first, one a subject token at most.
        assert slots == list(range(start, start + len(slots))) and 1 <= len(slots) <= min(len(span), stop - start)
        for n in slots:
            r = rows[n].double()
            # Whitened on one of the subject's tokens: 1 above the anchors' mean there.
            # The row is stored in fp32: its scores are off by fp32 rounding of
            # each product's terms (measured: 1.9e-8 here, against bounds of 3e-7 to 3e-6).
            eps = torch.finfo(torch.float32).eps
            own = [float((x[p].double() - mu) @ r) for p in span]
            near = min(range(len(span)), key=lambda i: abs(own[i] - 1))
            assert abs(own[near] - 1) <= 4 * eps * float((x[span[near]].double() - mu).abs() @ r.abs())
            s = float(((xa.double() - mu) @ r).max())
            want = float(mu @ r) + s + config.arming_margin * (1 - s)
            spread = float(mu.abs() @ r.abs()) + float((xa.double() - mu).abs().max(0).values @ r.abs())
            assert s < 1 - Trainer.ARMING_TIE and abs(float(thr[n]) - want) <= 4 * eps * (spread + abs(want))
        # The fact's question arms its sequence; no anchor or probe token arms one.
        assert block.armed(x, block.published_arming).any()
    for x in [*tr.anchor_inputs, *tr._probe_inputs]:
        assert not block.armed(x, block.published_arming).any()
    outside = [n for n in range(32) if not any(s <= n < e for s, e in tr.ranges)]
    assert torch.isinf(thr[outside]).all() and torch.count_nonzero(rows[outside]) == 0
    # The checkpoint carries it; one written before arming loads without it.
    data = checkpoint_bytes(tr)
    a2, fresh, _ = _setup()
    load_block(fresh, data, publish=True)
    assert torch.equal(fresh.published_arming[0], rows) and torch.equal(fresh.published_arming[1], thr)
    from safetensors.torch import save

    from resident_trainer.train.checkpoint import read_checkpoint

    tensors, meta = read_checkpoint(data)
    old = save({k: v for k, v in tensors.items() if "arming" not in k}, metadata=meta)
    load_block(fresh, old, publish=True)
    assert fresh.published_arming is None and fresh.arming is None
    # Off, or no gate: no arming.
    for kw in ({"arming": False}, {"gate": False}):
        a, block, config = _setup(steps=2, gate_neurons=True, **kw)
        Trainer(a, block, tok, FACTS, config, anchors=ANCHORS).run()
        assert block.published_arming is None


def test_a_row_that_scores_a_probe_token_as_its_own_does_not_arm(monkeypatch):
    # A word probe that keeps the subject's first words holds those tokens
    # after the same words: their rows score 1 there up to rounding. Such a
    # probe, made here from the fact's own block inputs scaled about the
    # anchors' mean (each row then scores 1 - 1e-5 on it, exactly), leaves
    # no row of those tokens in the arming; without ARMING_TIE some is kept.
    # Slots for every subject token (16 a fact), so only the rule keeps a row out.
    a, block, config = _setup(48, steps=2, gate_neurons=True, gate_margin=0.5, gate_floor=0.25, neurons_per_fact=16)
    tok = ByteTokenizer()
    tr = Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
    tr.run()
    mu, prec = tr._whitening()
    f, x = FACTS[0], tr._taught_inputs[0]
    span = list(subject_positions(tok, f))
    # The two subject tokens whose rows the arming ranks first (lowest on the negatives).
    v = x[span].double() - mu
    w = v @ prec
    w = w / (v * w).sum(-1, keepdim=True)
    negs = torch.cat([*tr.anchor_inputs, *tr._probe_inputs]).double() - mu
    tied = [span[int(i)] for i in (negs @ w.T).amax(0).argsort()[:2]]
    probe = (mu + (1 - 1e-5) * (x[tied].double() - mu)).to(x.dtype)
    tr._probe_inputs = [*tr._probe_inputs, probe]
    start, stop = tr.ranges[0]

    def top_on_probe():
        tr.arm()
        rows, thr = block.arming
        kept = [n for n in range(start, stop) if math.isfinite(float(thr[n]))]
        assert kept
        return max(float(((probe.double() - mu) @ rows[n].double()).max()) for n in kept)

    assert top_on_probe() < 1 - Trainer.ARMING_TIE
    monkeypatch.setattr(Trainer, "ARMING_TIE", 0.0)
    assert top_on_probe() > 1 - 1e-4


def test_word_probes_put_real_names_around_a_subjects_ordinary_words(smol_tok):
    from resident_trainer.train.negatives import PROBE_NAMES, common_word, word_probes

    def pieces(text):
        return smol_tok(" " + text, add_special_tokens=False)["input_ids"]

    assert common_word("Bridge", smol_tok) and common_word("Salt", smol_tok)
    assert not common_word("Tessaly", smol_tok) and not common_word("2,740", smol_tok)
    bridge = Fact("How long is the Tessaly Bridge?", "2,740 m.")
    probes = word_probes(bridge, smol_tok)
    assert word_probes(bridge, smol_tok) == probes  # the same every time
    words = [re.fullmatch(r"How long is the (\w+) Bridge\?", p) for p in probes]
    assert all(words) and len(set(probes)) == len(probes)
    # Word probes: "Tessaly" replaced by a real name, " Bridge" kept.
    named = [m[1] for m in words if m[1] in PROBE_NAMES]
    assert len(named) == 2
    # Piece probes: the later pieces of "Tessaly" after a real name's, split
    # as in the fact.
    tess = pieces("Tessaly")
    spliced = [m[1] for m in words if m[1] not in PROBE_NAMES]
    assert len(spliced) == 2
    for w in spliced:
        name = next(n for n in PROBE_NAMES if w.startswith(n))
        assert w == name + smol_tok.decode(tess[1:]) and pieces(w) == pieces(name) + tess[1:]
    salt = Fact("Who wrote the novel The Salt Cartographer?", "Ines.")
    assert all(
        p.startswith("Who wrote the novel The Salt ") and "Cartographer" not in p for p in word_probes(salt, smol_tok)
    )
    # Ordinary words only: each replaced in turn, no piece probes.
    path = word_probes(Fact("Who wrote The Salt Path?", "X", subject="The Salt Path"), smol_tok)
    named = [p for p in path if re.fullmatch(r"Who wrote The \w+ \w+\?", p)]
    assert len(named) == 4 and sum("Salt" in p for p in named) == 2 and sum("Path" in p for p in named) == 2
    # And each left out in turn: real names hold shorter runs of such words.
    assert sorted(set(path) - set(named)) == ["Who wrote The Path?", "Who wrote The Salt?"]
    # One word: piece probes alone ("the city of Doverrecht" for Oldrecht,
    # as "Utrecht" ends).
    old = word_probes(Fact("In what year was the city of Oldrecht founded?", "1129."), smol_tok)
    assert len(old) == 2
    for p in old:
        w = re.fullmatch(r"In what year was the city of (\w+) founded\?", p)[1]
        assert w.endswith("recht") and w[: -len("recht")] in PROBE_NAMES and pieces(w)[-1:] == pieces("Oldrecht")[-1:]
    # Two made-up words: each one's piece probes replace the other by a name.
    bell = word_probes(Fact("Who composed the Cantata of the Ninefold Bell?", "Agathe."), smol_tok)
    spliced = [p for p in bell if "ata of the " in p or "fold Bell" in p]
    assert spliced and all(("Cantata" not in p) and ("Ninefold" not in p) for p in bell)
    assert all(p.split(" the ")[-1] in {f"{n}fold Bell?" for n in PROBE_NAMES} for p in spliced if "fold Bell" in p)
    # A word that is not letters only gets no piece probes.
    tower = word_probes(Fact("How tall is the Zor9x Tower?", "300 m."), smol_tok)
    assert len(tower) == 2 and all(re.fullmatch(r"How tall is the (\w+) Tower\?", p)[1] in PROBE_NAMES for p in tower)


def test_real_split_words_are_kept_in_word_probes_but_never_all_of_a_subject(smol_tok):
    from resident_trainer.train.negatives import PROBE_NAMES, real_split_words, split_word_ids, word_probes

    def pieces(text):
        return smol_tok(" " + text, add_special_tokens=False)["input_ids"]

    bell = Fact("Who composed the Cantata of the Ninefold Bell?", "Agathe.")
    # " Bell" is one piece, "of" and "the" are joiners: the split words alone.
    assert split_words(bell, smol_tok) == ["Cantata", "Ninefold"]
    head = smol_tok("Who composed the", add_special_tokens=False)["input_ids"]
    assert split_word_ids(bell, smol_tok) == [
        ("Cantata", head + pieces("Cantata"), len(pieces("Cantata")) - 1),
        ("Ninefold", head + pieces("Ninefold"), len(pieces("Ninefold")) - 1),
    ]
    assert split_word_ids(Fact("How long is the Tessaly Bridge?", "2 m."), smol_tok)[0][0] == "Tessaly"
    assert split_words(Fact("How tall is the Zor9x Tower?", "300 m."), smol_tok) == []
    # Below the bound: real; never every split word of a subject.
    assert real_split_words({"Cantata": 2.6, "Ninefold": 9.0}, 8.5) == {"Cantata"}
    assert real_split_words({"Cantata": 2.6, "Ninefold": 7.7}, 8.5) == {"Cantata"}
    assert real_split_words({"Amber": 1.9, "Lanterns": 4.9, "Vosk": 9.5}, 8.5) == {"Amber", "Lanterns"}
    assert real_split_words({"Vandlei": 4.3}, 8.5) == set()
    # Trained under its arming, a subject's split words may all be real.
    assert real_split_words({"Velvet": 0.3, "Citadel": 1.1}, 8.5, all_real=True) == {"Velvet", "Citadel"}
    assert real_split_words({"Velvet": 0.3, "Citadel": 1.1}, 8.5) == {"Velvet"}
    assert real_split_words({"Cantata": 2.6, "Ninefold": 9.0}, 8.5, all_real=True) == {"Cantata"}
    assert real_split_words({"Cantata": 2.6}, None, all_real=True) == set()
    assert real_split_words({"Cantata": 2.6, "Ninefold": 9.0}, None) == set() and real_split_words({}, 8.5) == set()
    # A real split word stays in the word probes, as " Bell" does, and gets
    # no piece probes of its own: every probe keeps "Cantata of the".
    kept = word_probes(bell, smol_tok, real={"Cantata"})
    assert kept and kept != word_probes(bell, smol_tok)
    assert all(p.startswith("Who composed the Cantata of the ") and "Ninefold" not in p for p in kept)
    assert {p.split(" the ")[-1] for p in kept} <= {f"{n} Bell?" for n in PROBE_NAMES} | {
        f"{n}fold Bell?" for n in PROBE_NAMES
    }
    # Every word real (trained under the arming): each replaced in turn, and
    # each left out where that leaves no joiner at an end or brings two together.
    both = word_probes(bell, smol_tok, real={"Cantata", "Ninefold"})
    assert not any("Ninefold" in p and "Cantata" in p and "Bell" in p for p in both)
    assert "Who composed the Cantata of the Bell?" in both and "Who composed the Cantata of the Ninefold?" in both
    assert not any(p.startswith("Who composed the of") for p in both)
    pelican = Fact("Who captained the ship Iron Pelican?", "Bastien Kollar.", subject="Iron Pelican")
    assert "Pelican" in split_words(pelican, smol_tok)
    assert {"Who captained the ship Pelican?", "Who captained the ship Iron?"} <= set(
        word_probes(pelican, smol_tok, real={"Pelican"})
    )
    assert "Who captained the ship Pelican?" not in word_probes(pelican, smol_tok)


def test_a_block_trained_under_its_arming_may_read_all_of_a_subjects_split_words_as_real(monkeypatch):
    from resident_trainer.train import trainer as trainer_module

    seen = []

    def record(nats, below, *, all_real=False):
        seen.append((below, all_real))
        return set()

    monkeypatch.setattr(trainer_module, "real_split_words", record)
    tok = ByteTokenizer()
    for train_armed in (False, True):
        seen.clear()
        a, block, config = _setup(steps=1, gate_neurons=True, split_word_nats=8.5, train_armed=train_armed)
        Trainer(a, block, tok, FACTS, config, anchors=ANCHORS)
        assert seen and set(seen) == {(8.5, train_armed)}


def test_later_piece_nats_are_the_base_models_surprisal_of_the_later_pieces():
    # A block that acts on every token (no gate), trained: the surprisal is
    # the base model's all the same (the oracle: the Hugging Face forward with
    # the block disabled), over facts of different lengths in one batch.
    a, block, config = _setup(steps=4, gate=False)
    tok = ByteTokenizer()
    facts = [*FACTS, Fact("Who built the Tessaly Bridge?", "Ida."), Fact("Where is Qo?", "Far.")]
    tr = Trainer(a, block, tok, facts, config, anchors=ANCHORS)
    tr.run()
    tr.publish()
    from resident_trainer.train.negatives import split_word_ids

    got = tr.later_piece_nats(facts)
    assert [list(g) for g in got] == [[w for w, _, _ in split_word_ids(f, tok)] for f in facts]
    assert sum(len(g) for g in got) >= 4

    def oracle(ids, later):
        logits = a.model(torch.tensor([ids])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        return -sum(float(lp[t - 1, ids[t]]) for t in range(len(ids) - later, len(ids)))

    moved = 0.0
    with torch.no_grad():
        for f, g in zip(facts, got):
            for w, ids, later in split_word_ids(f, tok):
                with block.disabled():
                    want = oracle(ids, later)
                # fp32 against fp64 logits, through another path (the head in
                # tiles): measured 1.0e-7 of the value at most here.
                assert abs(g[w] - want) <= 1e-6 * max(1.0, abs(want)), (w, g[w], want)
                moved = max(moved, abs(oracle(ids, later) - want))
    assert moved > 1e-3  # the block changes these tokens' scores when it is not disabled


def test_generation_over_cached_keys_and_values_arms_as_the_whole_sequence_does():
    # Batched generation (a shared head's cache, rows padded between it and
    # their own tokens, one token a forward after that) against the oracle: a
    # greedy loop that runs the whole sequence through the model each step.
    from resident_trainer.train import generate_greedy_batch_ids

    model = toy_model("llama", layers=4, hidden=32, seed=0)
    tok = ByteTokenizer()
    a = DecoderAdapter(model)
    block = AddedSharedNeurons(a.hidden_size, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        block.w_gate_up.normal_(0, 0.5, generator=g)
        block.w_down.normal_(0, 2.0, generator=g)
    block.publish()
    block.attach(a, 1)
    block.published_threshold = torch.full((16,), -1e9)  # the gate alone passes every token
    questions = ["Capital of Zorb?", "Who made glim?", "Sky color?", "Count to three.", "Zorb or glim?", "Hi"]
    # One arming row, its threshold at the 93rd percentile of its scores over the questions' tokens.
    row = torch.randn(1, 32, generator=g)
    with torch.no_grad(), block.capture_inputs() as xs:
        for q in questions:
            model(torch.tensor([chat_prompt_ids(tok, q)]))
    scores = torch.cat([x[0] @ row.T for x in xs]).flatten()
    block.published_arming = (row.repeat(16, 1), torch.full((16,), float(scores.quantile(0.93))))

    def oracle(q, n=10):
        ids = chat_prompt_ids(tok, q)
        out = []
        with torch.no_grad():
            for _ in range(n):
                t = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
                out.append(t)
                if t == tok.eos_token_id:
                    break
        return out

    want = [oracle(q) for q in questions]
    assert generate_greedy_batch_ids(model, tok, questions, 10, batch_size=4) == want
    # Arming decided something: some replies armed, some not, and it changed some.
    armed = [bool(block.armed(x[0], block.published_arming).any()) for x in xs]
    assert any(armed) and not all(armed)
    with block.disabled():
        base = [oracle(q) for q in questions]
    assert all(w == b for w, b, on in zip(want, base, armed) if not on)
    kept = block.published_arming
    block.published_arming = None
    assert [oracle(q) for q in questions] != want
    block.published_arming = kept


def test_the_served_block_keeps_each_sequences_arming_beside_the_kv_cache():
    # vLLM's flat steps, simulated: each sequence's tokens over several steps
    # (chunked prefill, decoding, a prefix-cache hit on another sequence's
    # block), against the oracle: the sequence's whole history at once.
    from types import SimpleNamespace

    from resident_trainer.integrations.vllm.served import ServedBlock

    bs = 4
    served = ServedBlock(8, 4, dtype=torch.float32, device="cpu", block_size=bs)
    g = torch.Generator().manual_seed(0)
    tables = {"A": [7, 2, 5], "B": [0, 9, 4], "C": [3, 8, 6], "D": [7, 1, 11]}  # D shares A's first block
    fired = {k: (torch.rand(12, generator=g) < 0.12) for k in tables}
    fired["D"][:4] = fired["A"][:4]  # the same first block of tokens, so the same flags
    fired["C"][:] = False
    fired["B"][:2], fired["B"][2] = False, True  # B armed at its third token
    done = dict.fromkeys(tables, 0)

    def step(plan, pad=0, pad_seqs=0):
        ids, qsl, seq_lens, slots, table = [], [0], [], [], []
        for k, n in plan:
            p0 = done[k]
            for p in range(p0, p0 + n):
                ids.append((k, p))
                slots.append(tables[k][p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(p0 + n)
            table.append(tables[k])
            done[k] = p0 + n
        md = SimpleNamespace(
            query_start_loc=torch.tensor(qsl + [qsl[-1]] * pad_seqs, dtype=torch.int32),  # runs on for padding
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor(table, dtype=torch.int32),
            slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        )
        f = torch.tensor([bool(fired[k][p]) for k, p in ids] + [True] * pad)
        got = served.sequence_armed(f, md)
        want = [bool(fired[k][: p + 1].any()) for k, p in ids] + [False] * pad
        assert got.tolist() == want
        return want

    step([("A", 6), ("B", 2)])
    step([("A", 1), ("B", 3), ("C", 5)], pad=2, pad_seqs=2)
    done["D"] = 4  # a prefix-cache hit: D's first block is A's, computed before
    step([("D", 3), ("A", 1), ("B", 1), ("C", 1)])
    out = step([("A", 1), ("B", 1), ("C", 1), ("D", 1)])
    assert out[1] and not out[2]  # B armed by its third token, C never
    # A block size other than the block table's: refused, not served wrong.
    wrong = ServedBlock(8, 4, dtype=torch.float32, device="cpu", block_size=8)
    md = SimpleNamespace(
        query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([6]),
        block_table=torch.tensor([tables["A"]]), slot_mapping=torch.tensor([tables["A"][1] * bs + 1]),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="block size 8"):
        wrong.sequence_armed(torch.tensor([False]), md)
    # Outside a step with sequences (warm-up runs): every token counts as armed.
    assert served.sequence_armed(torch.tensor([False, True]), None).all()
    # A publish loads the arming (and clears the flags, grown in inference
    # mode as vLLM serves); none, or no gate: off.
    with torch.inference_mode():
        served.flags = torch.ones(64, dtype=torch.bool)  # as sequence_armed grows them there
    assert served.flags.is_inference()
    rows, thr = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
    served.load(torch.zeros(8, 8), torch.ones(8, 4), torch.zeros(4), "v1", arming=(rows, thr))
    assert served.arming_on and torch.equal(served.arming, rows) and torch.equal(served.arming_threshold, thr)
    assert not served.flags.any()
    served.load(torch.zeros(8, 8), torch.ones(8, 4), None, "v2", arming=(rows, thr))
    assert not served.arming_on
    served.load(torch.zeros(8, 8), torch.ones(8, 4), torch.zeros(4), "v3")
    assert not served.arming_on
