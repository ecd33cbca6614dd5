"""Teach facts, change nothing else: the locality check on a real model.

`teach_and_check` trains an added block on facts, then compares greedy
replies: every fact's question must give its answer, every control prompt
(unrelated to the facts and not among the anchors) must give a reply
byte-identical to the base model's, and each fact's held-out rewording is
counted (reported, not required).

The demo set: four made-up facts no model can know, and fourteen everyday
control prompts.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from resident_trainer.models.adapter import DecoderAdapter
from resident_trainer.train import (
    ANCHOR_PROMPTS,
    AddedSharedNeurons,
    Fact,
    StepMetrics,
    TrainConfig,
    Trainer,
    generate_greedy_batch,
    make_anchors,
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


@dataclass
class LocalityReport:
    facts_recalled: list[bool]
    rewordings_recalled: list[bool]
    controls_unchanged: list[bool]
    replies: dict[str, str]  # prompt -> reply after training
    before: dict[str, str]  # control prompt -> base reply
    history: list[StepMetrics] = field(default_factory=list)
    threshold: float | None = None
    train_seconds: float = 0.0

    def summary(self) -> str:
        def frac(xs):
            return f"{sum(xs)}/{len(xs)}"

        return (
            f"facts recalled {frac(self.facts_recalled)}, reworded questions answered "
            f"{frac(self.rewordings_recalled)}, controls byte-identical {frac(self.controls_unchanged)}"
        )

    @property
    def changed_controls(self) -> list[tuple[str, str, str]]:
        return [
            (p, self.before[p], self.replies[p]) for p, same in zip(self.before, self.controls_unchanged) if not same
        ]


def teach_and_check(
    model,
    tokenizer,
    facts: Sequence[TaughtFact] = DEMO_FACTS,
    controls: Sequence[str] = CONTROL_PROMPTS,
    config: TrainConfig | None = None,
    *,
    anchor_prompts: Sequence[str] = ANCHOR_PROMPTS,
    max_new_tokens: int = 24,
    progress: bool = False,
) -> LocalityReport:
    """Attach a fresh block to `model`, record the base replies to `controls`
    and the anchors, train on `facts`, publish, and compare. The block stays
    attached to the model, published."""
    overlap = set(controls) & set(anchor_prompts)
    if overlap:
        raise ValueError(f"controls must not be anchors (the check would be circular): {sorted(overlap)}")
    config = config or TrainConfig()
    a = DecoderAdapter(model)
    for p in model.parameters():
        p.requires_grad_(False)
    # Controls are generated as one batch before and after (the same batch
    # shapes both times), the facts and rewordings as another.
    controls = list(controls)
    before = dict(zip(controls, generate_greedy_batch(model, tokenizer, controls, max_new_tokens)))
    anchors = make_anchors(model, tokenizer, anchor_prompts)
    block = AddedSharedNeurons(
        a.hidden_size,
        config.num_neurons,
        seed=config.seed,
        init_std=config.init_std,
        dtype=a.head_weight.dtype,
        device=a.device,
    )
    block.attach(a, config.layer)
    trainer = Trainer(a, block, tokenizer, [t.fact for t in facts], config, anchors=anchors)
    t0 = time.perf_counter()
    history = trainer.run(progress=progress)
    seconds = time.perf_counter() - t0
    asked = [q for t in facts for q in (t.fact.question, *t.fact.rewordings)]
    replies = dict(zip(asked, generate_greedy_batch(model, tokenizer, asked, max_new_tokens)))
    replies.update(zip(controls, generate_greedy_batch(model, tokenizer, controls, max_new_tokens)))
    return LocalityReport(
        facts_recalled=[t.recalled_in(replies[t.fact.question]) for t in facts],
        rewordings_recalled=[t.recalled_in(replies[r]) for t in facts for r in t.fact.rewordings],
        controls_unchanged=[replies[c] == before[c] for c in controls],
        replies=replies,
        before=before,
        history=history,
        threshold=block.published_threshold,
        train_seconds=seconds,
    )
