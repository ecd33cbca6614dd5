"""Train a block of added neurons in one process and watch it answer, on a
toy Llama (random weights, byte tokenizer: runs in seconds), with the anchor
penalty and the exact no-op gate, checking that an unrelated prompt gets a
byte-identical reply. The same on SmolLM2-135M: `resident-trainer teach`.

    python examples/toy_train.py
    python examples/toy_train.py --steps 60 --neurons 64
"""

from __future__ import annotations

import argparse
import sys
import time

from resident_trainer.models import DecoderAdapter
from resident_trainer.models.toy import ByteTokenizer, toy_model
from resident_trainer.train import AddedSharedNeurons, Fact, TrainConfig, Trainer, generate_greedy, make_anchors

FACTS = [Fact("Capital of Zorb?", "Quen."), Fact("Who made glim?", "Elsa.")]
CONTROLS = ["Hello there?"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="microbatch steps (default: 40)")
    p.add_argument("--layer", type=int, default=1, help="layer of the block, of 4 (default: 1)")
    p.add_argument("--neurons", type=int, default=32, help="added neurons (default: 32)")
    args = p.parse_args(argv)
    t0 = time.time()
    model, tok = toy_model("llama", layers=4, hidden=32), ByteTokenizer()
    facts, controls = FACTS, CONTROLS
    # Random rows, every neuron on every fact: keyed neurons (the default, chosen
    # on SmolLM2) find no subject to key on in a byte-level toy vocabulary.
    config = TrainConfig(
        layer=args.layer,
        num_neurons=args.neurons,
        steps=args.steps,
        lr=3e-2,
        batch_size=4,
        rewordings=2,
        init="random",
    )
    a = DecoderAdapter(model)
    before = {c: generate_greedy(model, tok, c) for c in controls}
    # Anchors: the base model's own replies (for the toy, to the control
    # prompts themselves; the real trainer uses generic prompts, not controls).
    anchors = make_anchors(model, tok, controls, 24)
    block = AddedSharedNeurons(a.hidden_size, config.num_neurons, seed=config.seed)
    block.attach(a, config.layer)
    trainer = Trainer(a, block, tok, facts, config, anchors=anchors)
    print(
        f"training {config.num_neurons} neurons at layer {config.layer} for {config.steps} steps ...", file=sys.stderr
    )
    hist = trainer.run(progress=True)
    print(
        f"loss {hist[0].loss:.3f} -> {hist[-1].loss:.4f} in {time.time() - t0:.0f} s; gate threshold {block.published_threshold}"
    )
    for f in facts:
        print(f"Q: {f.question}\nA: {generate_greedy(model, tok, f.question)}")
    same = sum(generate_greedy(model, tok, c) == before[c] for c in controls)
    print(f"unrelated prompts with byte-identical replies: {same}/{len(controls)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
