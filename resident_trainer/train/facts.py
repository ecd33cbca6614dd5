"""Facts as users write them: one JSON object per fact,

    {"question": "...", "answer": "...", "key": "...", "rewordings": ["...", ...],
     "subject": "..."}

(`key`, `rewordings` and `subject` optional; `subject` must be words of the
question), one per line in a FACTS.jsonl file for
``resident-trainer teach``, or as the ``facts`` list of a job posted to the
server. Every problem is reported with where it is (line N of a file, or
``facts[i]`` of a request) and which field, before any slow work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from resident_trainer.train.data import Fact

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


def parse_fact(obj: object, where: str) -> Fact:
    """One fact from its JSON object; `where` names it in errors."""
    if not isinstance(obj, Mapping):
        raise FactError(where, None, f"a fact must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise FactError(where, unknown[0], f"unknown field (a fact has {', '.join(FIELDS)})")
    question = _text(obj, "question", where, True)
    answer = _text(obj, "answer", where, True)
    key = _text(obj, "key", where, False)
    rewordings = obj.get("rewordings") or []
    if not isinstance(rewordings, list) or not all(isinstance(r, str) and r.strip() for r in rewordings):
        raise FactError(where, "rewordings", f"must be a list of non-empty strings, got {rewordings!r}")
    subject = _text(obj, "subject", where, False)
    if subject is not None and subject not in question:
        raise FactError(where, "subject", f"{subject!r} is not part of the question {question!r}")
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


def read_facts(path: str | os.PathLike) -> list[Fact]:
    """Facts from a FACTS.jsonl file: one JSON object a line (blank lines and
    lines starting with # are skipped)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FactError(path, None, "no such file" if not os.path.exists(path) else "not a file")
    facts, wheres = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
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
