"""Near negatives: a fact's own question frame around other subjects.

"What is the capital of Velmoria?" taught must leave "What is the capital of
Germany?" alone. Those questions share every token before the subject, so a
block that fires on the frame changes both. A near negative is the fact's
question with its subject replaced by a real one ("What is the capital of
Portugal?"); answered by the model before the job, it joins the anchors: the
block is kept quiet on it and the exact no-op gate is calibrated above it, so
what stays open is the subject and what follows it. No outside data: the
substitutes are a fixed list in this file, and the replies are the model's.

The subject is the fact's ``subject`` when given; otherwise the question's
name-like span, found by `subject_span`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Mapping, Sequence

from resident_trainer.train.data import Fact

# Real subjects of many kinds (places, inventions, works, landmarks), none of
# them in the project's evaluation prompts (eval/data/near_controls.txt, the
# locality controls): the negatives must not be what is measured.
SUBSTITUTES: tuple[str, ...] = (
    "Portugal",
    "Australia",
    "Mexico",
    "Kenya",
    "Norway",
    "Argentina",
    "the printing press",
    "the steam engine",
    "the telescope",
    "the bicycle",
    "the radio",
    "the television",
    "the novel Don Quixote",
    "the novel Jane Eyre",
    "Hamlet",
    "the Ninth Symphony",
    "the opera Carmen",
    "the Messiah",
    "the city of Rome",
    "Chicago",
    "the Eiffel Tower",
    "the Amazon River",
    "the Panama Canal",
    "the Brooklyn Bridge",
)

_WORD = re.compile(r"[A-Za-z0-9][\w'\-]*")
_JOINERS = {"of", "the", "a", "an", "in", "and", "de"}
_ARTICLES = {"the", "a", "an"}


def _piece_ids(tokenizer, word: str) -> list[int]:
    return tokenizer(" " + word, add_special_tokens=False)["input_ids"]


def _pieces(tokenizer, word: str) -> int:
    return len(_piece_ids(tokenizer, word))


def subject_span(question: str, tokenizer) -> str:
    """The question's subject: the longest run of name-like words (capitalized
    after the first word, or split by the tokenizer into 2 or more pieces, as
    made-up and rare names are), joined across "of", "the", "a", ...; the one
    with the most tokenizer pieces when there are several. Falls back to the
    question's last word."""
    words = [(m.group(), m.start(), m.end()) for m in _WORD.finditer(question)]
    if not words:
        raise ValueError(f"question {question!r} has no words")

    def namey(i: int) -> bool:
        w = words[i][0]
        return (i > 0 and w[0].isupper()) or _pieces(tokenizer, w) >= 2

    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(words):
        if not namey(i):
            i += 1
            continue
        j = i
        while j + 1 < len(words):
            if namey(j + 1):
                j += 1
                continue
            # a joiner between two name-like words ("Lanterns of Vosk")
            k = j + 1
            while k < len(words) and words[k][0].lower() in _JOINERS:
                k += 1
            if k > j + 1 and k < len(words) and namey(k):
                j = k
                continue
            break
        runs.append((i, j))
        i = j + 1
    if not runs:
        return words[-1][0]
    best = max(runs, key=lambda r: (sum(_pieces(tokenizer, words[k][0]) for k in range(r[0], r[1] + 1)), r[0]))
    return question[words[best[0]][1] : words[best[1]][2]]


def fact_subject(fact: Fact, tokenizer) -> str:
    """The words of a fact's question it is about: `fact.subject`, or
    subject_span's guess."""
    return fact.subject or subject_span(fact.question, tokenizer)


def _picks(question: str, n: int) -> list[str]:
    """`n` substitutes for a question, the same every time (a hash of it)."""
    start = int.from_bytes(hashlib.sha256(question.encode()).digest()[:4], "big")
    stride = 7  # coprime with len(SUBSTITUTES): n picks are distinct
    return [SUBSTITUTES[(start + k * stride) % len(SUBSTITUTES)] for k in range(min(n, len(SUBSTITUTES)))]


#: A job makes at least this many near negatives: a job of a few facts takes
#: more a fact (its gate is calibrated on fewer prompts otherwise; with 4 a
#: fact, a 4-fact job changed "Who invented the telephone?").
MIN_NEGATIVES = 64


def per_fact(n_facts: int, wanted: int) -> int:
    """Near negatives a fact for a job of `n_facts`: `wanted`, raised so the
    job has at least MIN_NEGATIVES (at most one per substitute); 0 stays 0."""
    if wanted <= 0 or n_facts <= 0:
        return 0
    return min(len(SUBSTITUTES), max(wanted, -(-MIN_NEGATIVES // n_facts)))


def _fit(before: str, sub: str) -> str:
    """`sub` without its leading words that the text before the subject
    already ends with ("the city of " + "the city of Rome" -> "Rome"), and
    without its article after one ("a " + "the radio" -> "radio")."""
    head, words = before.lower().split(), sub.split()
    for k in range(len(words) - 1, 0, -1):
        if [w.lower() for w in words[:k]] == head[len(head) - k :]:
            return " ".join(words[k:])
    if head and head[-1] in ("a", "an", "the") and len(words) > 1 and words[0].lower() in ("a", "an", "the"):
        return " ".join(words[1:])
    return sub


def near_negatives(facts: Sequence[Fact], tokenizer, per_fact: int = 2, *, exclude: Sequence[str] = ()) -> list[str]:
    """Each fact's question with its subject replaced by
    `per_fact` real ones: distinct prompts, none equal to a fact's question or
    rewording, none in `exclude` (e.g. the locality controls)."""
    if per_fact < 0:
        raise ValueError(f"per_fact must be >= 0, got {per_fact!r}")
    taught = {q for f in facts for q in (f.question, *f.rewordings)}
    skip = taught | set(exclude)
    out: list[str] = []
    seen: set[str] = set()
    for f in facts:
        subject = fact_subject(f, tokenizer)
        if subject not in f.question:
            continue
        at = f.question.find(subject)
        for sub in _picks(f.question, per_fact):
            neg = f.question[:at] + _fit(f.question[:at], sub) + f.question[at + len(subject) :]
            # A capitalized article at the start of a sentence stays capitalized.
            if neg and neg[0].islower():
                neg = neg[0].upper() + neg[1:]
            if neg not in skip and neg not in seen:
                seen.add(neg)
                out.append(neg)
    return out


# Real one-word names that replace a subject's other words in word_probes;
# none is in the project's evaluation prompts.
PROBE_NAMES: tuple[str, ...] = ("Madison", "Victoria", "Kingston", "Hudson", "Oslo", "Dover", "Austin", "Bristol")


def common_word(word: str, tokenizer) -> bool:
    """Whether a subject's word is an ordinary one: letters only and a single
    piece of the tokenizer's vocabulary after a space (" Bridge", " Salt",
    " Symphony"); made-up names split into pieces (" Tess", "aly")."""
    return word.isalpha() and _pieces(tokenizer, word) == 1


def split_words(fact: Fact, tokenizer) -> list[str]:
    """The subject's words (letters only, not "of", "the", ...) that the
    tokenizer splits into two or more pieces after a space, each once: made-up
    names (" Tess" + "aly") and real words the vocabulary lacks (" Cant" +
    "ata")."""
    return _split_words(fact_subject(fact, tokenizer), tokenizer)


def _split_words(subject: str, tokenizer) -> list[str]:
    out = [w for w in subject.split(" ") if w.isalpha() and w.lower() not in _JOINERS and _pieces(tokenizer, w) >= 2]
    return list(dict.fromkeys(out))


def split_word_ids(fact: Fact, tokenizer) -> list[tuple[str, list[int], int]]:
    """For each of split_words: (word, ids, later) where ids are the
    question's text before the subject followed by the word's pieces, and
    `later` the number of its pieces after the first (the tokens whose
    surprisal tells a real word from a made-up one: "ata" after "Who composed
    the Cant" is likely, "recht" after "... the city of Old" is not)."""
    subject = fact_subject(fact, tokenizer)
    at = fact.question.find(subject)
    if at < 0:
        return []
    frame = fact.question[:at].rstrip()
    head = tokenizer(frame, add_special_tokens=False)["input_ids"] if frame else []
    out = []
    for w in _split_words(subject, tokenizer):
        pieces = _piece_ids(tokenizer, w)
        out.append((w, head + pieces, len(pieces) - 1))
    return out


def real_split_words(nats: Mapping[str, float], below: float | None, *, all_real: bool = False) -> set[str]:
    """Of a subject's split words (`nats`: each one's summed surprisal,
    split_word_ids' later pieces under the base model), those it reads as
    real words: below `below` nats. Never all of them unless `all_real`:
    where every one is below, the least likely stays made up, so a subject
    that has split words keeps one to arm on. With `all_real` (a block
    trained under its arming, TrainConfig.train_armed) a subject of real
    words only ("The Velvet Citadel") has every word kept in its word probes
    ("The Madison Citadel", "The Velvet Madison") and arms on what tells it
    from them. None: none is real (the tokenizer alone decides)."""
    if below is None or not nats:
        return set()
    real = {w for w, n in nats.items() if n < below}
    if len(real) == len(nats) and not all_real:
        real.discard(max(nats, key=lambda w: nats[w]))
    return real


def word_probes(fact: Fact, tokenizer, per_word: int = 2, *, real: Collection[str] = ()) -> list[str]:
    """What real text around a subject's words looks like, made from the fact
    alone (prompts that arming's rows must not score like the fact's own).

    Word probes: the fact's question with its subject's other words replaced
    by real names, its ordinary words (common_word) kept: "How long is the
    Madison Bridge?" for "How long is the Tessaly Bridge?". A subject of
    ordinary words only gives one probe per word replaced in turn ("The Salt
    Hudson", "The Hudson Cartographer" would be for "The Salt Cartographer" if
    both were ordinary); none for a subject without ordinary words, or of one
    word.

    Piece probes: for each word of the subject split into pieces (letters
    only), the question with that word's first piece replaced by a real
    name's ("the city of Doverrecht" for "the city of Oldrecht": the same
    later pieces after another piece, as in "Utrecht") and the subject's other
    such words by a real name; only names after which the tokenizer splits
    the word's later pieces as in the fact.

    Left-out probes: a subject of two or more words, every one ordinary,
    also gives the question with each of them left out in turn ("Who
    captained the ship Pelican?" for "Who captained the ship Iron Pelican?",
    "The Citadel" for "The Velvet Citadel"): a real name often holds a shorter
    run of the same words. None that would end in a joiner, begin with one
    other than an article, or bring two together ("A of Glass Owls").

    `real`: split words that count as ordinary ones here (real_split_words:
    " Cant" + "ata"): kept in the word probes ("the Cantata of the Madison
    Bell"), no piece probes of their own."""
    subject = fact_subject(fact, tokenizer)
    if subject not in fact.question:
        return []
    words = subject.split(" ")
    content = [j for j, w in enumerate(words) if w.lower() not in _JOINERS]
    common = [j for j in content if common_word(words[j], tokenizer) or words[j] in real]
    other = [j for j in content if j not in common]
    start = int.from_bytes(hashlib.sha256(fact.question.encode()).digest()[:4], "big")
    names = [PROBE_NAMES[(start + k) % len(PROBE_NAMES)] for k in range(len(PROBE_NAMES))]
    out: list[str] = []

    def add(probe: str) -> bool:
        q = fact.question.replace(subject, probe, 1)
        if q in out or q == fact.question:
            return False
        out.append(q)
        return True

    if common and len(content) >= 2:
        for g in [other] if other else [[j] for j in common]:
            for name in names[:per_word]:
                add(" ".join(name if j in g else w for j, w in enumerate(words)))
        if not other:
            for j in content:
                kept = words[:j] + words[j + 1 :]
                ends = kept[-1].lower() in _JOINERS or kept[0].lower() in _JOINERS - _ARTICLES
                inside = 0 < j < len(words) - 1 and {words[j - 1].lower(), words[j + 1].lower()} <= _JOINERS
                if not (ends or inside):
                    add(" ".join(kept))

    for j in other:
        pieces = _piece_ids(tokenizer, words[j])
        if len(pieces) < 2 or not words[j].isalpha():
            continue
        rest = tokenizer.decode(pieces[1:])
        made = 0
        for k, name in enumerate(names):
            if made == per_word:
                break
            if _piece_ids(tokenizer, name + rest) != _piece_ids(tokenizer, name) + pieces[1:]:
                continue
            filler = names[(k + 1) % len(names)]
            made += add(" ".join(name + rest if i == j else filler if i in other else w for i, w in enumerate(words)))
    return out
