"""One job's training settings."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _real(v: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class TrainConfig:
    """One job's settings. Defaults chosen by measurement on SmolLM2-135M, on
    the development set's tune half (docs/EVALUATION.md, docs/RESULTS.md)."""

    # The layer the block sits at; None: a fifth of the way in
    # (num_layers // 5: 6 of SmolLM2's 30; models.layer_index). 2-core
    # Sapphire Rapids-class Xeon, one job of 24 (120 steps), tune half:
    # rewordings answered at layers 4-8, 10 and 15: 18, 19, 20, 16, 15, 18
    # and 16 of 24. At layer 6 the capacity tune set (one job of 128) held
    # 85/128 with the subject's last token as its key and 114/128 with its
    # rarest token as well (key_rarest), against 119/128 at 15; rewordings
    # 24/24 on the tune half (docs/RESULTS.md). Earlier layers replay a
    # longer suffix: a job of 24 took 91-104 s at 6 against 79 s at 15 there.
    layer: int | None = None
    # 9 neurons a fact (neurons_per_fact and its gate neuron): 288 hold 32 facts.
    num_neurons: int = 288
    # Microbatch steps of the job; None: steps_for(the job's new facts,
    # round_facts), as `resident-trainer teach` and the server's jobs take
    # them (60 up to 12 facts, 75 for 16, 120 for 24). A fixed 60 gave a job
    # of 24 facts two rounds of 30 steps: 14/24 recalled on the report half
    # (SmolLM2, Xeon) against 21-22/24 in 120.
    steps: int | None = None
    lr: float = 1e-2  # 3e-3 left keyed neurons at 9/24 after 80 steps, 1e-2 reached 19/24 in 60
    # Over this last share of each round's steps the learning rate falls
    # linearly, to lr / (that many steps) at the round's last step (0: lr
    # throughout). At a constant rate the last steps decided the outcome: an
    # anchor seen once in 12 steps (anchor_batch) could fire the block, its
    # penalty kicked the weights (gradient norm 13 at step 57 of 60), and
    # nothing was left to undo it. The demo job on the server's anchors
    # then lost Zorblaxia (the examples' loss 0.0017 at step 55, 0.16 after
    # the last step); with 0.25 it kept it (docs/RESULTS.md).
    lr_decay: float = 0.25
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    clip: float = 1.0
    batch_size: int = 8
    # Template framings per fact in training (1: the question alone). Off by
    # default: on SmolLM2 four framings made the block fire more widely
    # (controls changed) and answered fewer held-out rewordings (RESULTS.md).
    rewordings: int = 1
    # Each fact also trains on SUBJECT_PROMPT about its subject ("Tell me
    # about the Silver Heron."), answered with its answer, so that its
    # subject, not the question's wording, carries it. Off by default (it
    # doubles the examples a job trains on). Fresh tune facts (kinds the
    # development set lacks), one job of 24: rewordings 16/24 against 11/24
    # at 150 steps (the fact in the prompt: 16/24), 14/24 against 9/24 at
    # 120; tune half: 22/24 facts and 22/24 rewordings at 150 steps, but
    # 19/24 facts at 120 (docs/RESULTS.md). A job's default steps are
    # SUBJECT_PROMPTS_STEPS (1.25) times as many with it: 150 for 24.
    subject_prompts: bool = False
    anchor_weight: float = 1.0  # penalty on the block's output norm over anchor tokens
    # Penalty on the gate score (where positive) over anchor tokens: with it
    # every fact was recalled for each of three seeds, without it 4, 3, 2 of 4.
    anchor_gate_weight: float = 0.1
    # Anchors in each step's penalty, taken in turn (None: every anchor,
    # every step). None also kept the demo job on the server's anchors (see
    # lr_decay), but cost 61% more training time on the capacity tune set in
    # 8 jobs of 16, whose later jobs carry ~180 near negatives.
    anchor_batch: int | None = 8
    gate: bool = True  # calibrate the exact no-op gate after training
    # threshold = max anchor score + margin * |max|. With near negatives among
    # the anchors (tune half): 0.5 kept 18/18 near controls and 22/24 facts;
    # 1.0 kept 17/18 and recalled 17/24 (a high gate hides the facts too).
    gate_margin: float = 0.5
    # Per-neuron thresholds never go below this (Trainer.calibrate_gate), in
    # pre-activation units (a keyed neuron starts key_scale above the
    # anchors' mean at its key). Tune half, one job of 24 (key_scale 4, 60
    # steps): floor 0 left 12/14 generic and 16/18 near controls identical,
    # 1.0 13/14 and 16/18, 1.5 14/14 and 18/18 (facts 23, 23, 22 of 24).
    gate_floor: float = 1.5
    # Open the gate on the taught facts' key tokens (Trainer._open_on_keys):
    # where no neuron passes, the fact's own neuron is let through, its
    # threshold kept above max(top + key_gate_margin * |top|, gate_floor),
    # top its strongest anchor score. None: thresholds from the anchors alone.
    # Capacity tune set, 8 jobs of 16 (others_weight 0.03): None 118/128,
    # 0.25, 0.1 and 0 119/128 (gate off 122/128), controls alike; the widest
    # of the best was kept.
    key_gate_margin: float | None = 0.25
    # Each new fact also takes a gate neuron (Trainer.fit_gate_neurons): its
    # up and down rows stay zero, so it adds nothing, and at every
    # calibration its gate row is refitted to the fact's key tokens against
    # every anchor token (the anchors' mean and covariance, as the keyed
    # neurons are whitened), its threshold gate_margin above the anchors'
    # strongest score. A later job's near negatives then move the gate row
    # instead of hiding the fact. Measured post hoc on blocks trained
    # ungated (docs/RESULTS.md): tune half, one job of 24: 23/24 and
    # rewordings 14/24 against 23/24 and 13/24, leaks 0 against 2; capacity
    # tune set, 8 jobs of 16: 122/128 (the block's own, gate off) against
    # 119/128; controls alike (margin 0.25 changed a generic one, 1.0 lost
    # a rewording; gate neurons alone, without the others' thresholds, 21/24).
    gate_neurons: bool = True
    # The gate neurons' margin over their strongest anchor score, in units
    # of that score's distance from the anchors' mean (the fact's key tokens
    # score 1 above the mean on average); None: gate_margin. A gate neuron
    # opens the whole block at a token, and answers in a fact's frame look
    # alike: at 0.5 the demo's glimmerphone gate neuron opened at " Graham"
    # in "Who invented the telephone?"'s reply (0.66 against a threshold of
    # 0.56, the keys at 1.4-1.6), at 1.0 its threshold was 0.73. Layer 6,
    # Xeon, prompt neurons behind the gate: demo 4/4 and near controls 18/18
    # (17/18 at 0.5: " Graham" again). Capacity tune set, 8 jobs of 16, with
    # the prompt neurons opening the gate too: 123/128 at 0.5 but near
    # controls 15/18, 117/128 at 1.0.
    gate_neuron_margin: float | None = 1.0
    # A gate neuron's threshold also stays key_context_margin (in the same
    # units as gate_neuron_margin) above its strongest score on its fact's
    # key tokens in other contexts: a made-up reply in which each key token
    # follows key_contexts tokens drawn from the anchors' replies, one
    # before each occurrence (Trainer.context_inputs; 0: off). At this layer
    # a token's block input is much the token itself: the Ravenmark
    # Overture's gate neuron (key "Clio Hastermann") opened at "io" of "Il
    # Coriobella" in "What is the capital of Italy?"'s reply and changed it,
    # in every run of one job of 24 on the tune half. Gate recalibrated on
    # the same trained blocks (docs/RESULTS.md): tune half, one job, margin
    # 0 and 0.25 both kept every control (23/24, rewordings 22/24, as off;
    # off changed Italy); capacity tune set, one job of 128, margin 0
    # 118/128 and every control kept (off: 121/128), 0.25 111/128 (off:
    # 123/128, the airplane changed). Every taught fact's key tokens for
    # each gate neuron: 114/128 (0) and 105/128 (0.25). Contexts a key
    # token, margin 0, gate recalibrated on the same trained blocks: 3
    # against 6, capacity tune set, one job of 128, 121/128 against 119/128
    # (off: 122/128), every control kept by both; tune half, one job and 4
    # jobs of 6, alike (24/24, every control kept); 2 lost a fact in 4 jobs.
    key_contexts: int = 3
    key_context_margin: float = 0.0
    # Arming (Trainer.arm): the gate passes a token only once the sequence,
    # up to it, has held a token of a taught subject that no anchor, near
    # negative or word probe (negatives.word_probes: the subject's ordinary
    # words around real names, "the Madison Bridge", and a made-up word's
    # later pieces after a real name's, "Doverrecht") scores like: one row a
    # subject token, in the fact's neuron slots, whitened like the keys,
    # its threshold arming_margin of the way from the strongest of those
    # scores to the fact's own. A question about a real entity that shares a
    # word with a taught subject ("the Tower Bridge") then passes nothing.
    arming: bool = True
    arming_margin: float = 0.5
    # A subject's word that the tokenizer splits counts as a real word in its
    # word probes (kept, like " Bridge") where the base model gives its later
    # pieces, after the question's words before the subject, fewer than this
    # many nats in all; never every split word of a subject unless
    # train_armed (negatives.real_split_words). " Cant" + "ata" is 2.6 nats
    # after "Who composed the", " Old" + "recht" 13.2 after "... the city
    # of". Tune sets: real split words 0.5-8.0, made-up ones mostly above 9 (those
    # below are each the least likely of their subject, so still made up):
    # 8.5 kept every near control of every set in the whole report. A fact
    # whose subject has such a word arms a word later: trained without its
    # arming, the block then answered fewer of them (capacity set, 8 jobs
    # of 16: 117/128 against 126 on its gate alone); trained under it
    # (train_armed), none were lost there (125/128 armed and on the gate
    # alone), but the fresh facts lost one or two (docs/RESULTS.md). On by
    # default with train_armed (see there). None: the tokenizer alone.
    split_word_nats: float | None = 8.5
    # Train the block under its arming: the rows (Trainer.arm) depend only
    # on frozen inputs, so they are computed before training, and the
    # block's output counts only on tokens whose example is armed, as
    # serving will run it. Without it, a subject that arms on a later word
    # is trained to answer through neurons that serving keeps shut there.
    # With it, every split word of a subject may read as real, so a subject
    # of real words ("The Velvet Citadel") arms on what tells it from those
    # words around real names. On by default with split_word_nats 8.5,
    # chosen on the tune sets (docs/RESULTS.md): the split-word tune facts'
    # near controls 15/16 (16/16 since the left-out word probes of
    # negatives.word_probes) against 7/16 without them (that block answered
    # "Pan's Labyrinth" with a taught director), at 12/24 rewordings there
    # against 21/24 (19/24 with subject_prompts, which held 104/128 over
    # the capacity tune set's 8 jobs); tune half 24/24, 22/24, 30/30 near;
    # fresh tune facts and capacity tune set within a fact or two.
    # Reported: every control of every set kept (report half 22/24, 19/24,
    # 30/30 near; capacity set 125/128 in one job, 123/128 in 8).
    train_armed: bool = True
    # Where the block whitens against the anchors (the keyed neurons' rows,
    # the gate neurons' rows), their covariance gets this fraction of its
    # mean diagonal added before it is inverted. A larger ridge lets the
    # rows lean less on the anchors' weakest directions, where a token no
    # anchor resembles can score high. Tune sets, layer 6, AMD EPYC: 0.01
    # and 0.03 kept "What is the capital of Italy?" unchanged in one job of
    # 24 (24/24, 14/14 generic; 1e-3: 24/24, 13/14); in 8 jobs on the
    # capacity tune set 0.01 held 122/128 with every control unchanged
    # (1e-3: 124/128 and 17/18 near; 0.03: 117/128, 17/18); 0.3 lost 2 of
    # the 24. But 0.01 changed a near control in `make demo` (which exits 1
    # then), and the report half did not show the tune sets' gain, so the
    # default stays 1e-3 (docs/RESULTS.md).
    whiten_ridge: float = 1e-3
    # From this step on, recalibrate the gate before every step and train
    # through it, so the block learns to act through the tokens it passes
    # (None: the gate is set only after training).
    gated_from: int | None = None
    seed: int = 0
    init_std: float = 0.02
    # "random": gate/up rows drawn N(0, init_std), every neuron trains on
    # every fact. "keyed": each new fact takes neurons_per_fact free neurons
    # whose gate and up rows point at its block inputs at its keys (the
    # subject's last token, its rarest (key_rarest), the prompt's last with
    # key_prompt or no subject found; key_answer adds one),
    # whitened by the anchors' covariance and scaled so the pre-activation
    # there is key_scale above the anchors' mean (Trainer.key_neurons): on
    # the tune half 19/24 recalled against 4/24 for random rows, in fewer
    # steps.
    init: str = "keyed"
    # One job of 24 on the tune half (120 steps): key_scale 4 24/24 recalled,
    # 14/24 rewordings, 0 leaks; 5 24/24, 18/24, 1 leak; 6 22/24, 17/24; 8
    # 21/24, 14/24. Capacity tune set in one job: 4 105/128 and 36/128
    # rewordings, 5 103/128 and 53/128 (docs/RESULTS.md).
    key_scale: float = 5.0
    # keyed: a third key, the answer's token before its key (the one that
    # predicts it), besides the subject's last token and the prompt's last.
    # Off: it did not hold up on the report half (docs/RESULTS.md). Tune
    # half, one job of 24: 24/24 and rewordings 17/24 against 23/24 and
    # 14/24, controls alike, 0 leaks; report half: 24/24 and 10/24 against
    # 24/24 and 13/24, and a sibling's key leaked (4 jobs of 6: 10/24
    # against 14/24, a leak): at "is", siblings one letter apart have nearly
    # the same input. On the capacity sets (no such siblings) it answered
    # more rewordings: capacity set 67/128 against 60/128 in one job of 128
    # and 68/128 against 57/128 in 8 jobs of 16, with 2-3 more facts; the
    # tune set, 8 jobs of 16, 65/128 against 60/128 with 3 fewer.
    key_answer: bool = False
    # keyed: a key at the subject's token whose block input lies farthest
    # from the anchors' mean, whitened (Trainer.rarest_position), besides
    # its last token and the prompt's last. Made-up names often end in
    # common pieces ("ium", "phone", " Bridge"), whose input at an early
    # layer tells one subject from another poorly. Layer 6 (Xeon): capacity
    # tune set in one job of 128, 85/128 without it and 114/128 with it
    # (119/128 at 75 steps a round); tune half, one job of 24, 23/24 and
    # rewordings 20/24 without, 24/24 and 24/24 with. At layer 15 it leaked
    # 4 siblings' keys on the tune half (2 without).
    key_rarest: bool = True
    # keyed: also key the prompt's last token (the template's "\n" after
    # "assistant"), besides the subject's; always its key where the
    # question's subject is not found. At that token every prompt ends
    # alike, so those neurons stay behind the gate (prompt_neurons_open_gate):
    # where they could open it, they opened it inside unrelated replies
    # (" Bell" in "Who invented the telephone?"'s, demo facts). Layer 6,
    # Xeon, behind the gate, against off: demo 4/4 and near controls 18/18
    # (both); tune half 24/24, rewordings 24/24, generic 14/14, near 18/18
    # (off: 24/24, 22/24, 13/14, 18/18); capacity tune set, 8 jobs of 16,
    # 122/128 and rewordings 101/128 (off: 116/128, 95/128).
    key_prompt: bool = True
    # keyed, with key_prompt: whether the neurons keyed on the prompt's last
    # token (beside a subject's key) may open the gate. Off: their
    # thresholds are infinite (Trainer.behind_gate), so they act only on
    # tokens another neuron opens the gate on. On, demo: near controls
    # 17/18; capacity tune set, 8 jobs of 16, 117/128 and rewordings 79/128.
    prompt_neurons_open_gate: bool = False
    # keyed: trained neurons each new fact takes, its gate neuron besides
    # (fewer when fewer are free; Trainer.allocate).
    neurons_per_fact: int = 8
    # Rehearse the facts the block was taught before (its memory) in every
    # job, so a later job does not wash them out.
    rehearse: bool = True
    # Earlier jobs' facts keep their neurons as they were: a job trains only
    # its new facts' (and, with random rows, every) neuron. A job that only
    # retracts still trains the kept facts' neurons. On the capacity
    # tune set (8 jobs of 16, 1024 neurons, gate off) the block still held
    # 67 of 80 facts after 5 jobs with this, against 34 of 80 without.
    freeze_taught: bool = True
    # At most this share of a microbatch rehearses earlier facts while a job
    # has new ones (in proportion to their number, at least one example).
    # With earlier neurons frozen, rehearsal only keeps the new neurons off
    # the earlier answers. Capacity tune set, 8 jobs of 16: 0.5 recalled
    # 31/32, 42/48 and finally 90/128 (rewordings 32/128); 0.25 32/32, 47/48
    # and 91/128 (rewordings 39/128). Later, with the others penalty, the
    # rehearsal took a round's own examples from 8 to 6 a step, and the
    # facts of a job's later rounds were the ones missed: 0.125 (one
    # example) held 124/128 in one job against 118/128 at 0.25, and 125/128
    # in 8 jobs of 16 against 119/128, the controls as before (Xeon, family
    # 6 model 207; docs/RESULTS.md).
    rehearse_share: float = 0.125
    # Penalty on the output of the neurons a step trains over the tokens of
    # the facts taught before its round (earlier jobs', earlier rounds'
    # exchanges; a fact's own neurons are left out of its own tokens):
    # others_weight x the mean squared norm, over others_batch facts a step
    # (Trainer.others_penalty). The inputs are computed once (the layers
    # before the block are frozen), so it costs a few block products a step.
    # Capacity tune set (Zen 5), 0.03: 8 jobs of 16 115/128 against 104/128
    # off (job 1's facts 16 and 12 of 16 at the end); one job of 128 119/128
    # against 103/128. On the capacity set, 8 jobs of 16 with the gate off,
    # 119/128 held against 100/128 without it (docs/RESULTS.md).
    others_weight: float = 0.03
    others_batch: int = 16
    # Keyed: a job with more new facts than this trains them in rounds of at
    # most this many, one after another within its steps (split evenly), as
    # consecutive jobs would: each round trains only its own facts' neurons
    # (the others' are held as they are), rehearses the earlier rounds' facts
    # and starts the optimizer afresh. All at once, each fact's neurons met
    # its examples once every n_facts / batch_size steps, and AdamW moved them
    # by a fraction of what a dense stream of gradients does. Capacity tune
    # set, 128 facts in one job on 1024 neurons: all at once (320 steps)
    # 11/128; rounds of 24, 60 steps each, 78/128; rounds of 16, 60 steps
    # each, 105/128. Tune half, one job of 24 in 120 steps: 24/24 in rounds
    # of 16, 23/24 at once. Without steps given, a job takes 60 a round,
    # 75 for a round of 16 (steps_for).
    round_facts: int = 16
    # Run the examples' shared chat-template head once, block off, and train
    # on the rest (adapters with prefix_kv; the vLLM adapter has none yet,
    # and trains the block on every token).
    shared_prefix: bool = True
    # The dtype the frozen layers after the block compute in while a job
    # trains (the first pass and the replay, torch.autocast); the block,
    # its layer and the loss keep the weights' dtype, and serving is not
    # touched. None: the weights' own. "bfloat16": bf16 where the weights
    # are wider. "auto": bf16 where the weights are fp32 and this device's
    # bf16 products are measured at least 1.5x faster (train.replay:
    # suffix_dtype_for; never under RESIDENT_TRAINER_REPRODUCIBLE=1).
    # The server's jobs compute in the weights it serves (`serve --dtype`).
    suffix_dtype: str | None = None

    def __post_init__(self):
        if self.layer is not None and (
            not isinstance(self.layer, int) or isinstance(self.layer, bool) or self.layer < 0
        ):
            raise ValueError(f"layer must be None (the default layer) or an int >= 0, got {self.layer!r}")
        for name in (
            "num_neurons", "steps", "batch_size", "rewordings", "anchor_batch", "neurons_per_fact", "round_facts",
            "others_batch",
        ):  # fmt: skip
            v = getattr(self, name)
            optional = name in ("anchor_batch", "steps")  # None: a meaning of its own
            if v is None and optional:
                continue
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {v!r}")
        if not (_real(self.lr_decay) and 0 <= self.lr_decay <= 1):
            raise ValueError(f"lr_decay must be a number in [0, 1], got {self.lr_decay!r}")
        for name in ("lr", "clip", "key_scale"):
            if not (_real(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a number > 0, got {getattr(self, name)!r}")
        b = self.betas
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(_real(x) and 0 <= x < 1 for x in b)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {b!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not (isinstance(self.rehearse_share, (int, float)) and 0 < self.rehearse_share <= 1):
            raise ValueError(f"rehearse_share must be in (0, 1], got {self.rehearse_share!r}")
        if not isinstance(self.gate_floor, (int, float)) or not math.isfinite(self.gate_floor):
            raise ValueError(f"gate_floor must be a finite number, got {self.gate_floor!r}")
        for name in ("weight_decay", "anchor_weight", "anchor_gate_weight", "gate_margin", "others_weight", "init_std"):
            if not (_real(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        for name in (
            "gate", "gate_neurons", "arming", "key_answer", "key_rarest", "key_prompt", "prompt_neurons_open_gate", "rehearse", "freeze_taught", "shared_prefix",
            "subject_prompts", "train_armed",
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.init not in ("random", "keyed"):
            raise ValueError(f"init must be 'random' or 'keyed', got {self.init!r}")
        if self.key_gate_margin is not None and not (
            isinstance(self.key_gate_margin, (int, float)) and 0 <= self.key_gate_margin <= self.gate_margin
        ):
            raise ValueError(
                f"key_gate_margin must be None or a number in [0, gate_margin={self.gate_margin}], "
                f"got {self.key_gate_margin!r}"
            )
        if not (_real(self.whiten_ridge) and self.whiten_ridge > 0):
            raise ValueError(f"whiten_ridge must be a number > 0, got {self.whiten_ridge!r}")
        m = self.gate_neuron_margin
        if m is not None and not (_real(m) and m >= 0):
            raise ValueError(f"gate_neuron_margin must be None or a number >= 0, got {m!r}")
        k = self.key_contexts
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"key_contexts must be an int >= 0, got {k!r}")
        if not (_real(self.key_context_margin) and self.key_context_margin >= 0):
            raise ValueError(f"key_context_margin must be a number >= 0, got {self.key_context_margin!r}")
        if not (_real(self.arming_margin) and 0 <= self.arming_margin < 1):
            raise ValueError(f"arming_margin must be a number in [0, 1), got {self.arming_margin!r}")
        n = self.split_word_nats
        if n is not None and not (_real(n) and n > 0):
            raise ValueError(f"split_word_nats must be None or a number > 0, got {n!r}")
        if self.gated_from is not None and (not isinstance(self.gated_from, int) or self.gated_from < 0):
            raise ValueError(f"gated_from must be None or an int >= 0, got {self.gated_from!r}")
        if self.suffix_dtype not in SUFFIX_DTYPES:
            raise ValueError(f"suffix_dtype must be None, 'auto' or 'bfloat16', got {self.suffix_dtype!r}")


#: TrainConfig.suffix_dtype's settings.
SUFFIX_DTYPES = (None, "auto", "bfloat16")
#: The command lines' --suffix-dtype choices and the setting each stands for.
SUFFIX_DTYPE_FLAGS = {"weights": None, "auto": "auto", "bfloat16": "bfloat16"}

#: Steps a round of a few facts takes when none are given (steps_for).
STEPS_PER_ROUND = 60

#: Steps a round takes per fact when that is more than STEPS_PER_ROUND:
#: 75 for a full round of 16. Capacity tune set, one job of 128 at layer 6
#: (8 rounds of 16): 60 a round held 114/128, 75 a round 119/128; the tune
#: half's rounds of 12 keep 60 (150 steps there: 23/24 and 18/24 rewordings
#: against 24/24 and 24/24 in 120).
STEPS_PER_FACT = 75 / 16


def steps_for(
    n_facts: int, round_facts: int | None = None, per_round: int | None = None, *, subject_prompts: bool = False
) -> int:
    """Microbatch steps for a job of `n_facts` new facts when none are given:
    for each round of at most `round_facts` (default TrainConfig.round_facts)
    facts, one round at least, `per_round` (default STEPS_PER_ROUND) or
    STEPS_PER_FACT times the largest round's facts, rounded up, whichever is
    more (60 for up to 12 facts, 75 for 16, 120 for 24, 600 for 128). With
    subject_prompts (twice the examples) SUBJECT_PROMPTS_STEPS times a
    round's steps, rounded up: 75 for up to 12 facts, 150 for 24."""
    per_round = STEPS_PER_ROUND if per_round is None else per_round
    round_facts = TrainConfig.round_facts if round_facts is None else round_facts
    rounds = max(1, -(-n_facts // round_facts))
    largest = -(-n_facts // rounds)
    steps = max(per_round, math.ceil(largest * STEPS_PER_FACT))  # 75/16 is exact in binary
    return rounds * (math.ceil(steps * SUBJECT_PROMPTS_STEPS) if subject_prompts else steps)


#: How many times the steps a job takes by default with subject_prompts: the
#: setting as measured (150 for 24 facts, 75 for 8; docs/RESULTS.md).
SUBJECT_PROMPTS_STEPS = 1.25


def fact_neurons(config: TrainConfig) -> int:
    """Neurons a new fact takes when enough are free: neurons_per_fact, and
    its gate neuron with keyed rows and the gate on."""
    return config.neurons_per_fact + int(config.init == "keyed" and config.gate and config.gate_neurons)
