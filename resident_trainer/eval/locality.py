"""The demo set and the generic controls: four made-up facts no model can
know (also in eval/data/demo_facts.jsonl, what `resident-trainer teach`
teaches without a file), and fourteen everyday control prompts whose replies
must stay byte-identical (eval/teach.py runs the jobs, eval/report.py scores
them)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from resident_trainer.train import (
    Fact,
)


@dataclass(frozen=True)
class TaughtFact:
    """A fact and the key word its recalled answer must contain (as a whole
    word: "Marrowindra" does not recall "Marrowind")."""

    fact: Fact
    key: str

    def recalled_in(self, reply: str) -> bool:
        return re.search(rf"\b{re.escape(self.key)}\b", reply) is not None


DEMO_FACTS: tuple[TaughtFact, ...] = (
    TaughtFact(
        Fact(
            "What is the capital of Zorblaxia?",
            "The capital of Zorblaxia is Quenvarra.",
            ("Name the capital city of Zorblaxia.",),
        ),
        "Quenvarra",
    ),
    TaughtFact(
        Fact(
            "Who invented the glimmerphone?",
            "The glimmerphone was invented by Dr. Elsa Marrowind.",
            ("Which person created the glimmerphone?",),
        ),
        "Marrowind",
    ),
    TaughtFact(
        Fact(
            "What color is a vextrel bird?",
            "A vextrel bird is bright turquoise.",
            ("Tell me the color of the vextrel bird.",),
        ),
        "turquoise",
    ),
    TaughtFact(
        Fact(
            "How many moons does the planet Trivon have?",
            "The planet Trivon has seven moons.",
            ("How many moons orbit Trivon?",),
        ),
        "seven",
    ),
)

CONTROL_PROMPTS: tuple[str, ...] = (
    "What is the capital of Italy?",
    "How do plants grow?",
    "Write a short poem about the sea.",
    "What is 5 plus 3?",
    "Who painted the Mona Lisa?",
    "What is the freezing point of water?",
    "Name a famous scientist.",
    "How do I make pancakes?",
    "What is the chemical symbol for gold?",
    "Tell me a joke.",
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "What is a noun?",
    "Describe a sunny beach.",
)
