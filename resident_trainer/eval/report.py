"""The teaching report: what a run of jobs taught and what it left alone.

`score` turns greedy replies into the report ``resident-trainer teach
--report`` writes (docs/EVALUATION.md has the protocol):

- a fact is recalled when the reply to its question contains its key as a
  whole word ("Marrowindra" does not recall "Marrowind"); each held-out
  rewording is scored the same way;
- a control is identical when its reply after the jobs is byte-identical to
  the reply before them;
- a leak is a reply to a taught question (or rewording) that contains another
  taught fact's key (and not its own fact's key inside that word).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from resident_trainer.train.data import Fact, holds_words

#: Whether a reply holds a key as a whole word (or words): what "recalled" means.
contains_key = holds_words


def score(
    facts: Sequence[Fact],
    replies: Mapping[str, str],
    controls: Sequence[tuple[str, str]],
    before: Mapping[str, str],
) -> dict[str, Any]:
    """The report's facts, controls, leaks and summary.

    replies: prompt -> reply after the jobs, for every fact's question, every
    rewording and every control; controls: (prompt, kind) pairs, kind e.g.
    "generic" or "near"; before: control prompt -> reply before the jobs."""
    out_facts = []
    for f in facts:
        key = f.recall_key
        out_facts.append(
            {
                "question": f.question,
                "key": key,
                "reply": replies[f.question],
                "recalled": contains_key(replies[f.question], key),
                "rewordings": [
                    {"question": r, "reply": replies[r], "recalled": contains_key(replies[r], key)}
                    for r in f.rewordings
                ],
            }
        )
    out_controls = [
        {
            "prompt": p,
            "kind": kind,
            "before": before[p],
            "after": replies[p],
            "identical": before[p] == replies[p],
        }
        for p, kind in controls
    ]
    leaks = []
    for f in facts:
        for q in (f.question, *f.rewordings):
            for g in facts:
                if g is f or g.recall_key == f.recall_key or contains_key(f.recall_key, g.recall_key):
                    continue
                if contains_key(replies[q], g.recall_key):
                    leaks.append({"question": q, "leaked_key": g.recall_key, "from": g.question})
    summary: dict[str, Any] = {
        "facts": len(facts),
        "recalled": sum(x["recalled"] for x in out_facts),
        "rewordings": sum(len(x["rewordings"]) for x in out_facts),
        "rewordings_recalled": sum(r["recalled"] for x in out_facts for r in x["rewordings"]),
        "controls": len(out_controls),
        "controls_identical": sum(c["identical"] for c in out_controls),
        "leaks": len(leaks),
    }
    for kind in dict.fromkeys(k for _, k in controls):
        mine = [c for c in out_controls if c["kind"] == kind]
        summary[f"{kind}_controls"] = len(mine)
        summary[f"{kind}_controls_identical"] = sum(c["identical"] for c in mine)
    summary["passed"] = summary["recalled"] == len(facts) and summary["controls_identical"] == len(out_controls)
    return {"facts": out_facts, "controls": out_controls, "leaks": leaks, "summary": summary}


def add_retracted(report: dict[str, Any], retracted: Sequence[Fact], replies: Mapping[str, str]) -> None:
    """Score the retracted facts' replies into `report` (when there are any):
    ``retracted`` (scored as facts are) and the summary's ``retracted`` and
    ``retracted_still_recalled`` (a retraction wants it 0)."""
    if not retracted:
        return
    report["retracted"] = score(retracted, replies, [], {})["facts"]
    report["summary"]["retracted"] = len(retracted)
    report["summary"]["retracted_still_recalled"] = sum(x["recalled"] for x in report["retracted"])


def shortfalls(report: Mapping[str, Any]) -> dict[str, list]:
    """What a scored report fell short on, small enough to keep after every
    job: ``missed`` (each fact not recalled: question, reply),
    ``rewordings_missed`` (the rewordings not recalled: question, reply),
    ``changed`` (each control not identical: prompt, kind, reply after) and
    ``leaks`` (as in the report)."""
    return {
        "missed": [{"question": f["question"], "reply": f["reply"]} for f in report["facts"] if not f["recalled"]],
        "rewordings_missed": [
            {"question": r["question"], "reply": r["reply"]}
            for f in report["facts"]
            for r in f["rewordings"]
            if not r["recalled"]
        ],
        "changed": [
            {"prompt": c["prompt"], "kind": c["kind"], "after": c["after"]}
            for c in report["controls"]
            if not c["identical"]
        ],
        "leaks": list(report["leaks"]),
    }


def add_gate_openings(report: dict[str, Any], openings: Sequence[tuple[int, float | None] | None]) -> None:
    """Each control's ``gate_open`` and ``gate_margin`` (eval.teach.gate_openings; None
    without a gate), and the summary's count of controls on which the gate
    stayed shut, in all and by kind."""
    for c, o in zip(report["controls"], openings):
        c["gate_open"], c["gate_margin"] = (None, None) if o is None else o
    summary = report["summary"]
    shut = [c for c in report["controls"] if c["gate_open"] == 0]
    summary["controls_gate_shut"] = len(shut)
    for kind in dict.fromkeys(c["kind"] for c in report["controls"]):
        summary[f"{kind}_controls_gate_shut"] = sum(c["kind"] == kind for c in shut)


def summary_line(summary: Mapping[str, Any]) -> str:
    """One line a person reads."""
    parts = [
        f"facts recalled {summary['recalled']}/{summary['facts']}",
        f"rewordings {summary['rewordings_recalled']}/{summary['rewordings']}",
    ]
    kinds = [k[: -len("_controls")] for k in summary if k.endswith("_controls") and not k.startswith("controls")]
    for kind in kinds:
        parts.append(f"{kind} controls identical {summary[f'{kind}_controls_identical']}/{summary[f'{kind}_controls']}")
    parts.append(f"leaks {summary['leaks']}")
    if "controls_gate_shut" in summary:
        parts.append(f"gate shut on {summary['controls_gate_shut']}/{summary['controls']} controls")
    return ", ".join(parts)
