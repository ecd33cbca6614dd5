"""The served block: what serving reads of the added neurons, on every
tensor-parallel rank.

Serving runs the whole block on every rank (its published weights are
replicated: 2A x D + D x A numbers, about 0.3% of SmolLM2-135M's work per token
at A = 256), so the served forward has no extra collective and sees exactly
what one process would. Training splits the neurons over the ranks
(`resident_trainer.train.AddedSharedNeurons` with the TP group); a publish
gathers the trained shards into these buffers, in place, on every rank in one
collective call, so every rank switches between the same two serving steps.

The buffers and the forward hook are installed by the plugin while vLLM loads
the model, before it is compiled; afterwards only the buffers' contents change.

Arming (`resident_trainer.train.Trainer.arm`) is state per sequence: a token
passes the gate only once its sequence, up to it, held a token that armed it.
vLLM runs many sequences' tokens in one flat batch and a sequence over many
steps, so the served block keeps one flag per KV cache slot beside the cache,
written for every token it computes (whether its sequence is armed up to it);
a sequence's next tokens read the flag of its token before them through the
step's block table. Like the keys and values it sits beside, the flag of a
slot is a function of the tokens up to it, so prefix caching shares it
correctly; a publish (after which the engine empties its prefix cache and
recomputes running requests) clears them. Eager serving only: a compiled graph
serves the gate alone (its trace holds no flags).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from resident_trainer.models.vllm import ffn_module
from resident_trainer.ops.added_expert import added_expert


class ServedBlock(nn.Module):
    """Published weights of the added block, whole: ``gate_up`` (2A, D), gate
    rows first, ``down`` (D, A), and ``threshold`` (A,), each neuron's gate
    threshold (-inf: no gate), and the arming's ``arming`` (A, D) rows and
    ``arming_threshold`` (A,) (inf: no row), fp32. All zero at first, so it
    adds exactly nothing."""

    def __init__(
        self,
        hidden_size: int,
        num_neurons: int,
        *,
        dtype: torch.dtype,
        device,
        block_size: int | None = None,
        attn_layer: str | None = None,
    ) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.num_neurons = num_neurons
        self.register_buffer("gate_up", torch.zeros(2 * num_neurons, hidden_size, **kw))
        self.register_buffer("down", torch.zeros(hidden_size, num_neurons, **kw))
        self.register_buffer("threshold", torch.full((num_neurons,), float("-inf"), dtype=torch.float32, device=device))
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("arming", torch.zeros(num_neurons, hidden_size, **f32))
        self.register_buffer("arming_threshold", torch.full((num_neurons,), float("inf"), **f32))
        self.arming_on = False
        # The KV cache's block size, and the attention layer whose metadata
        # gives each step's sequences (install_served_block).
        self.block_size, self.attn_layer = block_size, attn_layer
        self.flags = torch.zeros(0, dtype=torch.bool, device=device)  # per KV cache slot
        self.version = "zero"
        self.zero = True  # nothing published yet: the block adds exactly nothing

    def delta(self, x: Tensor) -> Tensor:
        """The block's output for the feed-forward input x (..., D)."""
        mask = ((x @ self.gate_up[: self.num_neurons].T).float() - self.threshold).amax(-1) > 0
        if self.arming_on and not torch.compiler.is_compiling():
            fired = (x.float() @ self.arming.T - self.arming_threshold).amax(-1) > 0
            mask = mask & self.sequence_armed(fired, _step_metadata(self.attn_layer))
        return added_expert(x, self.gate_up, None, self.down, token_mask=mask)

    @torch.no_grad()
    def sequence_armed(self, fired: Tensor, md) -> Tensor:
        """(N,) bool: whether each token's sequence is armed up to it, for
        the step's flat batch whose tokens `fired` (armed their sequence) and
        whose attention metadata `md` (``query_start_loc``, ``seq_lens``,
        ``block_table``, ``slot_mapping``) says which sequence and KV cache
        slot each token is; records each token's flag at its slot. Tokens past
        the metadata's (padding) are unarmed. md None (a warm-up run, no
        sequences): every token counts as armed."""
        if md is None:
            return torch.ones_like(fired)
        if self.block_size is None:
            raise RuntimeError("the served block's arming needs the KV cache's block size (install_served_block)")
        dev = fired.device
        # One entry per sequence (query_start_loc may run on for padding).
        qsl = md.query_start_loc[: md.seq_lens.numel() + 1].to(device=dev, dtype=torch.long)
        counts = qsl[1:] - qsl[:-1]
        n = int(qsl[-1])
        seqs = torch.arange(counts.numel(), device=dev)
        req = torch.repeat_interleave(seqs, counts)
        slots = md.slot_mapping[:n].to(device=dev, dtype=torch.long)
        # Within the step: armed once a token up to this one in its sequence fired.
        c = fired[:n].long().cumsum(0)
        c0 = torch.cat([c.new_zeros(1), c])[qsl[:-1]]  # fired tokens before each sequence's first
        within = (c - c0[req]) > 0
        # Before the step: the flag of the sequence's token before its first new one.
        bs = self.block_size
        table = md.block_table.to(device=dev, dtype=torch.long)
        first = md.seq_lens.to(device=dev, dtype=torch.long) - counts  # position of each first new token
        live = counts > 0
        at = table[seqs, (first // bs).clamp_max(table.shape[1] - 1)] * bs + first % bs
        if not bool((at[live] == slots[qsl[:-1][live]]).all()):
            raise RuntimeError(
                f"the served block's arming found the step's slots other than its block table gives at block size {bs}"
            )
        back = (first - 1).clamp_min(0)
        prev_slot = table[seqs, back // bs] * bs + back % bs
        top = int(torch.cat([slots, prev_slot]).max()) + 1 if n else 0
        if top > self.flags.numel():
            grown = torch.zeros(max(top, 2 * self.flags.numel()), dtype=torch.bool, device=dev)
            grown[: self.flags.numel()] = self.flags
            self.flags = grown
        before = self.flags[prev_slot] & (first > 0)
        armed = within | before[req]
        self.flags[slots] = armed
        out = torch.zeros_like(fired)
        out[:n] = armed
        return out

    def hook(self, module: nn.Module, inputs, output):
        # Eager serving skips a block that is still all zero. A compiled
        # graph always holds the block (it is traced before anything is
        # published, and its buffers change in place later).
        if self.zero and not torch.compiler.is_compiling():
            return output
        return output + self.delta(inputs[0]).to(output.dtype)

    @torch.no_grad()
    def load(
        self,
        gate_up: Tensor,
        down: Tensor,
        threshold: Tensor | float | None,
        version: str,
        *,
        arming: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        """Serve these weights from the next forward on (in place). threshold:
        (A,) per neuron, one float for all, or None (no gate). arming: (rows
        (A, D), thresholds (A,)), or None (none; AddedSharedNeurons.arming)."""
        self.gate_up.copy_(gate_up)
        self.down.copy_(down)
        if isinstance(threshold, Tensor):
            self.threshold.copy_(threshold)
        else:
            self.threshold.fill_(float("-inf") if threshold is None else float(threshold))
        if arming is not None:
            self.arming.copy_(arming[0])
            self.arming_threshold.copy_(arming[1])
        self.arming_on = arming is not None and threshold is not None
        # The engine recomputes what it had cached. A new tensor, not zero_():
        # the flags grow inside vLLM's inference mode, and an inference
        # tensor takes no in-place update outside it (a publish is outside).
        self.flags = torch.zeros(0, dtype=torch.bool, device=self.flags.device)
        self.version = version
        self.zero = not bool(self.down.any())

    def extra_repr(self) -> str:
        return f"num_neurons={self.num_neurons}, version={self.version}"


def _step_metadata(layer: str | None):
    """The running step's attention metadata for `layer` (any layer's where
    it has none), or None outside a step with sequences (warm-up runs)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if not md:
        return None
    if isinstance(md, list):  # micro-batches: not served with arming
        raise RuntimeError("the served block's arming does not support micro-batched steps")
    return md.get(layer) or next(iter(md.values()))


def install_served_block(model: nn.Module, settings: dict, *, block_size: int | None = None) -> ServedBlock:
    """Attach a zero ServedBlock to the feed-forward module of layer
    ``settings["layer"]`` (None: the default layer, num_layers // 5) of a loaded vLLM model; it
    is kept as ``model.rt_served`` (and ``model.rt_served_layer``). block_size:
    the KV cache's block size, for the arming flags."""
    from resident_trainer.models.adapter import layer_index

    layers = model.model.layers
    layer = layer_index(settings.get("layer"), len(layers), "resident_trainer layer")
    ffn = ffn_module(layers[layer])
    ref = next(model.parameters())
    attn = getattr(getattr(layers[layer], "self_attn", None), "attn", None)
    block = ServedBlock(
        int(model.config.hidden_size),
        int(settings["num_neurons"]),
        dtype=ref.dtype,
        device=ref.device,
        block_size=block_size,
        attn_layer=getattr(attn, "layer_name", None),
    )
    ffn.register_forward_hook(block.hook)
    # Not a submodule: vLLM's weight loading and state dicts never see it.
    object.__setattr__(model, "rt_served", block)
    object.__setattr__(model, "rt_served_layer", layer)
    return block
