"""The trainer: added shared-expert neurons at one layer, one microbatch step,
the job loop, checkpoints.

`AddedSharedNeurons` holds two copies of its weights: the trainable ones a job
trains and the published ones serving reads. It attaches to layer L's
feed-forward block with a forward hook on that module instance (nothing in
transformers is patched) and adds ``down(silu(x Wg^T) * (x Wu^T))`` of the
block's own input (the normalized hidden) to the block's output, i.e. to the
residual stream, exactly like extra neurons of the layer's (shared-expert)
MLP. The down projection starts at zero, so a fresh block changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from resident_trainer.models.adapter import DecoderAdapter
from resident_trainer.ops.added_expert import added_expert
from resident_trainer.ops.fingerprint import fingerprint_tensors
from resident_trainer.thin import LayerReplay, StreamedCrossEntropy


def _split(total: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of `total` items (the first
    `total % world` ranks get one more)."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class AddedSharedNeurons(nn.Module):
    """`num_neurons` added SwiGLU neurons on a `hidden_size` residual stream.

    Trainable: ``w_gate_up`` (2A, D), gate rows first, and ``w_down`` (D, A),
    where A is this rank's share of the neurons under tensor parallelism
    (`process_group`). Published (what serving uses): the buffers
    ``published_gate_up``, ``published_down`` and ``published_threshold``.

    threshold: the exact no-op gate. When set, the block outputs exactly zero
    (and takes no gradient) on tokens whose strongest gate pre-activation
    ``max_a (x . Wg_a)`` is at or below it (over all ranks' neurons). None: off.
    """

    def __init__(
        self,
        hidden_size: int,
        num_neurons: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        process_group=None,
        init_std: float = 0.02,
        seed: int = 0,
        impl: str = "auto",
    ):
        super().__init__()
        if not isinstance(num_neurons, int) or num_neurons < 1:
            raise ValueError(f"num_neurons must be a positive int, got {num_neurons!r}")
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        world = dist.get_world_size(process_group) if process_group is not None else 1
        rank = dist.get_rank(process_group) if process_group is not None else 0
        if num_neurons < world:
            raise ValueError(f"num_neurons={num_neurons} is smaller than the process group ({world} ranks)")
        self.hidden_size, self.num_neurons = hidden_size, num_neurons
        self.process_group = process_group
        self.neuron_start, self.neuron_stop = _split(num_neurons, world, rank)
        a = self.neuron_stop - self.neuron_start
        # The full gate/up init is drawn on every rank from one seed and each
        # rank keeps its rows: any split gives the same block as one process.
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(2, num_neurons, hidden_size, generator=g) * init_std
        gate_up = torch.cat([full[0, self.neuron_start : self.neuron_stop], full[1, self.neuron_start : self.neuron_stop]])
        kw = dict(dtype=dtype, device=device)
        self.w_gate_up = nn.Parameter(gate_up.to(**kw))
        self.w_down = nn.Parameter(torch.zeros(hidden_size, a, **kw))
        self.register_buffer("published_gate_up", gate_up.to(**kw).clone())
        self.register_buffer("published_down", torch.zeros(hidden_size, a, **kw))
        self.threshold: float | None = None
        self.published_threshold: float | None = None
        self.impl = impl
        self._train_active = False
        self._capture: list[Tensor] | None = None

    @property
    def local_neurons(self) -> int:
        return self.neuron_stop - self.neuron_start

    # --- the block itself -------------------------------------------------

    def _scores(self, x: Tensor, w_gate_up: Tensor) -> Tensor:
        """Strongest gate pre-activation per token over every rank's neurons
        (differentiable on the rank(s) holding the max)."""
        score = (x @ w_gate_up[: self.local_neurons].T).float().amax(-1)
        if self.process_group is not None:
            score = _MaxOverRanks.apply(score, self.process_group)
        return score

    def gate_mask(self, x: Tensor, w_gate_up: Tensor, threshold: float | None) -> Tensor | None:
        """(..., ) bool: tokens whose strongest gate pre-activation (over every
        rank's neurons) exceeds `threshold`; None when there is no gate."""
        if threshold is None:
            return None
        with torch.no_grad():
            return self._scores(x, w_gate_up) > threshold

    def gate_scores(self, x: Tensor, *, published: bool = False) -> Tensor:
        """Strongest gate pre-activation per token (over every rank's neurons)."""
        with torch.no_grad():
            return self._scores(x, self.published_gate_up if published else self.w_gate_up)

    def block(self, x: Tensor, *, published: bool, gated: bool = True) -> Tensor:
        """The block's output for input x (..., D): the trainable weights with
        autograd, or the published ones; `gated=False` ignores the threshold."""
        if published:
            w_gu, w_d, thr = self.published_gate_up, self.published_down, self.published_threshold
        else:
            w_gu, w_d, thr = self.w_gate_up, self.w_down, self.threshold
        mask = self.gate_mask(x, w_gu, thr if gated else None)
        return added_expert(x, w_gu, None, w_d, token_mask=mask, process_group=self.process_group, impl=self.impl)

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x, published=not self._train_active)

    # --- attaching to a model -----------------------------------------------

    def attach(self, adapter: DecoderAdapter, layer: int):
        """Add the block to layer `layer`'s feed-forward output (a forward hook
        on that module instance). Returns the hook handle; .remove() detaches."""
        ffn = adapter.ffn(layer)
        if self.hidden_size != adapter.hidden_size:
            raise ValueError(f"the block's hidden_size={self.hidden_size} does not match the model's {adapter.hidden_size}")
        return ffn.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        x = inputs[0]
        if self._capture is not None:
            self._capture.append(x.detach())
        return output + self.block(x, published=not self._train_active).to(output.dtype)

    @contextlib.contextmanager
    def training_weights(self) -> Iterator[None]:
        """Within the context, the attached block uses (and trains) the
        trainable weights; outside it, serving reads the published ones."""
        prev, self._train_active = self._train_active, True
        try:
            yield
        finally:
            self._train_active = prev

    @contextlib.contextmanager
    def capture_inputs(self) -> Iterator[list[Tensor]]:
        """Record the block's inputs (detached) while the context is open."""
        prev, self._capture = self._capture, []
        try:
            yield self._capture
        finally:
            self._capture = prev

    # --- publishing ------------------------------------------------------------

    @torch.no_grad()
    def publish(self) -> None:
        """Serving starts using the trained weights (and gate threshold)."""
        self.published_gate_up.copy_(self.w_gate_up)
        self.published_down.copy_(self.w_down)
        self.published_threshold = self.threshold

    @torch.no_grad()
    def revert(self) -> None:
        """Drop unpublished training: trainable weights back to the published."""
        self.w_gate_up.copy_(self.published_gate_up)
        self.w_down.copy_(self.published_down)
        self.threshold = self.published_threshold

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_neurons={self.num_neurons}, "
            f"local=[{self.neuron_start}, {self.neuron_stop}), threshold={self.threshold}"
        )


# --- data: facts, rewordings, anchors, microbatches ----------------------------


@dataclass(frozen=True)
class Fact:
    """A question and the answer the block should give. `rewordings` are other
    phrasings of the question, kept out of training to measure generalisation."""

    question: str
    answer: str
    rewordings: tuple[str, ...] = ()


# Surface rewordings used for augmentation: the question inside different
# framings a user might type. They widen the contexts the block fires in
# without needing any data beyond the fact itself.
REWORD_TEMPLATES: tuple[str, ...] = (
    "{q}",
    "Quick question: {q}",
    "{q} Please answer briefly.",
    "Do you know this? {q}",
    "I was wondering: {q}",
    "{lq}",
    "Tell me: {q}",
    "Can you answer this? {q}",
)


def rewordings(question: str, n: int) -> list[str]:
    """The first `n` template framings of `question` (the plain question first)."""
    q = question.strip()
    lq = q[0].lower() + q[1:] if q else q
    out = []
    for t in REWORD_TEMPLATES[: max(1, n)]:
        out.append(t.format(q=q, lq=lq))
    return out


# Generic prompts whose replies, generated by the base model itself, are the
# anchors: text the block must leave alone. No external data is involved.
ANCHOR_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "How do I boil an egg?",
    "Write a haiku about autumn.",
    "What is photosynthesis?",
    "Give me three tips for better sleep.",
    "Explain what a computer is to a child.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "How do airplanes stay in the air?",
    "Translate 'good morning' into Spanish.",
    "What are the primary colors?",
    "Suggest a name for a pet cat.",
    "Why is the sky blue?",
    "What is the boiling point of water?",
    "How many days are in a leap year?",
    "Describe a rainy day in one sentence.",
    "What is the difference between a virus and a bacterium?",
    "List three fruits that are red.",
    "What does a doctor do?",
    "How do I make a cup of tea?",
    "What is the speed of light?",
    "Tell me a fun fact about octopuses.",
    "What is the tallest mountain in the world?",
    "How do I say thank you in French?",
    "What is gravity?",
    "Recommend a good habit for students.",
    "What is the main language spoken in Brazil?",
    "Explain what a verb is.",
    "What season comes after winter?",
)


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of the chat-formatted user turn, ready for the assistant reply."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def example_ids(tokenizer, question: str, answer: str | Sequence[int]) -> tuple[list[int], list[int]]:
    """(input ids, targets) of one chat exchange; targets are the next token on
    the answer (and its end-of-turn token), -100 elsewhere. `answer` is text
    (tokenized, end-of-turn appended) or the reply's token ids exactly as
    generated (kept as they are)."""
    prompt = chat_prompt_ids(tokenizer, question)
    if isinstance(answer, str):
        reply = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    else:
        reply = [int(t) for t in answer]
    ids = prompt + reply
    targets = [-100] * (len(prompt) - 1) + reply + [-100]
    return ids, targets


@dataclass
class Microbatch:
    input_ids: Tensor  # (B, T)
    attention_mask: Tensor  # (B, T), 1 on tokens, 0 on padding
    targets: Tensor  # (B, T), -100 where no loss


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int, device=None) -> Microbatch:
    """Right-pad examples into one microbatch."""
    if not examples:
        raise ValueError("collate needs at least one example")
    t = max(len(ids) for ids, _ in examples)
    b = len(examples)
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    tgt = torch.full((b, t), -100, dtype=torch.long)
    for i, (x, y) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
        tgt[i, : len(y)] = torch.tensor(y)
    return Microbatch(ids.to(device), mask.to(device), tgt.to(device))


@torch.no_grad()
def generate_greedy_ids(model, tokenizer, question: str, max_new_tokens: int = 24) -> list[int]:
    """Token ids of the model's greedy chat reply to `question` (attached
    blocks serve their published weights); ends with the end-of-turn token
    when the model produced it."""
    ids = torch.tensor([chat_prompt_ids(tokenizer, question)], device=next(model.parameters()).device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return out[0, ids.shape[1] :].tolist()


def generate_greedy(model, tokenizer, question: str, max_new_tokens: int = 24) -> str:
    """The model's greedy chat reply to `question`, as text."""
    return tokenizer.decode(generate_greedy_ids(model, tokenizer, question, max_new_tokens), skip_special_tokens=True)


def make_anchors(
    model, tokenizer, prompts: Sequence[str] = ANCHOR_PROMPTS, max_new_tokens: int = 32
) -> list[tuple[str, list[int]]]:
    """Anchor examples: each generic prompt with the base model's own greedy
    reply, as the token ids it generated (text would not always tokenize back
    to them). Generate these before any block is published."""
    return [(p, generate_greedy_ids(model, tokenizer, p, max_new_tokens)) for p in prompts]


# --- training ----------------------------------------------------------------------


@dataclass
class TrainConfig:
    """One job's settings. Defaults chosen by measurement on SmolLM2-135M
    (docs/RESULTS.md)."""

    layer: int = 15
    neurons: int = 256
    steps: int = 60
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    clip: float = 1.0
    batch_size: int = 8
    # Template framings per fact in training (1: the question alone). Off by
    # default: on SmolLM2 four framings made the block fire more widely
    # (controls changed) and answered fewer held-out rewordings (RESULTS.md).
    rewordings: int = 1
    anchor_weight: float = 1.0  # penalty on the block's output norm over anchor tokens
    # Penalty on the gate score (where positive) over anchor tokens: with it
    # every fact was recalled for each of three seeds, without it 4, 3, 2 of 4.
    anchor_gate_weight: float = 0.1
    anchor_batch: int = 8  # anchors per step
    gate: bool = True  # calibrate the exact no-op gate after training
    # threshold = max anchor score + margin * |max|. Controls' maxima land near
    # the anchors' (a sample maximum of the same kind); 0.05 let one through.
    gate_margin: float = 0.2
    # From this step on, recalibrate the gate before every step and train
    # through it, so the block learns to act through the tokens it passes
    # (None: the gate is set only after training).
    gated_from: int | None = None
    seed: int = 0
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("neurons", "steps", "batch_size", "rewordings", "anchor_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("lr", "clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("weight_decay", "anchor_weight", "anchor_gate_weight", "gate_margin"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.gated_from is not None and (not isinstance(self.gated_from, int) or self.gated_from < 0):
            raise ValueError(f"gated_from must be None or an int >= 0, got {self.gated_from!r}")


class TrainingAborted(RuntimeError):
    """A job stopped without publishing; the block keeps its last good weights."""


@dataclass
class StepMetrics:
    step: int
    loss: float
    anchor_penalty: float
    grad_norm: float


class _MaxOverRanks(torch.autograd.Function):
    """Elementwise max of a per-rank value over the ranks; the gradient goes to
    the rank(s) holding the max."""

    @staticmethod
    def forward(ctx, t, group):
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        ctx.save_for_backward(t == out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (owner,) = ctx.saved_tensors
        return grad * owner, None


def clip_grad_norm_(params: Sequence[Tensor], max_norm: float, process_group=None) -> float:
    """Clip the gradients of `params` (each rank's shard under TP) to a global
    norm of `max_norm`; returns the norm before clipping, the same on every rank."""
    sq = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for p in params:
        if p.grad is not None:
            sq = sq + p.grad.float().square().sum()
    if process_group is not None:
        dist.all_reduce(sq, group=process_group)
    norm = float(sq.sqrt())
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


class Trainer:
    """Trains an AddedSharedNeurons block attached at `config.layer` of a frozen
    model on facts, with the anchor penalty, rewording augmentation and gate
    calibration; one `step()` per microbatch. Implements the protocol's
    JobBody (fingerprint, step, checkpoint, publish, discard)."""

    def __init__(
        self,
        adapter: DecoderAdapter,
        block: AddedSharedNeurons,
        tokenizer,
        facts: Sequence[Fact],
        config: TrainConfig,
        *,
        anchors: Sequence[tuple[str, str | Sequence[int]]] = (),
        loss_fn: StreamedCrossEntropy | None = None,
    ):
        if not facts:
            raise ValueError("facts must not be empty")
        self.adapter, self.block, self.tokenizer, self.config = adapter, block, tokenizer, config
        self.layer = adapter.check_layer(config.layer)
        self.facts = list(facts)
        self.loss_fn = loss_fn or StreamedCrossEntropy(adapter)
        self.replay = LayerReplay(adapter, self.layer)
        self.params = [block.w_gate_up, block.w_down]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        self.step_index = 0
        self.history: list[StepMetrics] = []
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = pad
        self.examples = [
            example_ids(tokenizer, q, f.answer) for f in self.facts for q in rewordings(f.question, config.rewordings)
        ]
        self.anchor_inputs = self._anchor_inputs(anchors) if anchors else []
        self.base_fingerprint = fingerprint_tensors(adapter.frozen_tensors())
        # A job trains ungated (until gated_from): the threshold a previous job
        # published keeps serving, but must not hide the new facts' tokens.
        block.threshold = None
        self._gate_step: int | None = None  # step_index the threshold was calibrated at

    # --- anchors -----------------------------------------------------------

    @torch.no_grad()
    def _anchor_inputs(self, anchors: Sequence[tuple[str, str | Sequence[int]]]) -> list[Tensor]:
        """The block's inputs (layer L's normalized hidden) on every token of
        each anchor exchange: fixed for the job, since the base is frozen and
        the block acts after them."""
        out = []
        for prompt, reply in anchors:
            ids, _ = example_ids(self.tokenizer, prompt, reply)
            t = torch.tensor([ids], device=self.adapter.device)
            h, ctx = self.replay.prefix(t)
            with self.block.capture_inputs() as cap:
                self.adapter.run_layer(self.layer, h, ctx)
            out.append(cap[0].reshape(-1, self.adapter.hidden_size))
        return out

    def _anchor_penalty(self, index: int) -> Tensor | None:
        """anchor_weight x mean squared norm of the block's output on anchor
        tokens, plus anchor_gate_weight x mean over anchor tokens of the squared
        positive part of the gate score: the first keeps the block quiet on
        them, the second pushes their scores, hence the threshold, down."""
        cfg = self.config
        if not self.anchor_inputs or (cfg.anchor_weight == 0 and cfg.anchor_gate_weight == 0):
            return None
        k = cfg.anchor_batch
        n = len(self.anchor_inputs)
        pick = [self.anchor_inputs[(index * k + j) % n] for j in range(min(k, n))]
        x = torch.cat(pick)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        if cfg.anchor_weight:
            # Ungated: under gated training the anchors sit below the threshold,
            # and the penalty still keeps the block itself quiet on them.
            out = self.block.block(x, published=False, gated=False)
            total = total + cfg.anchor_weight * out.float().square().sum(-1).mean()
        if cfg.anchor_gate_weight:
            # The gate's score on each anchor token (its strongest gate
            # pre-activation over every rank's neurons), pushed down where
            # positive; the gradient reaches the neuron(s) holding the max.
            top = self.block._scores(x, self.block.w_gate_up)
            total = total + cfg.anchor_gate_weight * torch.relu(top).square().mean()
        return total

    # --- one microbatch ------------------------------------------------------

    def microbatch(self, index: int) -> Microbatch:
        """Microbatch `index`: a deterministic rotation through the examples."""
        n = len(self.examples)
        k = self.config.batch_size
        chosen = [self.examples[(index * k + j) % n] for j in range(k)]
        return collate(chosen, self.pad_id, self.adapter.device)

    def step(self, index: int | None = None) -> dict[str, float]:
        """One microbatch: replayed forward/backward, clipping, AdamW. A NaN or
        inf loss or gradient raises TrainingAborted before the weights move."""
        index = self.step_index if index is None else index
        mb = self.microbatch(index)
        cfg = self.config
        if cfg.gate and cfg.gated_from is not None and index >= cfg.gated_from:
            self.calibrate_gate()
        self.optimizer.zero_grad(set_to_none=True)
        penalty_value = 0.0

        def extra():
            nonlocal penalty_value
            p = self._anchor_penalty(index)
            penalty_value = float(p.detach()) if p is not None else 0.0
            return p if p is not None else torch.zeros((), device=self.adapter.device)

        with self.block.training_weights():
            res = self.replay.step(
                mb.input_ids,
                lambda h: self.loss_fn(h, mb.targets),
                attention_mask=mb.attention_mask,
                extra_loss=extra if self.anchor_inputs else None,
            )
        loss = float(res.loss)
        norm = clip_grad_norm_(self.params, self.config.clip, self.block.process_group)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise TrainingAborted(f"step {index}: loss {loss}, gradient norm {norm}: the job stops, nothing is published")
        self.optimizer.step()
        self.step_index = index + 1
        m = StepMetrics(index, loss - penalty_value, penalty_value, norm)
        self.history.append(m)
        return asdict(m)

    # --- the exact no-op gate --------------------------------------------------------

    @torch.no_grad()
    def calibrate_gate(self) -> float | None:
        """Set the block's threshold just above the strongest gate pre-activation
        on any anchor token; returns it (None without anchors or gate off)."""
        if not self.config.gate or not self.anchor_inputs:
            self.block.threshold = None
            return None
        top = max(float(self.block.gate_scores(x).max()) for x in self.anchor_inputs)
        self.block.threshold = top + self.config.gate_margin * abs(top)
        return self.block.threshold

    # --- the job -------------------------------------------------------------------

    def run(self, steps: int | None = None, *, progress: bool = False) -> list[StepMetrics]:
        """Train for `steps` microbatches (default config.steps), calibrate the
        gate and publish. On any failure the block reverts to its published
        weights and nothing is published."""
        steps = self.config.steps if steps is None else steps
        it = range(self.step_index, self.step_index + steps)
        if progress:
            try:
                from tqdm.auto import tqdm

                it = tqdm(it, desc="training", leave=False)
            except ImportError:
                pass
        try:
            for i in it:
                self.step(i)
            self.check_base_unchanged()
        except BaseException:
            self.discard()
            raise
        self.publish()
        return self.history

    def check_base_unchanged(self) -> None:
        after = fingerprint_tensors(self.adapter.frozen_tensors())
        if after != self.base_fingerprint:
            raise TrainingAborted(f"the frozen base changed during the job: {after.changed(self.base_fingerprint)[:5]}")

    # --- JobBody -------------------------------------------------------------------

    def fingerprint(self) -> Mapping[str, str]:
        return fingerprint_tensors(self.adapter.frozen_tensors()).as_dict()["tensors"]

    def _gate_for_current_weights(self) -> None:
        if self._gate_step != self.step_index:
            self.calibrate_gate()
            self._gate_step = self.step_index

    def publish(self) -> None:
        """Calibrate the gate on the trained weights (unless done for them
        already), then let serving use them. The protocol calls this at a job's
        commit boundary, run() at its end."""
        self._gate_for_current_weights()
        self.block.publish()

    def discard(self) -> None:
        self.block.revert()
        self.optimizer = torch.optim.AdamW(
            self.params, lr=self.config.lr, betas=self.config.betas, weight_decay=self.config.weight_decay
        )

    def checkpoint(self) -> bytes:
        """The block as the job will publish it (gate calibrated), with its
        optimizer state: what the protocol keeps as the last good checkpoint
        at the job's verify boundary. After a restart, load it and call
        ``block.publish()`` to serve it."""
        self._gate_for_current_weights()
        return checkpoint_bytes(self)

    def save(self, path: str | os.PathLike) -> None:
        save_checkpoint(self, path)

    def load(self, path: str | os.PathLike) -> None:
        load_checkpoint(self, path)


# --- checkpoints ---------------------------------------------------------------------

CHECKPOINT_FORMAT = "resident-trainer-block/1"


def _checkpoint_tensors(trainer: Trainer) -> tuple[dict[str, Tensor], dict[str, str]]:
    block = trainer.block
    tensors = {
        "w_gate_up": block.w_gate_up.detach().contiguous(),
        "w_down": block.w_down.detach().contiguous(),
        "published_gate_up": block.published_gate_up.contiguous(),
        "published_down": block.published_down.contiguous(),
    }
    state = trainer.optimizer.state_dict()["state"]
    for i, st in state.items():
        for k, v in st.items():
            tensors[f"optim.{i}.{k}"] = v.detach().reshape(-1).contiguous() if v.dim() == 0 else v.detach().contiguous()
    meta = {
        "format": CHECKPOINT_FORMAT,
        "config": json.dumps(asdict(trainer.config)),
        "base_fingerprint": trainer.base_fingerprint.hex,
        "step": str(trainer.step_index),
        "threshold": json.dumps(block.threshold),
        "published_threshold": json.dumps(block.published_threshold),
        "neurons": json.dumps([block.neuron_start, block.neuron_stop, block.num_neurons]),
    }
    return tensors, meta


def checkpoint_bytes(trainer: Trainer) -> bytes:
    """This rank's shard of the block and its optimizer state, as safetensors bytes."""
    from safetensors.torch import save

    tensors, meta = _checkpoint_tensors(trainer)
    return save({k: v.cpu() for k, v in tensors.items()}, metadata=meta)


def save_checkpoint(trainer: Trainer, path: str | os.PathLike) -> None:
    """Write the checkpoint atomically: a temporary file in the same folder,
    flushed to disk, then renamed over `path` (a crash leaves the old one)."""
    from resident_trainer.protocol.fs import LocalFileSystem

    LocalFileSystem().write_atomic(os.path.abspath(os.fspath(path)), checkpoint_bytes(trainer))


def load_checkpoint(trainer: Trainer, path: str | os.PathLike) -> None:
    """Restore the block, its optimizer state and the step counter. Refuses a
    checkpoint made on another base model or another shard of the neurons."""
    from safetensors import safe_open

    path = os.fspath(path)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a {CHECKPOINT_FORMAT} checkpoint (format={meta.get('format')!r})")
    if meta.get("base_fingerprint") != trainer.base_fingerprint.hex:
        raise ValueError(
            f"{path} was trained on a base model with fingerprint {meta.get('base_fingerprint')}, "
            f"this one is {trainer.base_fingerprint.hex}"
        )
    block = trainer.block
    want = [block.neuron_start, block.neuron_stop, block.num_neurons]
    if json.loads(meta["neurons"]) != want:
        raise ValueError(f"{path} holds neurons {json.loads(meta['neurons'])}, this rank has {want}")
    dev = block.w_gate_up.device
    with torch.no_grad():
        block.w_gate_up.copy_(tensors["w_gate_up"])
        block.w_down.copy_(tensors["w_down"])
        block.published_gate_up.copy_(tensors["published_gate_up"])
        block.published_down.copy_(tensors["published_down"])
    block.threshold = json.loads(meta["threshold"])
    block.published_threshold = json.loads(meta["published_threshold"])
    state = trainer.optimizer.state_dict()
    restored: dict[int, dict[str, Tensor]] = {}
    for key, v in tensors.items():
        if key.startswith("optim."):
            _, i, name = key.split(".", 2)
            t = v.to(dev)
            restored.setdefault(int(i), {})[name] = t.reshape(()) if name == "step" else t
    state["state"] = restored
    trainer.optimizer.load_state_dict(state)
    trainer.step_index = int(meta["step"])
