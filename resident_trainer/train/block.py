"""The added block: `num_neurons` SwiGLU neurons on one layer's residual
stream, with a trainable copy of its weights (what a job trains) and a
published copy (what serving reads).

It attaches to layer L's feed-forward block with a forward hook on that
module instance (nothing in transformers is patched) and adds
``down(silu(x Wg^T) * (x Wu^T))`` of the block's own input (the normalized
hidden) to the block's output, i.e. to the residual stream, exactly like extra
neurons of the layer's (shared-expert) MLP. The down projection starts at
zero, so a fresh block changes nothing.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from resident_trainer.models.adapter import DecoderAdapter
from resident_trainer.ops.added_expert import added_expert
from resident_trainer.ops.collectives import amax_over_ranks, max_over_ranks
from resident_trainer.train.parallel import shard_range


class AddedSharedNeurons(nn.Module):
    """`num_neurons` added SwiGLU neurons on a `hidden_size` residual stream.

    Trainable: ``w_gate_up`` (2A, D), gate rows first, and ``w_down`` (D, A),
    where A is this rank's share of the neurons under tensor parallelism
    (`process_group`). Published (what serving uses): the buffers
    ``published_gate_up``, ``published_down`` and ``published_threshold``.

    threshold: the exact no-op gate. A (A,) fp32 tensor of this rank's
    neurons' thresholds t_a (what Trainer.calibrate_gate sets), or one float
    t for every neuron: the block outputs exactly zero (and takes no gradient)
    on tokens where no neuron's gate pre-activation exceeds its threshold,
    ``max_a (x . Wg_a - t_a) <= 0`` (over all ranks' neurons). None: off.

    arming, published_arming: None, or (rows (A, D), thresholds (A,)), both
    fp32, as Trainer.arm sets them: with a gate, a token passes only once its
    sequence, up to and including it, has held a token on which some row
    scores above its threshold (``x . r_a > s_a``, over every rank's rows; a
    slot without a row has threshold inf). Serving keeps that state per
    sequence on the Hugging Face cache of keys and values beside them: a
    forward that continues a cache (``past_key_values`` with tokens in it)
    continues its sequences (one sequence continued by many rows, as a
    shared prompt head, is broadcast); padding (attention mask 0) never
    arms.
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
        self.neuron_start, self.neuron_stop = shard_range(num_neurons, world, rank)
        a = self.neuron_stop - self.neuron_start
        # The full gate/up init is drawn on every rank from one seed and each
        # rank keeps its rows: any split gives the same block as one process.
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(2, num_neurons, hidden_size, generator=g) * init_std
        gate_up = torch.cat(
            [full[0, self.neuron_start : self.neuron_stop], full[1, self.neuron_start : self.neuron_stop]]
        )
        kw = dict(dtype=dtype, device=device)
        self.w_gate_up = nn.Parameter(gate_up.to(**kw))
        self.w_down = nn.Parameter(torch.zeros(hidden_size, a, **kw))
        self.register_buffer("published_gate_up", gate_up.to(**kw).clone())
        self.register_buffer("published_down", torch.zeros(hidden_size, a, **kw))
        self.threshold: Tensor | float | None = None
        self.published_threshold: Tensor | float | None = None
        # What the block was taught (the facts, as JSON objects, each with the
        # global neuron range keyed on it, if any) and how many neurons, from
        # 0, are in use: the trainable side and the published side, like the
        # weights. A later job rehearses the taught facts and keys new ones
        # on free neurons; the checkpoint carries both.
        self.memory: dict = {"taught": [], "used": 0}
        self.published_memory: dict = {"taught": [], "used": 0}
        self.arming: tuple[Tensor, Tensor] | None = None
        self.published_arming: tuple[Tensor, Tensor] | None = None
        # Per-sequence arming state: the sequences' state before this
        # forward (kept on the cache it continues), the state after it (the
        # model's forward hook keeps it on the cache it returns), and the
        # forward's attention mask (the model's pre-hook sets them).
        self._before: Tensor | None = None
        self._after: Tensor | None = None
        self._mask: Tensor | None = None
        self.impl = impl
        self._train_active = False
        self._capture: list[Tensor] | None = None
        self._disabled = False
        # Training under the arming (training_arming): the rows and the
        # packed rows' segments of the forward being trained.
        self._train_arming: tuple[Tensor, Tensor] | None = None
        self._segments: Tensor | None = None

    @property
    def local_neurons(self) -> int:
        return self.neuron_stop - self.neuron_start

    # --- the block itself -------------------------------------------------

    def _scores(self, x: Tensor, w_gate_up: Tensor, exclude: Tensor | None = None) -> Tensor:
        pre = (x @ w_gate_up[: self.local_neurons].T).float()
        if exclude is not None:
            pre = pre.index_fill(-1, exclude, float("-inf"))
        if self.process_group is not None:
            return amax_over_ranks(pre, self.process_group)
        return pre.amax(-1)

    def gate_scores(self, x: Tensor, *, published: bool = False, exclude: Tensor | None = None) -> Tensor:
        """(...,) fp32: each token's strongest gate pre-activation ``max_a (x . Wg_a)``
        over every rank's neurons, of the trainable weights (differentiable:
        the gradient reaches the neuron(s) holding the max, split evenly over
        ties as in one process) or the published ones. `exclude`: this
        rank's local neuron indices left out (-inf for a rank whose neurons
        are all left out)."""
        return self._scores(x, self.published_gate_up if published else self.w_gate_up, exclude)

    def gate_margins(self, x: Tensor, w_gate_up: Tensor, threshold: Tensor | float) -> Tensor:
        """(...,) fp32: each token's largest ``x . Wg_a - t_a`` over every
        rank's neurons (the gate passes the token where it is > 0)."""
        pre = (x @ w_gate_up[: self.local_neurons].T).float()
        if isinstance(threshold, Tensor):
            pre = pre - threshold.to(pre.device)
        else:
            pre = pre - float(threshold)
        margin = pre.amax(-1)
        if self.process_group is not None:
            margin = max_over_ranks(margin, self.process_group)
        return margin

    def gate_mask(self, x: Tensor, w_gate_up: Tensor, threshold: Tensor | float | None) -> Tensor | None:
        """(...,) bool: tokens where some neuron's gate pre-activation (over
        every rank's neurons) exceeds its threshold; None when there is no gate."""
        if threshold is None:
            return None
        with torch.no_grad():
            return self.gate_margins(x, w_gate_up, threshold) > 0

    def arming_margins(self, x: Tensor, arming: tuple[Tensor, Tensor]) -> Tensor:
        """(...,) fp32: each token's largest ``x . r_a - s_a`` over every
        rank's arming rows (the token arms its sequence where it is > 0)."""
        rows, thr = arming
        margin = (x.float() @ rows.T - thr).amax(-1)
        if self.process_group is not None:
            margin = max_over_ranks(margin, self.process_group)
        return margin

    def armed(
        self,
        x: Tensor,
        arming: tuple[Tensor, Tensor],
        before: Tensor | None = None,
        valid: Tensor | None = None,
        segments: Tensor | None = None,
    ) -> Tensor:
        """(B, T) bool for a (B, T, D) batch of sequences ((T,) for one
        (T, D) sequence): whether some token up to and including each one
        armed its sequence. `before`: (B,) or (1,) bool, sequences armed
        before these tokens; `valid`: (B, T) bool, the tokens that may arm
        (not padding); `segments`: (B, T) ids of the sequences packed one
        after another into each row (data.pack): each starts unarmed."""
        with torch.no_grad():
            fired = self.arming_margins(x, arming) > 0
            if valid is not None:
                fired = fired & valid.to(fired.device)
            count = fired.int().cumsum(-1)
            if segments is not None:
                # Subtract the count before each segment's first token (the
                # counts never fall, so a running max carries it along).
                seg = segments.to(count.device)
                start = torch.ones_like(fired)
                start[..., 1:] = seg[..., 1:] != seg[..., :-1]
                count = count - torch.where(start, count - fired.int(), 0).cummax(-1).values
            armed = count > 0
        if before is not None:  # (B,) or (1,) against (B, T), or (1,) against (T,)
            armed = armed | (before[:, None] if armed.dim() == 2 else before).to(armed.device)
        return armed

    def _sequence_armed(self, x: Tensor, arming: tuple[Tensor, Tensor]) -> Tensor:
        """armed() for a forward through the hook: it continues the state of
        the cache the forward continues (`_before`, one sequence broadcast to
        many rows, as a shared prompt head), and leaves the state for the
        cache it returns (`_after`)."""
        before = self._before
        if before is not None and x.dim() == 3 and before.shape[0] not in (1, x.shape[0]):
            before = None  # not the rows that cache holds: nothing to continue
        # Padding (attention mask 0) never arms a sequence.
        mask, valid = self._mask, None
        if mask is not None and x.dim() == 3 and mask.shape[0] == x.shape[0] and mask.shape[-1] >= x.shape[1]:
            valid = mask[:, mask.shape[-1] - x.shape[1] :].bool()
        armed = self.armed(x, arming, before, valid)
        self._after = armed[..., -1].reshape(-1) if armed.dim() == 2 else armed[-1:].reshape(1)
        return armed

    def block(self, x: Tensor, *, published: bool, gated: bool = True, armed: Tensor | None = None) -> Tensor:
        """The block's output for input x (..., D): the trainable weights with
        autograd, or the published ones; `gated=False` ignores the threshold
        (and the arming). With the published arming and a gate, the tokens of
        unarmed sequences are shut too: `armed` ((B, T) bool, the hook's
        state), or x taken as whole sequences. The trainable weights shut the
        tokens where `armed` is False (with or without a gate)."""
        if published:
            w_gu, w_d, thr = self.published_gate_up, self.published_down, self.published_threshold
        else:
            w_gu, w_d, thr = self.w_gate_up, self.w_down, self.threshold
        mask = self.gate_mask(x, w_gu, thr if gated else None)
        if mask is not None and published and self.published_arming is not None:
            mask = mask & (self.armed(x, self.published_arming) if armed is None else armed)
        elif not published and armed is not None:  # training under the arming (training_arming)
            mask = armed if mask is None else mask & armed
        return added_expert(x, w_gu, None, w_d, token_mask=mask, process_group=self.process_group, impl=self.impl)

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x, published=not self._train_active)

    # --- attaching to a model -----------------------------------------------

    def attach(self, adapter: DecoderAdapter, layer: int | None = None):
        """Add the block to layer `layer`'s feed-forward output (a forward hook
        on that module instance; None: the default layer, models.layer_index),
        and, for a Hugging Face model (DecoderAdapter), a forward pre-hook and
        hook on it that keep the arming state on the cache of keys and values
        a forward continues and returns. Returns a handle; .remove() detaches."""
        ffn = adapter.ffn(adapter.layer_index(layer))
        if self.hidden_size != adapter.hidden_size:
            raise ValueError(
                f"the block's hidden_size={self.hidden_size} does not match the model's {adapter.hidden_size}"
            )
        handles = [ffn.register_forward_hook(self._hook)]
        if isinstance(adapter, DecoderAdapter):  # a served vLLM model keeps its own (integrations.vllm.served)
            model = adapter.model
            handles.append(model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True))
            handles.append(model.register_forward_hook(self._model_hook, with_kwargs=True))
        return _Handles(*handles)

    #: The attribute of a Hugging Face cache that holds its sequences' arming state.
    CACHE_STATE = "resident_trainer_armed"

    def _model_pre_hook(self, module, args, kwargs):
        # A forward over cached keys and values continues the sequences that
        # cache holds (their state rides on it); its attention mask tells
        # padding apart.
        past = kwargs.get("past_key_values")
        length = getattr(past, "get_seq_length", None)
        held = length is not None and int(length()) > 0
        self._before = getattr(past, self.CACHE_STATE, None) if held else None
        self._after = None
        mask = kwargs.get("attention_mask")
        self._mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None

    def _model_hook(self, module, args, kwargs, output):
        past = getattr(output, "past_key_values", None)
        if past is not None and self._after is not None:
            setattr(past, self.CACHE_STATE, self._after)
        self._before = self._after = self._mask = None

    def _hook(self, module, inputs, output):
        if self._disabled:
            return output
        x = inputs[0]
        if self._capture is not None:
            self._capture.append(x.detach())
        published = not self._train_active
        armed = None
        if published and self.published_arming is not None and self.published_threshold is not None:
            armed = self._sequence_armed(x, self.published_arming)
        elif not published and self._train_arming is not None:
            seg = self._segments
            armed = self.armed(
                x, self._train_arming, segments=seg if seg is not None and seg.shape == x.shape[:-1] else None
            )
        return output + self.block(x, published=published, armed=armed).to(output.dtype)

    @property
    def uses_training_weights(self) -> bool:
        """Whether the attached block currently runs (and trains) the
        trainable weights rather than the published ones."""
        return self._train_active

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
    def training_arming(self, arming: tuple[Tensor, Tensor] | None, segments: Tensor | None = None) -> Iterator[None]:
        """Within the context, the trainable weights add nothing on a token
        until its sequence is armed by `arming` (rows, thresholds; as
        `armed`), so a job trains the block as serving will run it: a
        subject that arms late is not answered by neurons that serving
        keeps shut. `segments`: (B, T) ids of the sequences packed into each
        row of the forward. None: no arming while training."""
        prev = self._train_arming, self._segments
        self._train_arming, self._segments = arming, segments
        try:
            yield
        finally:
            self._train_arming, self._segments = prev

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Within the context the attached block adds nothing: the model
        answers as the base model (e.g. for near negatives' replies)."""
        prev, self._disabled = self._disabled, True
        try:
            yield
        finally:
            self._disabled = prev

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
        self.published_threshold = _copy_threshold(self.threshold)
        self.published_arming = _copy_arming(self.arming)
        self.published_memory = copy.deepcopy(self.memory)

    @torch.no_grad()
    def revert(self) -> None:
        """Drop unpublished training: trainable weights back to the published."""
        self.w_gate_up.copy_(self.published_gate_up)
        self.w_down.copy_(self.published_down)
        self.threshold = _copy_threshold(self.published_threshold)
        self.arming = _copy_arming(self.published_arming)
        self.memory = copy.deepcopy(self.published_memory)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_neurons={self.num_neurons}, "
            f"local=[{self.neuron_start}, {self.neuron_stop}), threshold={threshold_summary(self.threshold)}"
        )


def _copy_threshold(t: Tensor | float | None) -> Tensor | float | None:
    return t.clone() if isinstance(t, Tensor) else t


def _copy_arming(a: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor] | None:
    return None if a is None else (a[0].clone(), a[1].clone())


class _Handles:
    """The hooks attach() adds; .remove() removes them all."""

    def __init__(self, *handles) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def threshold_summary(t: Tensor | float | None) -> float | None:
    """A threshold as one number for reports: the largest finite one of a
    per-neuron tensor (over this rank's neurons; a neuron behind the gate has
    an infinite one), the float itself, or None."""
    if isinstance(t, Tensor):
        t = t[torch.isfinite(t)]
        return float(t.max()) if t.numel() else None
    return None if t is None else float(t)
