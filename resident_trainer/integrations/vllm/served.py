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
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from resident_trainer.models.vllm import ffn_module
from resident_trainer.ops.added_expert import added_expert


class ServedBlock(nn.Module):
    """Published weights of the added block, whole: ``gate_up`` (2A, D), gate
    rows first, ``down`` (D, A), and ``threshold`` (A,), each neuron's gate
    threshold (-inf: no gate). All zero at first, so it adds exactly nothing."""

    def __init__(self, hidden_size: int, num_neurons: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.num_neurons = num_neurons
        self.register_buffer("gate_up", torch.zeros(2 * num_neurons, hidden_size, **kw))
        self.register_buffer("down", torch.zeros(hidden_size, num_neurons, **kw))
        self.register_buffer("threshold", torch.full((num_neurons,), float("-inf"), dtype=torch.float32, device=device))
        self.version = "zero"
        self.zero = True  # nothing published yet: the block adds exactly nothing

    def delta(self, x: Tensor) -> Tensor:
        """The block's output for the feed-forward input x (..., D)."""
        margin = ((x @ self.gate_up[: self.num_neurons].T).float() - self.threshold).amax(-1)
        return added_expert(x, self.gate_up, None, self.down, token_mask=margin > 0)

    def hook(self, module: nn.Module, inputs, output):
        # Eager serving skips a block that is still all zero. A compiled
        # graph always holds the block (it is traced before anything is
        # published, and its buffers change in place later).
        if self.zero and not torch.compiler.is_compiling():
            return output
        return output + self.delta(inputs[0]).to(output.dtype)

    @torch.no_grad()
    def load(self, gate_up: Tensor, down: Tensor, threshold: Tensor | float | None, version: str) -> None:
        """Serve these weights from the next forward on (in place). threshold:
        (A,) per neuron, one float for all, or None (no gate)."""
        self.gate_up.copy_(gate_up)
        self.down.copy_(down)
        if isinstance(threshold, Tensor):
            self.threshold.copy_(threshold)
        else:
            self.threshold.fill_(float("-inf") if threshold is None else float(threshold))
        self.version = version
        self.zero = not bool(self.down.any())

    def extra_repr(self) -> str:
        return f"num_neurons={self.num_neurons}, version={self.version}"


def install_served_block(model: nn.Module, settings: dict) -> ServedBlock:
    """Attach a zero ServedBlock to the feed-forward module of layer
    ``settings["layer"]`` (None: the default layer, num_layers // 5) of a loaded vLLM model; it
    is kept as ``model.rt_served`` (and ``model.rt_served_layer``)."""
    from resident_trainer.models.adapter import layer_index

    layers = model.model.layers
    layer = layer_index(settings.get("layer"), len(layers), "resident_trainer layer")
    ffn = ffn_module(layers[layer])
    ref = next(model.parameters())
    block = ServedBlock(int(model.config.hidden_size), int(settings["num_neurons"]), dtype=ref.dtype, device=ref.device)
    ffn.register_forward_hook(block.hook)
    # Not a submodule: vLLM's weight loading and state dicts never see it.
    object.__setattr__(model, "rt_served", block)
    object.__setattr__(model, "rt_served_layer", layer)
    return block
