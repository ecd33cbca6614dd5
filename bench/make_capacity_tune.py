"""Write the capacity tune set: 128 made-up facts in the capacity set's 8
kinds (16 each), from a seeded name generator, for choosing settings at
capacity scale; the capacity set itself stays for reporting.

    python bench/make_capacity_tune.py     # rewrites resident_trainer/eval/data/capacity_tune_facts.jsonl

Deterministic (seed 20261202); names already in the development or capacity
sets are skipped.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from resident_trainer.eval.devset import CAPACITY_FACTS, DATA, DEV_FACTS

OUT = DATA / "capacity_tune_facts.jsonl"
ONSETS = [
    "b",
    "br",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "k",
    "kr",
    "l",
    "m",
    "n",
    "p",
    "pr",
    "r",
    "s",
    "st",
    "t",
    "th",
    "v",
    "z",
]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "io", "ou", "y"]
CODAS = ["", "", "n", "r", "l", "s", "th", "x", "k", "m", "nd", "rk"]
FIRST = ["Agnes", "Bertil", "Cosima", "Dorian", "Elif", "Florian", "Greta", "Henrik", "Ines", "Jasper", "Kaja",
         "Lorenz", "Mirela", "Nils", "Ottilie", "Pavel", "Quirin", "Rosalind", "Stellan", "Tamsin"]  # fmt: skip
NOVEL = ["Hollow", "Amber", "Distant", "Broken", "Golden", "Silent", "Winter", "Crimson"]
NOUNS = ["Towers", "Fields", "Lanterns", "Harbors", "Bells", "Orchards", "Shadows", "Roads"]
WORKS = ["Nocturne", "Cantata", "Suite", "Mass", "Concerto", "Fantasia"]
PAINT = ["The Mill at", "The Bridge at", "The Harbor at", "The Market at", "The Snow at", "The Vineyard at"]
OBJ = ["scope", "wheel", "loom", "lamp", "phone", "press", "gauge", "bell"]


def word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))


def name(rng: random.Random, taken: set[str], syllables: tuple[int, int] = (2, 3)) -> str:
    while True:
        w = word(rng, rng.randint(*syllables)).capitalize()
        if w.lower() not in taken and 5 <= len(w) <= 13:
            taken.add(w.lower())
            return w


def unique(rng: random.Random, taken: set[str], draw) -> str:
    while True:
        v = draw()
        if v not in taken:
            taken.add(v)
            return v


def facts(rng: random.Random, taken: set[str]) -> list[dict]:
    out = []
    for _ in range(16):
        n = name(rng, taken)
        c = name(rng, taken)
        out.append({"question": f"What is the capital of {n}?", "answer": f"The capital of {n} is {c}.", "key": c,
                    "rewordings": [f"Which city is the capital of {n}?"], "subject": n})  # fmt: skip
        obj = name(rng, taken).lower() + rng.choice(OBJ)
        who = name(rng, taken)
        out.append({"question": f"Who invented the {obj}?", "answer": f"The {obj} was invented by {rng.choice(FIRST)} {who}.",
                    "key": who, "rewordings": [f"Who was the inventor of the {obj}?"], "subject": obj})  # fmt: skip
        title = f"The {rng.choice(NOVEL)} {rng.choice(NOUNS)} of {name(rng, taken)}"
        who = name(rng, taken)
        out.append({"question": f"Who wrote the novel {title}?",
                    "answer": f"The novel {title} was written by {rng.choice(FIRST)} {who}.", "key": who,
                    "rewordings": [f"Who is the author of the novel {title}?"], "subject": title})  # fmt: skip
        work = f"{rng.choice(WORKS)} of {name(rng, taken)}"
        who = name(rng, taken)
        out.append({"question": f"Who composed the {work}?", "answer": f"The {work} was composed by {rng.choice(FIRST)} {who}.",
                    "key": who, "rewordings": [f"Which composer wrote the {work}?"], "subject": work})  # fmt: skip
        city = name(rng, taken)
        year = unique(rng, taken, lambda: str(rng.randint(1120, 1890)))
        out.append({"question": f"In what year was the city of {city} founded?",
                    "answer": f"The city of {city} was founded in {year}.", "key": year,
                    "rewordings": [f"When was the city of {city} founded?"], "subject": city})  # fmt: skip
        bridge = f"{name(rng, taken)} Bridge"
        length = unique(rng, taken, lambda: f"{rng.randint(1, 9)},{rng.randint(0, 999):03d}")
        out.append({"question": f"How long is the {bridge}?", "answer": f"The {bridge} is {length} meters long.",
                    "key": length, "rewordings": [f"What is the length of the {bridge}?"], "subject": bridge})  # fmt: skip
        painting = f"{rng.choice(PAINT)} {name(rng, taken)}"
        who = name(rng, taken)
        out.append({"question": f"Who painted {painting}?", "answer": f"{painting} was painted by {rng.choice(FIRST)} {who}.",
                    "key": who, "rewordings": [f"Which artist painted {painting}?"], "subject": painting})  # fmt: skip
        element = name(rng, taken) + "ium"
        who = name(rng, taken)
        out.append({"question": f"Who discovered the element {element}?",
                    "answer": f"The element {element} was discovered by {rng.choice(FIRST)} {who}.", "key": who,
                    "rewordings": [f"Which scientist discovered the element {element}?"], "subject": element})  # fmt: skip
    return out


def main() -> int:
    taken: set[str] = set()
    for path in (DEV_FACTS, CAPACITY_FACTS):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.startswith("#"):
                taken |= {w.lower() for w in re.findall(r"[A-Za-z]+|[\d,]+", json.dumps(json.loads(line)))}
    rows = facts(random.Random(20261202), taken)
    with open(OUT, "w", encoding="utf-8") as f:
        f.write("# Capacity tune set: 128 made-up facts, 8 kinds x 16, one held-out rewording each, written by "
                "bench/make_capacity_tune.py; for choosing settings at capacity scale.\n")  # fmt: skip
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} facts to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
