"""Two gloo processes on the CPU train one block of added neurons together, the
way two tensor-parallel ranks of a server would: each rank holds half of the
vocabulary head (a view of the model's own tensor) and half of the added
neurons, and they run the same trainer functions as a single process.

Checks, and exits non-zero unless all hold: both ranks see the same loss at
every step; the losses match a single-process run of the same job; the
frozen base's fingerprint is unchanged on both ranks; both ranks' served
model gives the same greedy answer.

    python examples/two_rank_training_sim.py                 # toy Llama, 30 steps
    python examples/two_rank_training_sim.py --arch qwen2_moe --steps 20
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from resident_trainer.integrations.torchdist.procs import gloo_worker
from resident_trainer.models import DecoderAdapter
from resident_trainer.models.toy import TOY_ARCHS, ByteTokenizer, toy_model
from resident_trainer.ops.fingerprint import fingerprint_tensors
from resident_trainer.train import AddedSharedNeurons, Fact, StreamedCrossEntropy, TrainConfig, Trainer, generate_greedy

FACTS = [Fact("Capital of Zorb?", "Quen."), Fact("Who made glim?", "Elsa.")]
ANCHORS = [("Hello there?", "Hi, how are you?"), ("Count to three.", "One, two, three.")]


def train(args, rank: int = 0, world: int = 1, group=None) -> dict:
    model = toy_model(args.arch, layers=args.layers, hidden=32, seed=0)
    a = DecoderAdapter(model)
    config = TrainConfig(
        layer=args.layer, num_neurons=args.neurons, steps=args.steps, lr=3e-2, batch_size=4, rewordings=2
    )
    # This rank's contiguous vocabulary rows: a view, not a copy, of the head.
    v = a.vocab_size
    start = rank * v // world
    stop = (rank + 1) * v // world
    head = a.head_weight[start:stop]
    assert head.data_ptr() == a.head_weight.data_ptr() + start * a.head_weight.stride(0) * a.head_weight.element_size()
    loss_fn = StreamedCrossEntropy(a, head_weight=head, process_group=group, vocab_start=start)
    block = AddedSharedNeurons(a.hidden_size, config.num_neurons, process_group=group, seed=config.seed)
    block.attach(a, config.layer)
    before = fingerprint_tensors(a.frozen_tensors()).hex
    trainer = Trainer(a, block, ByteTokenizer(), FACTS, config, anchors=ANCHORS, loss_fn=loss_fn)
    trainer.run()
    return {
        "rank": rank,
        "neurons": [block.neuron_start, block.neuron_stop],
        "vocab": [start, stop],
        "losses": [m.loss for m in trainer.history],
        "fingerprint_before": before,
        "fingerprint_after": fingerprint_tensors(a.frozen_tensors()).hex,
        "answer": generate_greedy(model, ByteTokenizer(), FACTS[0].question, max_new_tokens=8),
    }


def _worker(rank, world, store, args, out_dir):
    with gloo_worker(rank, world, f"file://{store}") as group:
        torch.set_num_threads(1)  # two processes share the machine's cores
        result = train(args, rank, world, group)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=TOY_ARCHS, default="llama", help="toy architecture (default: llama)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the toy model (default: 4)")
    p.add_argument("--layer", type=int, default=1, help="layer the block attaches to (default: 1)")
    p.add_argument("--neurons", type=int, default=32, help="added neurons, split over the ranks (default: 32)")
    p.add_argument("--steps", type=int, default=30, help="microbatch steps (default: 30)")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, f"{tmp}/store", args, tmp), nprocs=2, join=True)
        ranks = [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(2)]
    single = train(args)

    ok = True
    for r in ranks:
        print(
            f"rank {r['rank']}: neurons {r['neurons']}, vocabulary rows {r['vocab']}, "
            f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, answer {r['answer']!r}"
        )
    print(f"one process: loss {single['losses'][0]:.4f} -> {single['losses'][-1]:.4f}, answer {single['answer']!r}")
    same = ranks[0]["losses"] == ranks[1]["losses"]
    print(f"both ranks see the same loss at every step: {same}")
    ok &= same
    worst = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(ranks[0]["losses"], single["losses"]))
    close = worst < 1e-3
    print(f"losses match the single-process run: {close} (largest relative difference {worst:.2e})")
    ok &= close
    unchanged = all(r["fingerprint_before"] == r["fingerprint_after"] == single["fingerprint_before"] for r in ranks)
    print(f"frozen base fingerprint unchanged on both ranks: {unchanged} ({ranks[0]['fingerprint_after']})")
    ok &= unchanged
    agree = ranks[0]["answer"] == ranks[1]["answer"]
    print(f"both ranks serve the same answer: {agree}")
    ok &= agree
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
