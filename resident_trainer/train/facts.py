"""Facts as users write them: one JSON object per fact,

    {"question": "...", "answer": "...", "key": "...", "rewordings": ["...", ...],
     "subject": "..."}

(`key`, `rewordings` and `subject` optional; `key` must be words of the
answer, as a reply must hold it, and `subject` words of the question), one per
line in a UTF-8 FACTS.jsonl file for
``resident-trainer teach``, or as the ``facts`` list of a job posted to the
server. Every problem is reported with where it is (line N of a file, or
``facts[i]`` of a request) and which field, before any slow work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from resident_trainer.train.data import Fact, holds_words

FIELDS = ("question", "answer", "key", "rewordings", "subject")


class FactError(ValueError):
    """A fact that cannot be taught, with where it is and which field."""

    def __init__(self, where: str, field: str | None, message: str) -> None:
        self.where, self.field, self.message = where, field, message
        super().__init__(f"{where}: {field}: {message}" if field else f"{where}: {message}")


def _text(obj: Mapping[str, Any], name: str, where: str, required: bool) -> str | None:
    if name not in obj or obj[name] is None:
        if required:
            raise FactError(where, name, "missing (a non-empty string is required)")
        return None
    v = obj[name]
    if not isinstance(v, str) or not v.strip():
        raise FactError(where, name, f"must be a non-empty string, got {v!r}")
    return v.strip()


def parse_fact(obj: object, where: str, *, check_words: bool = True) -> Fact:
    """One fact from its JSON object; `where` names it in errors.
    check_words=False leaves out the key-in-answer and subject-in-question
    checks (a block's memory of facts taught before they were made)."""
    if not isinstance(obj, Mapping):
        raise FactError(where, None, f"a fact must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise FactError(where, unknown[0], f"unknown field (a fact has {', '.join(FIELDS)})")
    question = _text(obj, "question", where, True)
    answer = _text(obj, "answer", where, True)
    key = _text(obj, "key", where, False)
    if check_words and key is not None and not holds_words(answer, key):
        # Recall is the reply holding the key; trained on an answer without
        # it, no reply would.
        raise FactError(where, "key", f"{key!r} is not words of the answer {answer!r}")
    rewordings = obj.get("rewordings")
    rewordings = [] if rewordings is None else rewordings
    if not isinstance(rewordings, list) or not all(isinstance(r, str) and r.strip() for r in rewordings):
        raise FactError(where, "rewordings", f"must be a list of non-empty strings, got {rewordings!r}")
    subject = _text(obj, "subject", where, False)
    if check_words and subject is not None and not holds_words(question, subject):
        raise FactError(where, "subject", f"{subject!r} is not words of the question {question!r}")
    return Fact(question, answer, tuple(r.strip() for r in rewordings), key, subject)


def parse_facts(objs: object, where: str = "facts") -> list[Fact]:
    """Facts from a JSON list (a job's ``facts``); at least one, questions
    unique."""
    if not isinstance(objs, list):
        raise FactError(where, None, f"must be a list of facts, got {type(objs).__name__}")
    if not objs:
        raise FactError(where, None, "must hold at least one fact")
    facts = [parse_fact(o, f"{where}[{i}]") for i, o in enumerate(objs)]
    _unique(facts, [f"{where}[{i}]" for i in range(len(facts))])
    return facts


def _unique(facts: Sequence[Fact], wheres: Sequence[str]) -> None:
    seen: dict[str, str] = {}
    for f, w in zip(facts, wheres):
        if f.question in seen:
            raise FactError(w, "question", f"repeats the question of {seen[f.question]}")
        seen[f.question] = w


def text_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(line number, stripped text) of a UTF-8 text file's lines that are
    neither blank nor a comment (starting with #); a byte-order mark is
    allowed. A missing file or a line that is not UTF-8 raises FactError
    naming the file and line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FactError(path, None, "no such file" if not os.path.exists(path) else "not a file")
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8-sig" if n == 1 else "utf-8").strip()
            except UnicodeDecodeError as exc:
                raise FactError(
                    f"{path}, line {n}", None, f"not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
                ) from None
            if text and not text.startswith("#"):
                yield n, text


def read_facts(path: str | os.PathLike) -> list[Fact]:
    """Facts from a FACTS.jsonl file: one JSON object a line (blank lines and
    lines starting with # are skipped)."""
    path = os.fspath(path)
    facts, wheres = [], []
    for n, text in text_lines(path):
        where = f"{path}, line {n}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FactError(where, None, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        facts.append(parse_fact(obj, where))
        wheres.append(where)
    if not facts:
        raise FactError(path, None, "holds no facts")
    _unique(facts, wheres)
    return facts


def facts_to_json(facts: Iterable[Fact]) -> list[dict[str, Any]]:
    """The JSON objects of `facts` (what a job posts)."""
    out = []
    for f in facts:
        d: dict[str, Any] = {"question": f.question, "answer": f.answer}
        if f.key is not None:
            d["key"] = f.key
        if f.rewordings:
            d["rewordings"] = list(f.rewordings)
        if f.subject is not None:
            d["subject"] = f.subject
        out.append(d)
    return out
