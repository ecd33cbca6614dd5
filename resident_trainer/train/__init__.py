"""The training core: an added block of shared-expert neurons trained inside
a frozen model, engine-agnostic (it sees the model through the adapter in
resident_trainer.models and knows nothing of a serving protocol).

| module | what |
|---|---|
| `block` | `AddedSharedNeurons`: trainable and published weights, the forward hook, the exact no-op gate |
| `data` | `Fact`, rewordings, anchor prompts, chat examples, microbatches |
| `facts` | facts as users write them (FACTS.jsonl, a job's `facts`), checked with errors naming line and field |
| `generate` | greedy generation, anchors from the base model's own replies |
| `config` | `TrainConfig`: one job's settings |
| `trainer` | `Trainer`: one microbatch step, the job loop, publish and discard |
| `checkpoint` | the block's safetensors checkpoint |
| `replay` | `LayerReplay`: a step at about one layer's activation memory |
| `loss` | `StreamedCrossEntropy`: the loss over the model's own head, in tiles |
| `frozen` | `FrozenFingerprint`: the proof that the base did not change |
| `parallel` | neuron shards and gradient clipping across tensor-parallel ranks |
"""

from resident_trainer.train.block import AddedSharedNeurons
from resident_trainer.train.checkpoint import (
    CHECKPOINT_FORMAT,
    checkpoint_bytes,
    load_block,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from resident_trainer.train.config import TrainConfig, steps_for
from resident_trainer.train.data import (
    ANCHOR_PROMPTS,
    ANCHOR_REPLY_TOKENS,
    NEGATIVE_REPLY_TOKENS,
    REWORD_TEMPLATES,
    SUBJECT_PROMPT,
    Fact,
    Microbatch,
    chat_prompt_ids,
    collate,
    example_ids,
    pack,
    rewordings,
)
from resident_trainer.train.facts import FactError, facts_to_json, parse_fact, parse_facts, read_facts
from resident_trainer.train.frozen import FrozenFingerprint, FrozenWeightsChanged
from resident_trainer.train.generate import (
    generate_greedy,
    generate_greedy_batch,
    generate_greedy_batch_ids,
    generate_greedy_ids,
    make_anchors,
)
from resident_trainer.train.loss import StreamedCrossEntropy
from resident_trainer.train.parallel import clip_grad_norm_, shard_range
from resident_trainer.train.replay import LayerReplay, ReplayResult, full_graph_step
from resident_trainer.train.trainer import StepMetrics, Trainer, TrainingAborted

__all__ = [
    "ANCHOR_PROMPTS",
    "ANCHOR_REPLY_TOKENS",
    "NEGATIVE_REPLY_TOKENS",
    "CHECKPOINT_FORMAT",
    "REWORD_TEMPLATES",
    "SUBJECT_PROMPT",
    "AddedSharedNeurons",
    "Fact",
    "FactError",
    "FrozenFingerprint",
    "FrozenWeightsChanged",
    "LayerReplay",
    "Microbatch",
    "ReplayResult",
    "StepMetrics",
    "StreamedCrossEntropy",
    "TrainConfig",
    "Trainer",
    "TrainingAborted",
    "chat_prompt_ids",
    "checkpoint_bytes",
    "clip_grad_norm_",
    "collate",
    "example_ids",
    "facts_to_json",
    "full_graph_step",
    "generate_greedy",
    "generate_greedy_batch",
    "generate_greedy_batch_ids",
    "generate_greedy_ids",
    "load_block",
    "load_checkpoint",
    "read_checkpoint",
    "make_anchors",
    "pack",
    "parse_fact",
    "parse_facts",
    "read_facts",
    "rewordings",
    "save_checkpoint",
    "shard_range",
    "steps_for",
]
