"""The real Trainer as the protocol's job body: the head and worker loops
(two threads over a torch HashStore) run a training job between serving ops;
each rank's Trainer steps only at the job's boundaries, publishes at its
commit with the gate calibrated, checkpoints the block, and the base stays
unchanged. A second job whose body fails leaves the published block alone."""

import torch
from protocol_harness import run_pair

from resident_trainer.models import DecoderAdapter
from resident_trainer.models.toy import ByteTokenizer, toy_model
from resident_trainer.ops.fingerprint import fingerprint_tensors
from resident_trainer.protocol.checkpoint import CheckpointStore
from resident_trainer.protocol.job import JobSpec
from resident_trainer.train import AddedSharedNeurons, Fact, TrainConfig, Trainer, load_checkpoint
from resident_trainer.train.data import example_ids

FACTS = [Fact("Capital of Zorb?", "Quen."), Fact("Who made glim?", "Elsa.")]
ANCHORS = [("Hello there?", "Hi, how are you?"), ("Count to three.", "One, two, three.")]


class Rank:
    """One rank's server-side state: the model it serves and its block."""

    def __init__(self):
        self.model = toy_model("llama", layers=4, hidden=32, seed=0)
        self.adapter = DecoderAdapter(self.model)
        self.config = TrainConfig(layer=1, num_neurons=32, steps=12, lr=3e-2, batch_size=4, init="random")
        self.block = AddedSharedNeurons(self.adapter.hidden_size, 32, seed=0)
        self.block.attach(self.adapter, 1)
        self.base = fingerprint_tensors(self.adapter.frozen_tensors())
        self.trainers = []
        self.served_during_job = []

    def body(self, spec, ctx):
        t = Trainer(self.adapter, self.block, ByteTokenizer(), FACTS, self.config, anchors=ANCHORS)
        step = t.step

        def observed_step(i):  # what serving answers mid-job: the published block
            self.served_during_job.append(self.logits())
            return step(i)

        t.step = observed_step
        self.trainers.append(t)
        return t

    def logits(self):
        # The fact's chat exchange, as trained: the gate opens on its tokens
        # (on the bare question, outside the template, it may rightly stay shut).
        ids = torch.tensor([example_ids(ByteTokenizer(), FACTS[0].question, FACTS[0].answer)[0]])
        with torch.no_grad():
            return self.model(ids).logits


def test_trainer_runs_as_the_protocol_job_body(tmp_path):
    ranks = [Rank(), Rank()]
    before = ranks[0].logits()
    run = run_pair(
        tmp_path,
        [ranks[0].body, ranks[1].body],
        [JobSpec("teach", steps=12, root=str(tmp_path / "job"), authority="a")],
    )
    assert [(r["job"], r["outcome"]) for r in run.receipts[0]] == [("teach", "publish")]
    assert [r["outcome"] for r in run.receipts[1]] == ["publish"]
    for rank in ranks:
        (t,) = rank.trainers
        assert [m.step for m in t.history] == list(range(12))
        assert t.history[-1].loss < t.history[0].loss
        # serving saw the old (zero) block until the commit, then the new one
        assert all(torch.equal(x, before) for x in rank.served_during_job)
        served = rank.logits()
        assert not torch.equal(served, before), (
            f"the published block changed nothing: threshold {rank.block.published_threshold}, "
            f"history {[round(m.loss, 4) for m in t.history]}"
        )
        assert rank.block.published_threshold is not None  # the gate was calibrated at publish
        assert torch.equal(rank.block.published_down, rank.block.w_down)
        assert fingerprint_tensors(rank.adapter.frozen_tensors()) == rank.base
    # both ranks hold the same block; the checkpoint the protocol kept loads back
    assert torch.equal(ranks[0].block.published_gate_up, ranks[1].block.published_gate_up)
    last = CheckpointStore(run.fs, run.cfg.checkpoints_dir).last_good()
    assert last.name == "teach"
    path = tmp_path / "ck.safetensors"
    path.write_bytes(CheckpointStore(run.fs, run.cfg.checkpoints_dir).load(0)[1])
    fresh = Rank()
    t = Trainer(fresh.adapter, fresh.block, ByteTokenizer(), FACTS, fresh.config)
    load_checkpoint(t, path)  # after a restart: load the last good checkpoint and serve it
    fresh.block.publish()
    for name in ("published_gate_up", "published_down"):
        assert torch.equal(getattr(fresh.block, name), getattr(ranks[0].block, name))
    assert torch.equal(fresh.block.published_threshold, ranks[0].block.published_threshold)
    assert torch.equal(fresh.logits(), ranks[0].logits())


def test_a_failing_job_publishes_nothing(tmp_path):
    ranks = [Rank(), Rank()]
    served = ranks[0].logits()

    def failing(rank):
        def body(spec, ctx):
            t = rank.body(spec, ctx)
            step = t.step

            def step_then_fail(i):
                if i == 3 and rank is ranks[1]:
                    raise RuntimeError("injected failure on the worker")
                return step(i)

            t.step = step_then_fail
            return t

        return body

    run = run_pair(
        tmp_path,
        [failing(ranks[0]), failing(ranks[1])],
        [JobSpec("bad", steps=8, root=str(tmp_path / "job"), authority="a")],
    )
    outcomes = [r["outcome"] for rank in (0, 1) for r in run.receipts[rank]]
    assert outcomes and "publish" not in outcomes, outcomes
    for rank in ranks:
        assert torch.equal(rank.logits(), served)  # serving never saw the half-trained block
        assert rank.block.published_threshold is None
        assert rank.block.published_down.abs().max() == 0
        assert torch.equal(rank.block.w_down, rank.block.published_down)  # discarded: back to published
