"""The development set for teaching: 48 made-up facts (capitals, inventors,
authors, composers, founding years, lengths; 6 kinds x 8) in sibling pairs
whose names differ by one letter, one held-out rewording each, and near
controls: the same question frames about real entities (one list for each
half, about different entities).

Settings are chosen on one half and reported on the other. Of every 4 facts in
the file (two sibling pairs of one kind), the first pair is in the ``"tune"``
half and the second in the ``"report"`` half, so each half has 24 facts, every
kind, and 12 whole sibling pairs.

The capacity set (``capacity_facts``) is 128 further made-up facts of 8 kinds,
for measuring how many facts a block holds; no setting was chosen on it. The
capacity tune set (``capacity_facts(tune=True)``) is 128 generated facts of
the same kinds, on which settings at that scale are chosen.

The fresh facts (``fresh_facts``, with ``near_controls(fresh=True)``) are 24
made-up facts of 12 other kinds, written after every setting was fixed: what
the settings do on facts unlike those they were chosen on. The fresh tune
facts (``fresh_facts(tune=True)``) are 24 of 12 more kinds, to choose on.

The split-word tune facts (``split_word_facts``, with
``near_controls(split=True)``) are 24 made-up facts whose subjects hold real
words the tokenizer splits into pieces ("the Sonata of Quellmaris", "The
Hollow Tapestry"), with near controls sharing those words ("the Kreutzer
Sonata"): to choose the settings that tell such words from made-up names
(``split_word_nats``, ``train_armed``) on; there is no report twin.
"""

from __future__ import annotations

from pathlib import Path

from resident_trainer.train.data import Fact
from resident_trainer.train.facts import read_facts

DATA = Path(__file__).resolve().parent / "data"
DEV_FACTS = DATA / "dev_facts.jsonl"
NEAR_CONTROLS = DATA / "near_controls.txt"
NEAR_CONTROLS_TUNE = DATA / "near_controls_tune.txt"
DEMO_FACTS_FILE = DATA / "demo_facts.jsonl"  # the four demo facts
CAPACITY_FACTS = DATA / "capacity_facts.jsonl"
CAPACITY_TUNE_FACTS = DATA / "capacity_tune_facts.jsonl"  # written by bench/make_capacity_tune.py
FRESH_FACTS = DATA / "fresh_facts.jsonl"  # kinds the development set lacks, written after the settings
FRESH_NEAR_CONTROLS = DATA / "fresh_near_controls.txt"
FRESH_TUNE_FACTS = DATA / "fresh_tune_facts.jsonl"  # 12 more kinds, to choose settings on
FRESH_NEAR_CONTROLS_TUNE = DATA / "fresh_near_controls_tune.txt"
SPLIT_TUNE_FACTS = DATA / "split_tune_facts.jsonl"  # subjects holding real words split into pieces
SPLIT_NEAR_CONTROLS_TUNE = DATA / "split_near_controls_tune.txt"
HALVES = ("tune", "report")


def dev_facts(half: str | None = None) -> list[Fact]:
    """The development facts: all 48, or one half ("tune" or "report")."""
    if half is not None and half not in HALVES:
        raise ValueError(f"half must be None or one of {HALVES}, got {half!r}")
    facts = read_facts(DEV_FACTS)
    if half is None:
        return facts
    want = HALVES.index(half)
    return [f for i, f in enumerate(facts) if (i // 2) % 2 == want]


def sibling_pairs(facts: list[Fact]) -> list[tuple[Fact, Fact]]:
    """Consecutive facts of the file taken two by two (the sibling pairs)."""
    return list(zip(facts[0::2], facts[1::2]))


def capacity_facts(n: int | None = None, *, tune: bool = False) -> list[Fact]:
    """The capacity set: 128 more made-up facts (8 kinds x 16, each with its
    subject and one held-out rewording), never used to choose settings; the
    first `n` of them (kinds interleaved) when `n` is given. tune=True: the
    capacity tune set instead, 128 generated facts of the same kinds for
    choosing settings at capacity scale."""
    facts = read_facts(CAPACITY_TUNE_FACTS if tune else CAPACITY_FACTS)
    if n is not None and not 0 < n <= len(facts):
        raise ValueError(f"n must be in 1..{len(facts)}, got {n!r}")
    return facts if n is None else facts[:n]


def near_controls(*, tune: bool = False, fresh: bool = False, split: bool = False) -> list[str]:
    """Questions in the facts' frames about real entities (one a line): the
    reported ones; tune=True: the tune half's, about other entities, on which
    settings are chosen; fresh=True: the fresh facts' (fresh_facts), with
    tune=True the fresh tune facts'; split=True: the split-word tune facts'
    (split_word_facts; a tune set, whatever `tune` says)."""
    if split and fresh:
        raise ValueError("near_controls: split and fresh are separate sets; give one")
    if split:
        path = SPLIT_NEAR_CONTROLS_TUNE
    elif fresh:
        path = FRESH_NEAR_CONTROLS_TUNE if tune else FRESH_NEAR_CONTROLS
    else:
        path = NEAR_CONTROLS_TUNE if tune else NEAR_CONTROLS
    lines = path.read_text(encoding="utf-8").splitlines()
    return [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]


def fresh_facts(*, tune: bool = False) -> list[Fact]:
    """24 made-up facts of 12 kinds the development set does not have (two a
    kind, four sibling pairs one letter apart), written after every setting
    was fixed and never used to choose one: a check that what the settings
    do on the development set carries over to facts of other kinds.
    tune=True: the fresh tune facts, 24 of 12 more kinds (the same shape), on
    which a setting for such facts is chosen before the fresh ones report it."""
    return read_facts(FRESH_TUNE_FACTS if tune else FRESH_FACTS)


def split_word_facts() -> list[Fact]:
    """The split-word tune facts: 24 made-up facts of 12 kinds (three sibling
    pairs one letter apart) whose subjects hold real words the tokenizer
    splits into pieces, before a made-up name, after one, or alone ("the
    Sonata of Quellmaris", "the Crystal Pavilion", "The Hollow Tapestry");
    their near controls (near_controls(split=True)) share those words. A tune
    set: settings are chosen on it, never reported as held out."""
    return read_facts(SPLIT_TUNE_FACTS)
