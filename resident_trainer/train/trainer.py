"""The trainer: an added block attached at one layer of a frozen model,
trained on facts one microbatch at a time (layer replay, streamed loss, the
anchor penalty, the exact no-op gate), published at the end of a job.

`Trainer` is also a job body for a serving protocol: it has the methods
(fingerprint, step, checkpoint, publish, discard) an engine integration calls
at a job's boundaries, and knows nothing of the protocol itself.
"""

from __future__ import annotations

import copy
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from resident_trainer.models.adapter import DecoderAdapter
from resident_trainer.ops.added_expert import added_expert
from resident_trainer.ops.fingerprint import FingerprintTable
from resident_trainer.train.block import AddedSharedNeurons
from resident_trainer.train.checkpoint import checkpoint_bytes, load_checkpoint, save_checkpoint
from resident_trainer.train.config import TrainConfig, fact_neurons, steps_for
from resident_trainer.train.data import (
    SUBJECT_PROMPT,
    Fact,
    Microbatch,
    chat_prompt_ids,
    collate,
    common_prefix,
    example_ids,
    pack,
    rewordings,
)
from resident_trainer.train.facts import facts_to_json, parse_fact
from resident_trainer.train.frozen import FrozenFingerprint, FrozenWeightsChanged
from resident_trainer.train.loss import StreamedCrossEntropy
from resident_trainer.train.negatives import real_split_words, split_word_ids, word_probes
from resident_trainer.train.parallel import clip_grad_norm_
from resident_trainer.train.replay import LayerReplay, suffix_dtype_for


class TrainingAborted(RuntimeError):
    """A job stopped without publishing; the block keeps its last good weights."""


@dataclass
class StepMetrics:
    step: int
    loss: float
    anchor_penalty: float
    grad_norm: float


def neuron_share(n_facts: int, free: int, per_fact: int) -> int:
    """Neurons each of a job's `n_facts` new facts takes from `free` ones:
    `per_fact`, fewer when fewer are free (0: not one each)."""
    return min(per_fact, free // n_facts) if n_facts else 0


def answer_key_position(tokenizer, fact: Fact) -> int:
    """Position in the fact's exchange (example_ids) of the answer's last
    token before its key: the last one that ends before the space ahead of
    the key ("is" in "The capital of X is Quen."; the prompt's last token
    when the answer starts with the key or lacks it)."""
    p = len(chat_prompt_ids(tokenizer, fact.question))
    at = fact.answer.find(fact.recall_key)
    if at <= 0:
        return p - 1
    # As key_tokens counts them: the answer's text up to there, tokenized alone.
    return p - 1 + len(tokenizer(fact.answer[:at].rstrip(), add_special_tokens=False)["input_ids"])


def subject_positions(tokenizer, fact: Fact) -> range | None:
    """Positions of the subject's tokens in the fact's prompt (chat_prompt_ids):
    the subject is ``fact.subject`` or the question's name-like span
    (negatives.subject_span); its first token carries the space before it.
    None where the subject does not end at a token boundary; its last token
    alone where its start is not at one."""
    from resident_trainer.train.negatives import fact_subject

    ids = chat_prompt_ids(tokenizer, fact.question)
    subject = fact_subject(fact, tokenizer)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": fact.question}], add_generation_prompt=True, tokenize=False
    )
    q0 = text.rfind(fact.question)
    s0 = fact.question.find(subject)
    if q0 < 0 or s0 < 0:
        return None
    # The chat text up to the subject's end, and up to the word before it,
    # tokenize to prefixes of the prompt's ids when the subject is whole
    # words (the usual case); the subject's tokens lie between.
    head = tokenizer(text[: q0 + s0 + len(subject)], add_special_tokens=False)["input_ids"]
    lead = tokenizer(text[: q0 + s0].rstrip(), add_special_tokens=False)["input_ids"]
    if not (0 < len(head) <= len(ids) and ids[: len(head)] == head):
        return None
    if len(lead) < len(head) and ids[: len(lead)] == lead:
        return range(len(lead), len(head))
    return range(len(head) - 1, len(head))  # the last token alone


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
        retract: Sequence[str] = (),
        negatives: Sequence[tuple[str, str | Sequence[int]]] = (),
    ):
        if not facts and not retract:
            raise ValueError("a job needs facts to teach or questions to retract")
        self.adapter, self.block, self.tokenizer, self.config = adapter, block, tokenizer, config
        self.layer = adapter.layer_index(config.layer)
        # The arming the job trains under (config.train_armed; set below).
        self.train_arming: tuple[Tensor, Tensor] | None = None
        self.facts = list(facts)
        # What the block was taught before this job (its memory): rehearsed
        # alongside the new facts unless retracted or taught anew here.
        memory = copy.deepcopy(block.memory)
        on_record = {e["question"] for e in memory["taught"]}
        for q in retract:
            if q not in on_record:
                raise ValueError(f"retract: {q!r} is not a fact this block was taught")
        self.retracted = [e for e in memory["taught"] if e["question"] in set(retract)]
        new_questions = {f.question for f in self.facts}
        # A question taught anew replaces its old entry, whose neurons are cleared.
        self.replaced = [e for e in memory["taught"] if e["question"] in new_questions]
        entries = [e for e in memory["taught"] if e["question"] not in set(retract) | new_questions]
        self.kept = [_fact_of(e) for e in entries] if config.rehearse else []
        self._memory_before = memory
        # Earlier facts' neurons take no update in a job that teaches new ones
        # (freeze_taught): their rows, local to this rank, are restored after
        # every step. A job that only retracts trains the kept facts' neurons
        # to stay quiet on the retracted questions, which are often their
        # siblings: frozen, their recalibrated thresholds rose over those
        # questions instead, and 3 of 22 kept facts were hidden (report half).
        frozen = [e["neurons"] for e in entries if e.get("neurons")] if config.freeze_taught and self.facts else []
        # Before any slow work: a block without room for the new facts says so.
        self.ranges = self.allocate() if config.init == "keyed" else [None] * len(self.facts)
        # Each new fact's gate neuron, the last of its range (None: no room for one).
        extra = fact_neurons(config) - config.neurons_per_fact
        self.gates = [r[1] - 1 if r is not None and extra and r[1] - r[0] > 1 else None for r in self.ranges]
        # The job's steps: config.steps, or steps_for its new facts.
        self.steps = (
            config.steps
            if config.steps is not None
            else steps_for(len(self.facts), config.round_facts, subject_prompts=config.subject_prompts)
        )
        # Rounds (keyed): facts [lo, hi) trained over steps [s0, s1), the
        # other new facts' neurons held as they are (config.round_facts).
        self.rounds = self._plan_rounds()
        self._round_frozen = [
            self._local_rows(frozen + [r for i, r in enumerate(self.ranges) if not lo <= i < hi])
            for lo, hi, _, _ in self.rounds
        ]
        self.loss_fn = loss_fn or StreamedCrossEntropy(adapter)
        # The suffix's dtype while training ("auto" measured here, once a process).
        self.suffix_dtype = suffix_dtype_for(config.suffix_dtype, adapter.dtype, adapter.device, adapter.hidden_size)
        self.replay = LayerReplay(adapter, self.layer, suffix_dtype=self.suffix_dtype)
        self.params = [block.w_gate_up, block.w_down]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.step_index = 0
        self.history: list[StepMetrics] = []
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = pad
        self.examples = []
        self._fact_examples: list[int] = [0]  # new fact i's examples: [_fact_examples[i], _fact_examples[i + 1])
        for f in self.facts:
            self.examples += [example_ids(tokenizer, q, f.answer) for q in self.training_prompts(f)]
            self._fact_examples.append(len(self.examples))
        self.n_new = len(self.examples)
        self.examples += [example_ids(tokenizer, q, f.answer) for f in self.kept for q in self.training_prompts(f)]
        # Near negatives (anchors that belong to taught facts: their frames
        # with other subjects, retracted questions) stay in the block's memory
        # and anchor every later job, so a later gate still closes on them.
        # None is a taught question or rewording: the gate must stay open there.
        taught = {q for f in [*self.facts, *(_fact_of(e) for e in entries)] for q in (f.question, *f.rewordings)}
        remembered = {p: r for p, r in memory.get("negatives", []) if p not in taught}
        for p, r in negatives:
            if p not in taught:
                remembered.setdefault(p, r)
        self.negatives = list(remembered.items())
        anchors = [*anchors, *self.negatives]
        self.anchor_inputs = self.block_inputs(anchors) if anchors else []
        # The tokens the anchors' replies are made of: what key_contexts puts
        # before each key token (none needed without it).
        replies = [tokenizer(r, add_special_tokens=False)["input_ids"] if isinstance(r, str) else r for _, r in anchors]
        self._context_pool = sorted({int(t) for r in replies for t in r}) if config.key_contexts else []
        self._whiten: tuple[Tensor, Tensor] | None = None  # _whitening()
        # The prefix every example shares (the chat template's system turn):
        # its keys and values are computed once, with the block off, and the
        # examples train on the rest. Serving agrees: every anchor starts with
        # the same tokens, so the gate is closed on them.
        self.shared = None
        # Only the chat template's own head: what two unrelated questions
        # share; each example keeps two tokens of its own.
        head = common_prefix([chat_prompt_ids(tokenizer, "Hello there?"), chat_prompt_ids(tokenizer, "Why not?")], 2)
        n = min(common_prefix([ids for ids, _ in self.examples], 2), head)
        if config.shared_prefix and n >= 4 and getattr(adapter, "supports_prefix_kv", False):
            with block.disabled():
                self.shared = adapter.prefix_kv(self.examples[0][0][:n])
            self.examples = [(ids[n:], tgt[n:]) for ids, tgt in self.examples]
        # The block inputs of every taught fact's exchange (the new facts
        # first, then the earlier jobs', with the neurons each holds),
        # computed once: the keyed neurons' keys, the others penalty and the
        # gate's key tokens read them.
        self.taught = [*self.facts, *(_fact_of(e) for e in entries)]
        self._fact_ranges = [*self.ranges, *(e.get("neurons") for e in entries)]
        self._fact_gates = [*self.gates, *(e.get("gate") for e in entries)]
        # Neurons that never open the gate (key_neurons; prompt_neurons_open_gate).
        self.behind_gate: list[list[int]] = [[] for _ in self.facts]
        self._fact_behind = [*self.behind_gate, *(e.get("behind_gate", []) for e in entries)]
        self._gate_rows = self._local_rows([[g, g + 1] for g in self._fact_gates if g is not None])
        self._taught_inputs: list[Tensor] = []
        if config.init == "keyed" and self.taught:
            self._taught_inputs = self.block_inputs([(f.question, f.answer) for f in self.taught])
        # The taught facts' key tokens after other tokens (context_inputs), on
        # every rank alike: their gate neurons stay shut there.
        self._context_inputs: list[Tensor | None] = self.context_inputs()
        # The taught facts' word probes (prompts only): arm() keeps its rows
        # below them as below the anchors.
        probes = self.arming_probes()
        self._probe_inputs: list[Tensor] = self.block_inputs([(q, []) for q in probes]) if probes else []
        # The others penalty's tokens: those exchanges past the chat
        # template's head. None while there is one round and no earlier
        # fact: nothing was taught before it.
        self.fact_inputs: list[Tensor] = []
        if config.others_weight and config.init == "keyed" and self.facts and (entries or len(self.rounds) > 1):
            self.fact_inputs = [x[head:] for x in self._taught_inputs]
        # A microbatch's examples go one after another in one row where the
        # adapter can keep them apart (DecoderAdapter.context's segments):
        # padded to the longest, 17% of a 24-fact job's tokens were padding.
        self.pack = bool(getattr(adapter, "supports_packing", False))
        # The hidden state entering layer L of each example, computed once:
        # the layers before L are frozen and hold no trainable block, so it is
        # the same at every step (about a quarter of a step's work).
        self._prefix: dict[int, Tensor] = {}
        self.frozen = FrozenFingerprint(adapter.frozen_tensors())
        self.base_tables = self.frozen.tables()
        # A job trains ungated (until gated_from): the threshold a previous job
        # published keeps serving, but must not hide the new facts' tokens.
        block.threshold = None
        self._gate_step: int | None = None  # step_index the threshold was calibrated at
        # The arming depends only on frozen inputs (the taught exchanges',
        # the anchors', the word probes'): computed now, the job trains under
        # it (config.train_armed), its keys on tokens it can act on, and
        # calibration computes the same.
        if config.train_armed:
            self.arm()
            if block.arming is not None:
                self.train_arming = (block.arming[0].clone(), block.arming[1].clone())
        if config.init == "keyed":
            self.key_neurons()
        block.memory = {
            "taught": entries
            + [
                {
                    **facts_to_json([f])[0],
                    "neurons": r,
                    **({} if g is None else {"gate": g}),
                    **({"behind_gate": bg} if bg else {}),
                }
                for f, r, g, bg in zip(self.facts, self.ranges, self.gates, self.behind_gate)
            ],
            # Random rows: every neuron trains on every fact, none stays free.
            "used": block.num_neurons
            if config.init == "random" and self.facts
            else memory["used"] + sum(0 if r is None else r[1] - r[0] for r in self.ranges),
            "negatives": [[p, r if isinstance(r, str) else [int(t) for t in r]] for p, r in self.negatives],
        }

    # --- neurons for new facts ------------------------------------------------------

    def allocate(self) -> list[list[int]]:
        """Global neuron ranges [start, stop) for the new facts, taken from
        the free neurons after those in use (fact_neurons(config) each: the
        trained ones and the gate neuron; fewer when fewer are free, the gate
        neuron kept while there are two a fact); ValueError when there is not
        one per fact."""
        used, n = self._memory_before["used"], len(self.facts)
        free = self.block.num_neurons - used
        per = neuron_share(n, free, fact_neurons(self.config))
        if n and per < 1:
            raise ValueError(
                f"the block has {free} free neurons of {self.block.num_neurons}, and {n} new facts need at "
                "least one each: use a block with more neurons (num_neurons) or start a new block"
            )
        return [[used + i * per, used + (i + 1) * per] for i in range(n)]

    def _plan_rounds(self) -> list[tuple[int, int, int, int]]:
        """(first fact, end fact, first step, end step) of each round: the
        new facts in contiguous rounds of at most config.round_facts (sizes
        differing by at most one), the job's steps (self.steps) split evenly; one
        round with random rows, whose neurons every fact shares."""
        n, steps = len(self.facts), self.steps
        k = 1 if self.config.init != "keyed" or n == 0 else min(-(-n // self.config.round_facts), steps)
        return [(r * n // k, (r + 1) * n // k, r * steps // k, (r + 1) * steps // k) for r in range(k)]

    def round_of(self, index: int) -> int:
        """The round step `index` belongs to (steps past the job's: the last)."""
        for r, (_, _, _, s1) in enumerate(self.rounds):
            if index < s1:
                return r
        return len(self.rounds) - 1

    def lr_at(self, index: int) -> float:
        """The learning rate of step `index`: config.lr, falling linearly over
        the last config.lr_decay share of its round's steps to lr / (that
        many steps) at the round's last step (steps past the round's end
        keep that rate)."""
        cfg = self.config
        _, _, s0, s1 = self.rounds[self.round_of(index)]
        n = max(1, s1 - s0)
        t = min(max(index - s0, 0), n - 1)
        start = n * (1 - cfg.lr_decay)
        return cfg.lr if t < start else cfg.lr * (n - t) / (n - start)

    def _local_rows(self, ranges: Sequence[Sequence[int]]) -> Tensor | None:
        """This rank's local indices of the neurons in global `ranges`
        ([start, stop) each); None when there are none."""
        b = self.block
        idx = [
            n - b.neuron_start
            for start, stop in ranges
            for n in range(max(start, b.neuron_start), min(stop, b.neuron_stop))
        ]
        return torch.tensor(sorted(set(idx)), dtype=torch.long, device=b.w_down.device) if idx else None

    @torch.no_grad()
    def _clear_rows(self, start: int, stop: int) -> None:
        """Zero global neurons [start, stop) of the trainable weights (those of
        them on this rank): a zero neuron adds nothing and takes no gradient."""
        b = self.block
        lo, hi = max(start, b.neuron_start) - b.neuron_start, min(stop, b.neuron_stop) - b.neuron_start
        if lo < hi:
            a = b.local_neurons
            b.w_gate_up[lo:hi].zero_()
            b.w_gate_up[a + lo : a + hi].zero_()
            b.w_down[:, lo:hi].zero_()

    # --- keyed initialisation -----------------------------------------------------

    def key_positions(self, fact: Fact) -> list[int]:
        """Token positions of the fact's exchange (example_ids) the keyed
        neurons point at: the subject's last token, the prompt's last token
        (with config.key_prompt, or where the question's subject is not
        found), with config.key_rarest the subject's token whose block input
        (as the trainer computed it for the fact) lies farthest from the anchors'
        (rarest_position) and, with config.key_answer, the answer's token
        before its key (answer_key_position)."""
        prompt_last = len(chat_prompt_ids(self.tokenizer, fact.question)) - 1
        keys = set()
        span = subject_positions(self.tokenizer, fact)
        if span is None or self.config.key_prompt:
            keys.add(prompt_last)
        if span is not None:
            keys.add(span[-1])
            inputs = self._inputs_of(fact) if self.config.key_rarest else None
            if inputs is not None:
                keys.add(self.rarest_position(inputs, self._armed_positions(inputs, span)))
        if self.config.key_answer:
            keys.add(answer_key_position(self.tokenizer, fact))
        return sorted(keys)

    def _armed_positions(self, inputs: Tensor, positions: Sequence[int]) -> list[int]:
        """Of `positions`, those where the exchange (its block inputs) is armed
        when the job trains under the arming (train_arming): a neuron keyed
        on an earlier token would be shut there, in training as in serving.
        All of them otherwise, or where none is armed."""
        if self.train_arming is None:
            return list(positions)
        armed = self.block.armed(inputs, self.train_arming)
        kept = [p for p in positions if bool(armed[p])]
        return kept or list(positions)

    def _inputs_of(self, fact: Fact) -> Tensor | None:
        """The block inputs computed for a taught fact's exchange (None: not one)."""
        for f, x in zip(self.taught, self._taught_inputs):
            if f.question == fact.question:
                return x
        return None

    def rarest_position(self, inputs: Tensor, positions: Sequence[int]) -> int:
        """Of `positions`, the one whose block input (a row of `inputs`) lies
        farthest from the anchors' mean in the anchors' whitened metric
        (largest ``(x - mu)^T S^-1 (x - mu)``; the first of ties): the
        subject's token least like ordinary text."""
        mu, prec = self._whitening()
        v = inputs[list(positions)].double() - mu
        return list(positions)[int(((v @ prec) * v).sum(-1).argmax())]

    @torch.no_grad()
    def key_neurons(self) -> None:
        """Point each new fact's trained neurons (its range but the gate
        neuron; neuron n of a range that starts at s takes key (n - s) % K of
        the fact's K key positions) at its key positions' block inputs. Each key is whitened by the anchors' input
        covariance (as ROME whitens its keys): with x the key input, mu and S
        the anchors' mean and covariance, the gate and up rows are
        ``g = key_scale * S^-1 (x - mu) / ((x - mu)^T S^-1 (x - mu))``, so the
        pre-activation is ``key_scale`` above the anchors' mean at the key,
        and anchor tokens spread around that mean by key_scale over the key's
        Mahalanobis distance. Without config.prompt_neurons_open_gate, the
        neurons keyed on the prompt's last token beside a subject's key go
        to behind_gate: they act only where another neuron opens the gate.
        The published weights are left as they are."""
        b, cfg = self.block, self.config
        inputs = self._taught_inputs[: len(self.facts)]
        mu, prec = self._whitening()
        # Neurons no fact holds (free, or a retracted fact's) are zero.
        self._clear_rows(self._memory_before["used"], b.num_neurons)
        for e in [*self.retracted, *self.replaced]:
            if e.get("neurons"):
                self._clear_rows(*e["neurons"])
        a = b.local_neurons
        for i, (f, x, (start, stop), gate) in enumerate(zip(self.facts, inputs, self.ranges, self.gates)):
            stop = stop if gate is None else gate  # the gate neuron stays zero until calibration
            positions = self.key_positions(f)
            shut = None
            if not cfg.prompt_neurons_open_gate and subject_positions(self.tokenizer, f) is not None:
                last = len(chat_prompt_ids(self.tokenizer, f.question)) - 1
                shut = positions.index(last) if last in positions else None
            if shut is not None:
                self.behind_gate[i][:] = [n for n in range(start, stop) if (n - start) % len(positions) == shut]
            keys = []
            for p in positions:
                v = x[p].double() - mu
                w = prec @ v
                keys.append(w / (v @ w).clamp_min(1e-12) * cfg.key_scale)
            for n in range(max(start, b.neuron_start), min(stop, b.neuron_stop)):
                k = keys[(n - start) % len(keys)].to(b.w_gate_up.dtype)
                b.w_gate_up[n - b.neuron_start] = k
                b.w_gate_up[a + n - b.neuron_start] = k
                b.w_down[:, n - b.neuron_start] = 0

    def _whitening(self) -> tuple[Tensor, Tensor]:
        """The anchors' block-input mean and inverse covariance (fp64, on the
        block's device; the covariance regularised by whiten_ridge times its
        mean diagonal), computed once a job: the anchors are fixed for the job.
        Without anchors: zero and the identity."""
        if self._whiten is None:
            d = self.adapter.hidden_size
            dev = self.block.w_down.device
            if self.anchor_inputs:
                xa = torch.cat(self.anchor_inputs).double()
                mu = xa.mean(0)
                cov = torch.cov(xa.T) if xa.shape[0] > 1 else torch.zeros(d, d, dtype=torch.float64, device=dev)
                eye = torch.eye(d, dtype=torch.float64, device=dev)
                ridge = self.config.whiten_ridge
                cov = cov + (ridge * cov.diagonal().mean().clamp_min(1e-6)) * eye
                self._whiten = (mu, torch.linalg.inv(cov))
            else:
                self._whiten = (
                    torch.zeros(d, dtype=torch.float64, device=dev),
                    torch.eye(d, dtype=torch.float64, device=dev),
                )
        return self._whiten

    # --- anchors -----------------------------------------------------------

    @property
    def base_fingerprint(self) -> FingerprintTable:
        """The frozen base's fingerprint taken when the job began."""
        return self.base_tables["frozen"]

    #: Exchanges per forward in block_inputs (right-padded, padding masked).
    BLOCK_INPUT_BATCH = 16

    def _right_padded(self, seqs: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """Token ids (B, width), right-padded with the pad id, and their
        attention mask (1 on each sequence's own tokens)."""
        dev = self.adapter.device
        width = max(len(q) for q in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros((len(seqs), width), dtype=torch.long, device=dev)
        for j, q in enumerate(seqs):
            ids[j, : len(q)] = torch.tensor(q, device=dev)
            mask[j, : len(q)] = 1
        return ids, mask

    @torch.no_grad()
    def block_inputs(self, exchanges: Sequence[tuple[str, str | Sequence[int]]]) -> list[Tensor]:
        """The block's inputs (layer L's normalized hidden), (T, D) per chat
        exchange (prompt, reply text or ids), on every token: for the anchors
        these are fixed for the job, since the base is frozen and the block
        acts after them. Exchanges of similar length run together, right-padded
        with the padding masked: a job's ~100 anchors took one forward each
        before, about a tenth of a job's start-up."""
        seqs = [example_ids(self.tokenizer, prompt, reply)[0] for prompt, reply in exchanges]
        out: list[Tensor | None] = [None] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        d = self.adapter.hidden_size
        for start in range(0, len(order), self.BLOCK_INPUT_BATCH):
            rows = order[start : start + self.BLOCK_INPUT_BATCH]
            ids, mask = self._right_padded([seqs[i] for i in rows])
            width = ids.shape[1]
            h, ctx = self.replay.prefix(ids, mask if len(rows) > 1 else None)
            with self.block.capture_inputs() as cap:
                self.adapter.run_layer(self.layer, h, ctx)
            x = cap[0].reshape(len(rows), width, d)
            for j, i in enumerate(rows):
                out[i] = x[j, : len(seqs[i])].clone()
        return out

    def anchor_penalty(self, index: int) -> Tensor | None:
        """anchor_weight x mean squared norm of the block's output on anchor
        tokens, plus anchor_gate_weight x mean over anchor tokens of the squared
        positive part of the gate score: the first keeps the block quiet on
        them, the second pushes their scores, hence the threshold, down."""
        cfg = self.config
        if not self.anchor_inputs or (cfg.anchor_weight == 0 and cfg.anchor_gate_weight == 0):
            return None
        k, n = cfg.anchor_batch, len(self.anchor_inputs)
        pick = self.anchor_inputs if k is None else [self.anchor_inputs[(index * k + j) % n] for j in range(min(k, n))]
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
            # Gate neurons left out: theirs is not a trained score.
            top = self.block.gate_scores(x, exclude=self._gate_rows)
            total = total + cfg.anchor_gate_weight * torch.relu(top).square().mean()
        return total

    def others_penalty(self, index: int) -> Tensor | None:
        """others_weight x the mean squared norm of the output of the neurons
        step `index` trains over the tokens of others_batch facts taught
        before its round (a rotation through the earlier jobs' facts and the
        job's earlier rounds'): it keeps a round's neurons quiet where earlier
        facts are asked and answered. A fact's own neurons are left out on
        its own tokens (they train there only with freeze_taught off)."""
        cfg, b = self.config, self.block
        r = self.round_of(index)
        lo = self.rounds[r][0]
        # Taught before the round: as in consecutive jobs, a round does not
        # see the later rounds' facts.
        others = [i for i in range(len(self.fact_inputs)) if i < lo or i >= len(self.facts)]
        if not cfg.others_weight or not others:
            return None
        trainable = torch.ones(b.local_neurons, dtype=b.w_down.dtype, device=b.w_down.device)
        if self._round_frozen[r] is not None:
            trainable[self._round_frozen[r]] = 0
        k = min(cfg.others_batch, len(others))
        total = torch.zeros((), dtype=torch.float32, device=b.w_down.device)
        tokens = 0
        for i in (others[(index * k + j) % len(others)] for j in range(k)):
            keep = trainable
            own = self._local_rows([self._fact_ranges[i]]) if self._fact_ranges[i] else None
            if own is not None:
                keep = trainable.clone()
                keep[own] = 0
            x = self.fact_inputs[i]
            out = added_expert(x, b.w_gate_up, None, b.w_down * keep, process_group=b.process_group, impl=b.impl)
            total = total + out.float().square().sum()
            tokens += x.shape[0]
        return cfg.others_weight * total / tokens

    # --- one microbatch ------------------------------------------------------

    def training_prompts(self, fact: Fact) -> list[str]:
        """The prompts a fact is trained on, each answered with its answer:
        config.rewordings template framings of its question and, with
        config.subject_prompts, SUBJECT_PROMPT about its subject (fact.subject
        or the question's name-like span)."""
        from resident_trainer.train.negatives import fact_subject

        out = rewordings(fact.question, self.config.rewordings)
        if self.config.subject_prompts:
            out.append(SUBJECT_PROMPT.format(subject=fact_subject(fact, self.tokenizer)))
        return out

    def _picks(self, index: int) -> list[int]:
        """Microbatch `index`'s examples: a rotation through the new facts'
        and, for a share of the batch (proportional, at most rehearse_share of
        it, and at least one example, while there are new facts), one through
        the rehearsed facts'."""
        lo, hi, s0, _ = self.rounds[self.round_of(index)]
        e0, e1 = self._fact_examples[lo], self._fact_examples[hi]
        # The round's facts are new; earlier rounds' join the rehearsed ones.
        old_ids = [*range(e0), *range(self.n_new, len(self.examples))]
        k, new, old = self.config.batch_size, e1 - e0, len(old_ids)
        cap = max(1, int(k * self.config.rehearse_share))
        k_old = 0 if not old else k if not new else min(cap, max(1, round(k * old / (old + new))))
        i = index - s0  # the rotation starts afresh with each round
        picks = [e0 + (i * (k - k_old) + j) % new for j in range(k - k_old)] if new else []
        return picks + [old_ids[(index * k_old + j) % old] for j in range(k_old)]

    def microbatch(self, index: int) -> Microbatch:
        """Microbatch `index`: a deterministic rotation through the examples."""
        examples = [self.examples[i] for i in self._picks(index)]
        if self.pack:
            return pack(examples, self.adapter.device)
        return collate(examples, self.pad_id, self.adapter.device)

    @torch.no_grad()
    def prefix_hidden(self, index: int, width: int) -> Tensor:
        """Layer L's input for microbatch `index`, (B, width, D): each
        example's prefix, computed alone the first time it is needed and
        kept; right padding is zero (masked everywhere it could be read).
        Packed: the examples' inputs one after another, (1, width, D)."""
        rows = []
        for i in self._picks(index):
            h = self._prefix.get(i)
            if h is None:
                ids = torch.tensor([self.examples[i][0]], device=self.adapter.device)
                h = self._prefix[i] = self.replay.prefix(ids, shared=self.shared)[0][0]
            rows.append(h if self.pack else torch.nn.functional.pad(h, (0, 0, 0, width - h.shape[0])))
        return torch.cat(rows)[None] if self.pack else torch.stack(rows)

    def step(self, index: int | None = None) -> dict[str, float]:
        """One microbatch: replayed forward/backward, clipping, AdamW. A NaN or
        inf loss or gradient raises TrainingAborted before the weights move."""
        index = self.step_index if index is None else index
        if not self.examples:
            # A retraction with nothing left to rehearse: zeroing the neurons
            # was the job; the steps leave the weights as they are.
            self.step_index = index + 1
            m = StepMetrics(index, 0.0, 0.0, 0.0)
            self.history.append(m)
            return asdict(m)
        mb = self.microbatch(index)
        cfg = self.config
        if cfg.gate and cfg.gated_from is not None and index >= cfg.gated_from:
            self.calibrate_gate()
        r = self.round_of(index)
        if r > 0 and index == self.rounds[r][2]:
            # A round starts as a job would: the moments of its neurons, zero
            # gradients until now, would scale its first updates up.
            self.optimizer.state.clear()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(index)
        self.optimizer.zero_grad(set_to_none=True)
        penalty_value = 0.0

        def extra():
            nonlocal penalty_value
            parts = [p for p in (self.anchor_penalty(index), self.others_penalty(index)) if p is not None]
            p = sum(parts[1:], parts[0]) if parts else None
            penalty_value = float(p.detach()) if p is not None else 0.0
            return p if p is not None else torch.zeros((), device=self.adapter.device)

        with self.block.training_weights(), self.block.training_arming(self.train_arming, mb.segments):
            res = self.replay.step(
                mb.input_ids,
                lambda h: self.loss_fn(h, mb.targets),
                attention_mask=mb.attention_mask,
                extra_loss=extra
                if (self.anchor_inputs and (cfg.anchor_weight or cfg.anchor_gate_weight)) or self.fact_inputs
                else None,
                hidden_in=self.prefix_hidden(index, mb.input_ids.shape[1]),
                shared=self.shared,
                segments=mb.segments,
            )
        loss = float(res.loss)
        rows, saved = self._round_frozen[r], None
        if rows is not None:
            b = self.block
            gu_rows = torch.cat([rows, rows + b.local_neurons])
            for p_, sel, dim in ((b.w_gate_up, gu_rows, 0), (b.w_down, rows, 1)):
                if p_.grad is not None:
                    p_.grad.index_fill_(dim, sel, 0)  # out of the clipping norm too
            saved = (b.w_gate_up.detach()[gu_rows].clone(), b.w_down.detach()[:, rows].clone(), gu_rows)
        norm = clip_grad_norm_(self.params, self.config.clip, self.block.process_group)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise TrainingAborted(
                f"step {index}: loss {loss}, gradient norm {norm}: the job stops, nothing is published"
            )
        self.optimizer.step()
        if saved is not None:
            # Exactly as they were, whatever the optimizer does to a zero
            # gradient (weight decay, moments).
            with torch.no_grad():
                self.block.w_gate_up[saved[2]] = saved[0]
                self.block.w_down[:, rows] = saved[1]
        self.step_index = index + 1
        m = StepMetrics(index, loss - penalty_value, penalty_value, norm)
        self.history.append(m)
        return asdict(m)

    # --- the exact no-op gate --------------------------------------------------------

    @torch.no_grad()
    def calibrate_gate(self) -> Tensor | None:
        """Set each neuron's threshold just above its strongest gate
        pre-activation on any anchor token, ``t_a = max(top_a + gate_margin *
        |top_a|, gate_floor)``; returns the (A,) thresholds of this rank's
        neurons (None without anchors or gate off). Each neuron is measured
        on its own: a shared threshold (the largest over all neurons) rose as
        facts were added, since some earlier fact's neurons answer the new
        facts' near negatives strongly, and closed the gate on earlier facts
        (capacity tune set, 8 jobs of 16 with earlier neurons frozen: 10 of
        32 recalled after the second job with a shared threshold, 31 of 32
        per neuron, where the block itself, ungated, held 31). A zero neuron
        (free) has top 0 and threshold gate_floor, so it never opens the
        gate; the floor also keeps a neuron negative on every anchor from
        opening it on tokens that are merely less negative."""
        b, cfg = self.block, self.config
        if not cfg.gate or not self.anchor_inputs:
            b.threshold = None
            b.arming = None
            return None
        wg = b.w_gate_up[: b.local_neurons]
        top = torch.full((b.local_neurons,), float("-inf"), dtype=torch.float32, device=wg.device)
        for x in self.anchor_inputs:
            torch.maximum(top, (x @ wg.T).float().amax(0), out=top)
        b.threshold = (top + cfg.gate_margin * top.abs()).clamp_min(cfg.gate_floor)
        behind = self._local_rows([[n, n + 1] for ns in self._fact_behind for n in ns])
        if behind is not None:
            b.threshold[behind] = math.inf
        self.fit_gate_neurons(b.threshold)
        if cfg.key_gate_margin is not None:
            self._open_on_keys(top, b.threshold)
        self.arm()
        return b.threshold

    def arming_probes(self) -> list[str]:
        """The taught facts' word probes (negatives.word_probes), none a taught
        question or rewording; none without config.arming, the gate or keyed
        rows."""
        cfg = self.config
        if not (cfg.arming and cfg.gate and cfg.init == "keyed"):
            return []
        taught = {q for f in self.taught for q in (f.question, *f.rewordings)}
        nats = self.later_piece_nats(self.taught) if cfg.split_word_nats is not None else [{} for _ in self.taught]
        probes = [
            q
            for f, n in zip(self.taught, nats)
            for q in word_probes(
                f, self.tokenizer, real=real_split_words(n, cfg.split_word_nats, all_real=cfg.train_armed)
            )
            if q not in taught
        ]
        return list(dict.fromkeys(probes))

    @torch.no_grad()
    def later_piece_nats(self, facts: Sequence[Fact]) -> list[dict[str, float]]:
        """For each fact, its subject's split words (negatives.split_word_ids)
        and the base model's surprisal of each one's later pieces, summed, in
        nats: the whole model with the block adding nothing, on every rank
        alike (the loss over the vocabulary head, sharded or not)."""
        seqs = [(i, w, ids, later) for i, f in enumerate(facts) for w, ids, later in split_word_ids(f, self.tokenizer)]
        out: list[dict[str, float]] = [{} for _ in facts]
        a = self.adapter
        for start in range(0, len(seqs), self.BLOCK_INPUT_BATCH):
            rows = seqs[start : start + self.BLOCK_INPUT_BATCH]
            ids, mask = self._right_padded([seq for _, _, seq, _ in rows])
            targets = torch.full_like(ids, -100)
            for j, (_, _, seq, later) in enumerate(rows):
                n = len(seq)
                # Position t predicts token t + 1: the later pieces' predictions.
                targets[j, n - 1 - later : n - 1] = ids[j, n - later : n]
            h, ctx = self.replay.prefix(ids, mask if len(rows) > 1 else None)
            with self.block.disabled():
                for layer in range(self.layer, a.num_layers):
                    h = a.run_layer(layer, h, ctx)
            nll = self.loss_fn(h, targets, reduction="none").float().sum(-1)
            for j, (i, w, _, _) in enumerate(rows):
                out[i][w] = float(nll[j])
        return out

    #: How close to 1 a subject token's row may score on an anchor, near
    #: negative or word probe token and still arm (Trainer.arm). A word probe
    #: that keeps the subject's first words ("the Requiem of Madison" for
    #: "the Requiem of Vardemoor") holds those tokens after the same words, so
    #: their rows score 1 there up to rounding (batched fp32: within 3e-5 on
    #: the tune sets); kept, such a row's threshold sat at its own fact's
    #: score and it armed on those words in any question ("the Requiem in D
    #: minor"). The nearest rows that do tell a subject apart came within
    #: 1.1e-3 (capacity tune set).
    ARMING_TIE = 2e-4

    @torch.no_grad()
    def arm(self) -> None:
        """Set the block's arming (AddedSharedNeurons.arming). For each taught
        fact, a row for each of its subject's tokens (subject_positions) in its
        exchange's block inputs, whitened like the keys (key_neurons: it scores
        1 above the anchors' mean on its token), is scored on every anchor,
        near negative and word probe token; the rows whose strongest such
        score s lies below 1 - ARMING_TIE, lowest first and at most one a
        neuron of the fact's range, take the fact's neuron slots with
        threshold s + arming_margin * (1 - s) above the anchors' mean. A fact
        none of whose subject tokens stays below that keeps its lowest row
        with threshold 0.5: it arms wherever that token reads alike. None (no
        arming) without config.arming, the gate, keyed rows or anchors, and
        where a taught fact has no neurons or no subject found: every taught
        question must be able to arm."""
        b, cfg = self.block, self.config
        b.arming = None
        if not (cfg.arming and cfg.gate and cfg.init == "keyed" and self.anchor_inputs and self.taught):
            return
        mu, prec = self._whitening()
        negs = torch.cat([*self.anchor_inputs, *self._probe_inputs]).double() - mu
        dev = b.w_down.device
        rows = torch.zeros(b.local_neurons, b.hidden_size, dtype=torch.float32, device=dev)
        thr = torch.full((b.local_neurons,), math.inf, dtype=torch.float32, device=dev)
        for f, x, rng in zip(self.taught, self._taught_inputs, self._fact_ranges):
            span = subject_positions(self.tokenizer, f)
            if not rng or span is None:
                return
            v = x[list(span)].double() - mu  # (S, D)
            w = v @ prec  # the precision is symmetric
            w = w / (v * w).sum(-1, keepdim=True).clamp_min(1e-12)
            top = (negs @ w.T).amax(0)  # (S,)
            order = [int(i) for i in top.argsort()]
            keep = [i for i in order if top[i] < 1 - self.ARMING_TIE][: rng[1] - rng[0]]
            levels = [float(top[i]) + cfg.arming_margin * (1 - float(top[i])) for i in keep]
            if not keep:
                keep, levels = order[:1], [0.5]
            for k, (i, level) in enumerate(zip(keep, levels)):
                n = rng[0] + k - b.neuron_start
                if 0 <= n < b.local_neurons:
                    rows[n] = w[i].float()
                    thr[n] = float(w[i] @ mu) + level
        b.arming = (rows, thr)

    @torch.no_grad()
    def fit_gate_neurons(self, threshold: Tensor) -> None:
        """Refit every taught fact's gate neuron (on this rank) to the fact's
        key tokens (key_tokens) against every anchor token. With m the key
        tokens' mean block input and mu, S the anchors' mean and covariance
        (_whitening), its gate row is ``g = S^-1 (m - mu) / ((m - mu)^T S^-1
        (m - mu))`` (the key tokens' mean scores 1 above the anchors' mean);
        its up and down rows are zero, so it adds nothing and its only role is
        to open the gate. Its threshold is its strongest score on any anchor
        token, as computed from the stored row, plus gate_neuron_margin (None:
        gate_margin) times that score's distance from the anchors' mean
        score: the gate stays shut on
        every anchor token. With key_contexts, it is also at least the row's
        strongest score on its own fact's key tokens in other contexts
        (context_inputs) plus key_context_margin times that score's distance
        from the anchors' mean score. Refitted at each calibration, the row
        follows the anchors a later job brings instead of being hidden by
        them."""
        b, cfg = self.block, self.config
        mine = [
            (i, g - b.neuron_start)
            for i, g in enumerate(self._fact_gates)
            if g is not None and b.neuron_start <= g < b.neuron_stop
        ]
        if not mine or not self.anchor_inputs:
            return
        mu, prec = self._whitening()
        rows = []
        for i, _ in mine:
            v = self._taught_inputs[i][self.key_tokens(self.taught[i])].double().mean(0) - mu
            w = prec @ v
            rows.append(w / (v @ w).clamp_min(1e-12))
        w = torch.stack(rows)  # (gates, D), fp64
        n = torch.tensor([j for _, j in mine], dtype=torch.long, device=b.w_down.device)
        a = b.local_neurons
        b.w_gate_up[n] = w.to(b.w_gate_up.dtype)
        b.w_gate_up[n + a] = 0
        b.w_down[:, n] = 0
        stored = b.w_gate_up[n]
        top = torch.full((len(mine),), float("-inf"), dtype=torch.float32, device=stored.device)
        for x in self.anchor_inputs:
            torch.maximum(top, (x @ stored.T).float().amax(0), out=top)
        mean = w @ mu  # fp64
        margin = cfg.gate_margin if cfg.gate_neuron_margin is None else cfg.gate_neuron_margin
        threshold[n] = top + margin * (top.double() - mean).abs().float()
        # And key_context_margin above their strongest score on their own
        # fact's key tokens in other contexts (context_inputs).
        for k, (i, j) in enumerate(mine):
            x = self._context_inputs[i]
            if x is not None:
                top = (x @ stored[k]).float().max()
                spread = (top.double() - mean[k]).abs().float()
                threshold[j] = torch.maximum(threshold[j], top + cfg.key_context_margin * spread)

    #: The prompt of context_exchanges' made-up replies.
    CONTEXT_PROMPT = "Repeat these words."

    def context_exchanges(self) -> list[tuple[str, list[int]] | None]:
        """For each taught fact with a gate neuron, its key tokens
        (key_tokens) in other contexts: CONTEXT_PROMPT and a made-up reply (token
        ids) in which each of the fact's key tokens, in turn, follows
        config.key_contexts tokens drawn from the anchors' replies, one before
        each occurrence (the draw seeded by config.seed and the question).
        None for a fact without a gate neuron, and for every fact with
        key_contexts 0, the gate off or no anchors."""
        cfg, tok = self.config, self.tokenizer
        if not (cfg.key_contexts and cfg.gate and self._context_pool):
            return [None] * len(self.taught)
        out: list[tuple[str, list[int]] | None] = []
        for f, g in zip(self.taught, self._fact_gates):
            if g is None:
                out.append(None)
                continue
            ids = example_ids(tok, f.question, f.answer)[0]
            draw = random.Random(f"{cfg.seed}:{f.question}")
            reply: list[int] = []
            for t in ids[self.key_tokens(f)]:
                for _ in range(cfg.key_contexts):
                    reply += [draw.choice(self._context_pool), t]
            out.append((self.CONTEXT_PROMPT, reply))
        return out

    @torch.no_grad()
    def context_inputs(self) -> list[Tensor | None]:
        """The block inputs at the key tokens of context_exchanges (every
        second token of each reply): (key tokens x key_contexts, D) a fact,
        None where it has no exchange."""
        exchanges = self.context_exchanges()
        made = [e for e in exchanges if e is not None]
        xs = iter(self.block_inputs(made) if made else [])
        start = len(chat_prompt_ids(self.tokenizer, self.CONTEXT_PROMPT))
        return [None if e is None else next(xs)[start + 1 :: 2] for e in exchanges]

    def key_tokens(self, fact: Fact) -> slice:
        """Positions of the fact's exchange (example_ids) that predict its
        answer's tokens up to the end of its key (the whole answer when the
        key is not in it)."""
        tok = self.tokenizer
        p = len(chat_prompt_ids(tok, fact.question))
        at = fact.answer.find(fact.recall_key)
        end = len(fact.answer) if at < 0 else at + len(fact.recall_key)
        n = len(tok(fact.answer[:end], add_special_tokens=False)["input_ids"])
        n = min(n, len(tok(fact.answer, add_special_tokens=False)["input_ids"]))
        return slice(p - 1, p - 1 + n)

    @torch.no_grad()
    def _open_on_keys(self, top: Tensor, threshold: Tensor) -> None:
        """Open the gate where the taught facts' keys are answered: on each
        key token (key_tokens) that no neuron passes, the fact's own neuron
        (of this rank) that rises highest there above its lower bound
        ``max(top + key_gate_margin * |top|, gate_floor)`` has its threshold
        lowered to halfway between the two. Every threshold stays above the
        neuron's strongest anchor score, so the gate stays shut on every
        anchor token. Without it, the thresholds rose with each job's near
        negatives and hid taught facts that the ungated block recalled
        (capacity set, 8 jobs of 16: 76/128 gated, 100/128 ungated)."""
        b, cfg = self.block, self.config
        wg = b.w_gate_up[: b.local_neurons]
        low = (top + cfg.key_gate_margin * top.abs()).clamp_min(cfg.gate_floor)
        for f, x, rng, gate in zip(self.taught, self._taught_inputs, self._fact_ranges, self._fact_gates):
            # The fact's trained neurons (its gate neuron has its own threshold).
            own = self._local_rows([rng if gate is None else [rng[0], gate]]) if rng else None
            xs = x[self.key_tokens(f)]
            # Every rank agrees on which tokens are shut (the margins are maxed over ranks).
            shut = b.gate_margins(xs, wg, threshold) <= 0
            if own is None or not bool(shut.any()):
                continue
            own = own[torch.isfinite(threshold[own])]  # behind the gate: never lowered
            if own.numel() == 0:
                continue
            rise = (xs[shut] @ wg[own].T).float() - low[own]  # (shut tokens, own neurons)
            best, j = rise.max(1)
            ok = best > 0
            for n, r in zip(own[j[ok]].tolist(), best[ok].tolist()):
                threshold[n] = min(float(threshold[n]), float(low[n]) + r / 2)

    # --- the job -------------------------------------------------------------------

    def run(self, steps: int | None = None, *, progress: bool = False) -> list[StepMetrics]:
        """Train for `steps` microbatches (default the job's, self.steps), calibrate the
        gate and publish. On any failure the block reverts to its published
        weights and nothing is published."""
        steps = self.steps if steps is None else steps
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
        try:
            self.frozen.check(self.base_tables)
        except FrozenWeightsChanged as exc:
            raise TrainingAborted(f"{exc} during the job") from exc

    # --- JobBody -------------------------------------------------------------------

    def fingerprint(self) -> Mapping[str, str]:
        return self.frozen()

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


def _fact_of(entry: Mapping) -> Fact:
    """A taught fact from its memory entry."""
    fact = {k: v for k, v in entry.items() if k not in ("neurons", "gate", "behind_gate")}
    return parse_fact(fact, f"the block's memory ({entry['question']!r})", check_words=False)
