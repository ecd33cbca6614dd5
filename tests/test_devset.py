"""The development set's files: they parse as users' facts, the halves split
every kind and every sibling pair as documented, keys are unique and cannot
be mistaken for one another, and the near controls are in the facts' frames
and apart from the anchors and the generic controls."""

import re

import pytest

from resident_trainer.eval.devset import (
    DEMO_FACTS_FILE,
    capacity_facts,
    dev_facts,
    fresh_facts,
    near_controls,
    sibling_pairs,
    split_word_facts,
)
from resident_trainer.eval.locality import CONTROL_PROMPTS, DEMO_FACTS
from resident_trainer.train import ANCHOR_PROMPTS, read_facts

FRAMES = ("What is the capital of", "Who invented", "Who wrote the novel", "Who composed",
          "In what year was the city of", "How long is")  # fmt: skip


def _frame(question: str) -> str:
    (frame,) = [f for f in FRAMES if question.startswith(f)]
    return frame


def test_the_facts_and_their_halves():
    facts = dev_facts()
    assert len(facts) == 48
    assert all(f.key and len(f.rewordings) == 1 and f.rewordings[0] != f.question for f in facts)
    assert all(f.key in f.answer for f in facts)
    tune, report = dev_facts("tune"), dev_facts("report")
    assert len(tune) == len(report) == 24 and not {f.question for f in tune} & {f.question for f in report}
    for half in (tune, report):
        assert sorted({_frame(f.question) for f in half}) == sorted(FRAMES)
        for a, b in sibling_pairs(half):  # whole pairs: same frame, names one letter apart
            assert _frame(a.question) == _frame(b.question)
            diff = sum(x != y for x, y in zip(a.question, b.question))
            assert len(a.question) == len(b.question) and diff == 1, (a.question, b.question)
    with pytest.raises(ValueError, match="half"):
        dev_facts("test")


def _distinct_keys(facts):
    """The facts' keys, checked unique and never a whole word of another fact's answer."""
    keys = [f.key for f in facts]
    assert len(set(keys)) == len(keys)
    for f in facts:
        for g in facts:
            if f is not g:
                assert not re.search(rf"(?<![\w,]){re.escape(f.key)}(?![\w,])", g.answer), (f.key, g.answer)
    return keys


def test_keys_are_unique_and_never_inside_another_answer():
    facts = dev_facts()
    _distinct_keys(facts)
    demo = {t.fact.question for t in DEMO_FACTS}
    assert not demo & {f.question for f in facts}  # never the demo's facts


@pytest.mark.parametrize("tune", [False, True], ids=["report", "tune"])
def test_near_controls_share_the_frames_and_nothing_else(tune):
    near = near_controls(tune=tune)
    assert len(near) >= 14 and len(set(near)) == len(near)
    assert {f for f in FRAMES if any(q.startswith(f) for q in near)} >= set(FRAMES) - {"In what year was the city of"}
    assert not set(near) & (set(CONTROL_PROMPTS) | set(ANCHOR_PROMPTS) | {f.question for f in dev_facts()})
    # The halves' lists ask about different entities.
    mine, other = _subjects(near), _subjects(near_controls(tune=not tune))
    assert not [(a, b) for a in mine for b in other if a in b or b in a]


def _subjects(questions):
    """What each question asks about: the question less its frame and article."""
    out = []
    for q in questions:
        frame = max((f for f in (*FRAMES, "In what year did") if q.startswith(f)), key=len)
        out.append(q[len(frame) :].strip(" ?").removeprefix("the ").removeprefix("The ").lower())
    return out


@pytest.mark.parametrize("tune", [False, True], ids=["report", "tune"])
def test_the_capacity_set(tune):
    facts = capacity_facts(tune=tune)
    assert len(facts) == 128 and capacity_facts(16, tune=tune) == facts[:16]
    frames = [_frame(f.question) if not f.question.startswith(("Who painted", "Who discovered")) else f.question.split()[1]
              for f in facts]  # fmt: skip
    # 8 kinds x 16, interleaved
    assert all(frames[i] == frames[i % 8] for i in range(128)) and len(set(frames[:8])) == 8
    assert all(f.subject and f.subject in f.question and f.subject in f.rewordings[0] for f in facts)
    assert all(f.key in f.answer and len(f.rewordings) == 1 for f in facts)
    keys = _distinct_keys(facts)
    assert not {f.question for f in facts} & {f.question for f in dev_facts()}
    assert not set(keys) & {f.key for f in dev_facts()}
    if tune:  # nothing shared with the set it stands in for
        report = capacity_facts()
        assert not {f.question for f in facts} & {f.question for f in report}
        assert not set(keys) & {f.key for f in report} and not {f.subject for f in facts} & {f.subject for f in report}
    with pytest.raises(ValueError, match="n must be"):
        capacity_facts(0, tune=tune)


FRESH_FRAMES = ("Who is the chief executive of", "What is the national bird of", "Which team won the",
                "Who directed the film", "What language is spoken in", "How tall is Mount", "What is the currency of",
                "Who captained the ship", "What is the main ingredient of", "Who wrote the software library",
                "Where does the", "What is the access code of")  # fmt: skip
FRESH_TUNE_FRAMES = ("Who founded the company", "What is the population of the town", "Who is the mayor of",
                     "What color is the flag of", "Who designed the", "What is the nickname of the city",
                     "Which river flows through the city", "What is the national sport of", "Who sculpted the statue",
                     "What is the motto of the Order of", "Who coaches the team", "What does the company")  # fmt: skip


@pytest.mark.parametrize("tune", [False, True], ids=["fresh", "fresh-tune"])
def test_the_fresh_facts_are_other_kinds_and_their_near_controls_their_frames(tune):
    facts, mine = fresh_facts(tune=tune), FRESH_TUNE_FRAMES if tune else FRESH_FRAMES
    assert len(facts) == 24 and all(f.key and len(f.rewordings) == 1 for f in facts)

    def frame(q):
        (f,) = [f for f in mine if q.startswith(f)]
        return f

    # Two facts a kind (the same frame), 12 kinds, none of the other sets' frames.
    assert [frame(f.question) for f in facts] == [f for f in mine for _ in range(2)]
    others = [*dev_facts(), *capacity_facts(), *capacity_facts(tune=True), *read_facts(DEMO_FACTS_FILE)]
    others += fresh_facts(tune=not tune)
    assert not [f.question for f in others if f.question.startswith(mine)]
    _distinct_keys(facts)
    # Four pairs are siblings one letter apart; the rewordings are other words than the question's.
    siblings = [(a, b) for a, b in sibling_pairs(facts) if sum(x != y for x, y in zip(a.question, b.question)) == 1]
    assert len(siblings) == 4 and all(len(a.question) == len(b.question) for a, b in siblings)
    assert all(f.rewordings[0] != f.question for f in facts)
    near = near_controls(fresh=True, tune=tune)
    assert len(near) == 14 and len(set(near)) == len(near)
    # Every frame (no real vault has a known access code)
    assert {frame(q) for q in near} == set(mine) - {"What is the access code of"}
    built_in = set(CONTROL_PROMPTS) | set(ANCHOR_PROMPTS) | set(near_controls()) | set(near_controls(tune=True))
    assert not set(near) & (built_in | set(near_controls(fresh=True, tune=not tune)))


def test_the_split_word_tune_facts_and_their_near_controls():
    facts = split_word_facts()
    assert len(facts) == 24 and all(f.key in f.answer and len(f.rewordings) == 1 for f in facts)
    assert all(f.rewordings[0] != f.question for f in facts)
    # 12 kinds, two a kind (the same frame up to the subject), three pairs siblings one letter apart.
    pairs = sibling_pairs(facts)
    assert all(a.question.split(" ")[:2] == b.question.split(" ")[:2] for a, b in pairs)
    siblings = [(a, b) for a, b in pairs if sum(x != y for x, y in zip(a.question, b.question)) == 1]
    assert len(siblings) == 3 and all(len(a.question) == len(b.question) for a, b in siblings)
    keys = _distinct_keys(facts)
    others = [*dev_facts(), *capacity_facts(), *capacity_facts(tune=True), *fresh_facts(), *fresh_facts(tune=True)]
    assert not {f.question for f in facts} & {f.question for f in others}
    assert not set(keys) & {f.key for f in others}
    near = near_controls(split=True)
    assert len(near) == 16 and len(set(near)) == len(near)
    # None a built-in prompt or a reported set's near control (another tune set's may be one).
    built_in = set(CONTROL_PROMPTS) | set(ANCHOR_PROMPTS) | {f.question for f in facts}
    assert not set(near) & (built_in | set(near_controls()) | set(near_controls(fresh=True)))
    with pytest.raises(ValueError, match="split and fresh"):
        near_controls(split=True, fresh=True)
