"""Teach facts in one or more jobs on one block of a model in this process,
then report what was taught and what was left alone (`report.score`).

Each job: near negatives of its facts (their question frames around real
subjects, answered by the base model) join the generic anchors; a `Trainer`
trains the block on the job's facts while rehearsing what the block was taught
before; the job publishes. After the last job every fact, rewording and
control is asked once (greedy, batched). Optional baselines, measured in the
same run: the block with its gate off, and the fact given in the prompt
(in context) with no block at all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from resident_trainer.eval.devset import near_controls
from resident_trainer.eval.locality import CONTROL_PROMPTS
from resident_trainer.eval.report import add_gate_openings, add_retracted, score, shortfalls, summary_line
from resident_trainer.models.adapter import DecoderAdapter
from resident_trainer.train import (
    ANCHOR_PROMPTS,
    NEGATIVE_REPLY_TOKENS,
    AddedSharedNeurons,
    Fact,
    TrainConfig,
    Trainer,
    chat_prompt_ids,
    generate_greedy_batch,
    generate_greedy_batch_ids,
    make_anchors,
)
from resident_trainer.train.block import threshold_summary
from resident_trainer.train.negatives import near_negatives, per_fact


def default_controls(*, tune: bool = False, fresh: bool = False, split: bool = False) -> list[tuple[str, str]]:
    """The built-in controls: 14 generic prompts and the near controls (the
    development set's question frames about real entities; tune=True: the
    tune half's near controls instead; fresh=True: the fresh facts', or with
    tune=True the fresh tune facts'; split=True: the split-word tune
    facts')."""
    near = near_controls(tune=tune, fresh=fresh, split=split)
    return [(p, "generic") for p in CONTROL_PROMPTS] + [(p, "near") for p in near]


def split_jobs(facts: Sequence[Fact], jobs: int) -> list[list[Fact]]:
    """`facts` in `jobs` consecutive runs of (nearly) equal size."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    if jobs > len(facts):
        raise ValueError(f"jobs={jobs} is more than the {len(facts)} facts")
    q, r = divmod(len(facts), jobs)
    out, start = [], 0
    for j in range(jobs):
        n = q + (1 if j < r else 0)
        out.append(list(facts[start : start + n]))
        start += n
    return out


def in_context_prompt(fact: Fact, question: str) -> str:
    """The in-context baseline's prompt: the fact's answer, then the question."""
    return f"{fact.answer}\n{question}"


def teach_jobs(
    model,
    tokenizer,
    jobs: Sequence[Sequence[Fact]],
    config: TrainConfig,
    *,
    controls: Sequence[tuple[str, str]] | None = None,
    negatives: int = 4,
    max_new_tokens: int = 24,
    anchors: Sequence[tuple[str, list[int]]] | None = None,
    baselines: bool = False,
    retract: Sequence[str] = (),
    score_each_job: bool = False,
    curve_steps: Sequence[int] = (),
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Attach a fresh block to `model`, teach `jobs` one after another (then,
    if `retract` names taught questions, one more job that retracts them),
    and return the report: ``facts``, ``controls``, ``leaks``, ``summary``,
    ``train_seconds`` (all jobs, negatives' replies included), ``jobs`` (one
    record each) and, with `baselines`, ``baselines`` (``gate_off``,
    ``arming_off`` (the gate alone, where the block arms), ``in_context``:
    their summaries). The facts scored are those taught and
    not retracted; retracted ones are scored in ``retracted``. The block
    stays attached, published.

    score_each_job: also score, after each job, the facts taught so far and
    the controls (each job record gets a ``summary``, and ``shortfalls``:
    the facts missed, the controls changed and the leaks, report.shortfalls).
    curve_steps: publish and score at these step counts within every job as
    well (each job record
    gets a ``curve``: the summaries by steps); the gate is reopened after
    each, so training goes on as without them. anchors: the generic
    anchors as (prompt, reply ids), e.g. the replies a server gave
    (default: this model's own greedy replies to ANCHOR_PROMPTS).
    max_new_tokens: the length of the scored replies; anchors and near
    negatives are answered in ANCHOR_REPLY_TOKENS and NEGATIVE_REPLY_TOKENS,
    as the server answers them, so a job here trains on what the server's
    job trains on."""
    controls = default_controls() if controls is None else list(controls)
    prompts = [p for p, _ in controls]
    overlap = set(prompts) & set(ANCHOR_PROMPTS)
    if overlap:
        raise ValueError(f"controls must not be anchors (the check would be circular): {sorted(overlap)}")
    log = log or (lambda s: None)
    a = DecoderAdapter(model)
    for p in model.parameters():
        p.requires_grad_(False)
    before_ids = generate_greedy_batch_ids(model, tokenizer, prompts, max_new_tokens)
    before = {p: tokenizer.decode(r, skip_special_tokens=True) for p, r in zip(prompts, before_ids)}
    anchors = make_anchors(model, tokenizer, ANCHOR_PROMPTS) if anchors is None else list(anchors)
    block = AddedSharedNeurons(
        a.hidden_size,
        config.num_neurons,
        seed=config.seed,
        init_std=config.init_std,
        dtype=a.head_weight.dtype,
        device=a.device,
    )
    block.attach(a, config.layer)
    exclude = prompts + list(ANCHOR_PROMPTS)
    records = []
    total = 0.0
    plan = [("teach", list(j)) for j in jobs] + ([("retract", list(retract))] if retract else [])
    for n, (kind, items) in enumerate(plan, start=1):
        t0 = time.perf_counter()
        if kind == "teach":
            k = per_fact(len(items), negatives)
            negs = near_negatives(items, tokenizer, k, exclude=exclude) if k else []
            facts, gone = items, ()
        else:
            # The retracted questions, answered by the base model, become
            # negatives (the block's memory keeps them for later jobs).
            negs, facts, gone = items, [], items
        with block.disabled():
            job_negatives = make_anchors(model, tokenizer, negs, NEGATIVE_REPLY_TOKENS)
        trainer = Trainer(a, block, tokenizer, facts, config, anchors=anchors, negatives=job_negatives, retract=gone)
        log(
            f"job {n}/{len(plan)}: {kind} {len(items)} facts, rehearsing {len(trainer.kept)}, "
            f"{len(trainer.negatives)} near negatives, {trainer.steps} steps"
        )
        curve = []
        spent = 0.0
        for stop in sorted(x for x in curve_steps if 0 < x < trainer.steps):
            trainer.run(stop - trainer.step_index, progress=progress)
            spent += time.perf_counter() - t0
            so_far = [f for j in jobs[:n] for f in j] if kind == "teach" else []
            scored = _score_now(model, tokenizer, so_far, controls, before, max_new_tokens)
            curve.append({"steps": stop, **scored["summary"]})
            block.threshold = None  # train on ungated, as a job does
            t0 = time.perf_counter()
        trainer.run(trainer.steps - trainer.step_index, progress=progress)
        seconds = spent + time.perf_counter() - t0
        total += seconds
        records.append(
            {
                "kind": kind,
                "facts": len(items),
                "rehearsed": len(trainer.kept),
                "steps": len(trainer.history),
                "seconds": round(seconds, 2),
                # what the frozen layers after the block computed in (TrainConfig.suffix_dtype)
                "suffix_dtype": str(trainer.suffix_dtype or trainer.adapter.dtype).removeprefix("torch."),
                "loss_first": trainer.history[0].loss,
                "loss_last": trainer.history[-1].loss,
                "threshold": threshold_summary(block.published_threshold),
            }
        )
        if curve:
            records[-1]["curve"] = curve
        if score_each_job and kind == "teach":
            so_far = [f for j in jobs[:n] for f in j]
            scored = _score_now(model, tokenizer, so_far, controls, before, max_new_tokens)
            records[-1]["summary"] = scored["summary"]
            records[-1]["shortfalls"] = shortfalls(scored)
            # logged at once: a run stopped later still has every finished job's figures
            log(f"after job {n}: {summary_line(records[-1]['summary'])} ({seconds:.0f} s)")
            for what in ("missed", "rewordings_missed"):
                for m in records[-1]["shortfalls"][what]:
                    log(f"  {what.replace('_', ' ')}: {m['question']!r} -> {m['reply']!r}")
            for c in records[-1]["shortfalls"]["changed"]:
                log(f"  changed ({c['kind']}): {c['prompt']!r} -> {c['after']!r}")
            for x in records[-1]["shortfalls"]["leaks"]:
                log(f"  leak: {x['question']!r} answered with {x['leaked_key']!r}")
    retracted_q = set(retract)
    taught = [f for j in jobs for f in j if f.question not in retracted_q]
    gone_facts = [f for j in jobs for f in j if f.question in retracted_q]
    scored = taught + gone_facts
    asked = list(dict.fromkeys([q for f in scored for q in (f.question, *f.rewordings)] + prompts))
    replies = dict(zip(asked, generate_greedy_batch(model, tokenizer, asked, max_new_tokens)))
    report = score(taught, replies, controls, before)
    add_gate_openings(report, gate_openings(model, tokenizer, block, list(zip(prompts, before_ids))))
    add_retracted(report, gone_facts, replies)
    report["train_seconds"] = round(total, 2)
    report["jobs"] = records
    report["threads"] = torch.get_num_threads()
    if baselines:
        report["baselines"] = _baselines(model, tokenizer, block, taught, controls, before, max_new_tokens)
    return report


@torch.no_grad()
def gate_openings(
    model, tokenizer, block: AddedSharedNeurons, exchanges: Sequence[tuple[str, Sequence[int]]]
) -> list[tuple[int, float | None] | None]:
    """For each (prompt, reply ids) exchange, as the base model replied: on how
    many of the tokens that predict the reply (the chat prompt's, and the
    reply's but its last) the block's published gate passes, and the largest
    gate margin ``max_a (x . Wg_a - t_a)`` over them (> 0: open; negative: how
    far below its threshold the nearest neuron stayed; None when every neuron
    is shut for good, or the block's arming shuts every token). None for each exchange when the block has no gate (it
    then adds its output everywhere).

    The block's inputs are taken with the reply given: its layer's input does
    not depend on the block, so where the count is 0 the block added exactly
    nothing to any of those tokens. Generation, in other batch shapes, may
    round those inputs differently in the last bits; the margin says how much
    room is left."""
    threshold = block.published_threshold
    if threshold is None:
        return [None] * len(exchanges)
    device = next(model.parameters()).device
    out = []
    for prompt, reply in exchanges:
        ids = chat_prompt_ids(tokenizer, prompt) + list(reply)
        with block.capture_inputs() as xs:
            model(torch.tensor([ids[:-1]], device=device))
        x = xs[0].reshape(-1, xs[0].shape[-1])
        margins = block.gate_margins(x, block.published_gate_up, threshold)
        if block.published_arming is not None:  # a token of an unarmed sequence passes nothing
            margins = margins.masked_fill(~block.armed(x, block.published_arming), float("-inf"))
        top = float(margins.max())
        # every neuron behind the gate (threshold inf): no finite margin to give
        out.append((int((margins > 0).sum()), round(top, 4) if math.isfinite(top) else None))
    return out


def _baselines(model, tokenizer, block, facts, controls, before, max_new_tokens) -> dict[str, Any]:
    prompts = [p for p, _ in controls]
    asked = list(dict.fromkeys([q for f in facts for q in (f.question, *f.rewordings)] + prompts))
    kept = block.published_threshold
    block.published_threshold = None
    try:
        off = dict(zip(asked, generate_greedy_batch(model, tokenizer, asked, max_new_tokens)))
    finally:
        block.published_threshold = kept
    gate_off = score(facts, off, controls, before)["summary"]
    out: dict[str, Any] = {"gate_off": gate_off}
    if block.published_arming is not None and kept is not None:
        arming, block.published_arming = block.published_arming, None
        try:
            alone = dict(zip(asked, generate_greedy_batch(model, tokenizer, asked, max_new_tokens)))
        finally:
            block.published_arming = arming
        out["arming_off"] = score(facts, alone, controls, before)["summary"]
    framed = {q: in_context_prompt(f, q) for f in facts for q in (f.question, *f.rewordings)}
    with block.disabled():
        ctx = dict(zip(framed, generate_greedy_batch(model, tokenizer, list(framed.values()), max_new_tokens)))
    out["in_context"] = score(facts, {**ctx, **before}, controls, before)["summary"]
    return out


def _score_now(model, tokenizer, facts, controls, before, max_new_tokens) -> dict[str, Any]:
    """`score` of `facts` and `controls` as the block now serves."""
    prompts = [p for p, _ in controls]
    asked = list(dict.fromkeys([q for f in facts for q in (f.question, *f.rewordings)] + prompts))
    replies = dict(zip(asked, generate_greedy_batch(model, tokenizer, asked, max_new_tokens)))
    return score(facts, replies, controls, before)
