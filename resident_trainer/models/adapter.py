"""A Hugging Face decoder-only causal LM seen as the pieces the trainer needs.

Works for Llama (SmolLM2), Qwen2-MoE and Mixtral, and any model with the same
layout: ``model.model.{embed_tokens, layers, norm, rotary_emb}`` and
``model.lm_head``, each decoder layer computing
``h + mlp(post_attention_layernorm(h + attn(input_layernorm(h))))``. The
adapter only holds references: no weight is copied, and nothing in
transformers is patched (the added block attaches to one layer's ``mlp``
instance through a forward hook).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def layer_index(layer: int | None, num_layers: int, name: str = "layer") -> int:
    """The layer a setting names in a model of `num_layers` layers: None is the
    default layer, a fifth of the way in (num_layers // 5: 6 of SmolLM2's 30,
    chosen by measurement there: docs/RESULTS.md); anything outside
    [0, num_layers) is an error naming `name` (never clamped: a setting meant
    for a deeper model should not silently land somewhere else)."""
    if layer is None:
        return num_layers // 5
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < num_layers:
        raise ValueError(f"{name} must be in [0, {num_layers}) for this model of {num_layers} layers, got {layer!r}")
    return layer


@dataclass
class LayerContext:
    """What every decoder layer call needs besides the hidden states."""

    attention_mask: Tensor | None
    position_embeddings: tuple[Tensor, Tensor]
    position_ids: Tensor
    past: PrefixKV | None = None  # a shared prefix's keys and values, attended to first


class PrefixKV:
    """Every layer's attention keys and values over a prefix all rows of a
    batch share (a chat template's system turn): computed once, then every
    layer call attends to them before the row's own tokens, as if the prefix
    were in front of each row. Duck-types the one cache method decoder
    attention calls (``update``) and never grows: replaying a layer gives the
    same keys as its first pass."""

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.length = 0
        self.recording = True

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if self.recording:
            self.keys[layer_idx], self.values[layer_idx] = key_states.detach(), value_states.detach()
            return key_states, value_states
        b = key_states.shape[0]
        k = self.keys[layer_idx].expand(b, -1, -1, -1)
        v = self.values[layer_idx].expand(b, -1, -1, -1)
        return torch.cat([k, key_states], dim=2), torch.cat([v, value_states], dim=2)


class DecoderAdapter:
    """embed, layers (with their call context), final norm and vocabulary head
    of a causal LM, by reference."""

    def __init__(self, model: nn.Module):
        inner = getattr(model, "model", None)
        missing = [
            name
            for name, obj in (
                ("model.model", inner),
                ("model.lm_head", getattr(model, "lm_head", None)),
                ("model.model.embed_tokens", getattr(inner, "embed_tokens", None)),
                ("model.model.layers", getattr(inner, "layers", None)),
                ("model.model.norm", getattr(inner, "norm", None)),
                ("model.model.rotary_emb", getattr(inner, "rotary_emb", None)),
            )
            if obj is None
        ]
        if missing:
            raise TypeError(
                f"model ({type(model).__name__}) does not have the decoder layout the adapter needs: missing {missing}"
            )
        for i, layer in enumerate(inner.layers):
            if not hasattr(layer, "mlp") or not hasattr(layer, "post_attention_layernorm"):
                raise TypeError(
                    f"model.model.layers[{i}] ({type(layer).__name__}) has no mlp / post_attention_layernorm"
                )
        self.model = model
        self.config = model.config
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.embed.weight.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def head_weight(self) -> Tensor:
        """The model's own (V, D) head weight (the embedding, when tied)."""
        return self.lm_head.weight

    @property
    def head_bias(self) -> Tensor | None:
        return self.lm_head.bias

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def ffn(self, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward block (on MoE models the sparse block,
        which holds the shared expert); its input is the normalized hidden."""
        return self.layers[self.layer_index(layer)].mlp

    def layer_index(self, layer: int | None, name: str = "layer") -> int:
        """`layer` checked against this model (None: the default layer, num_layers // 5)."""
        return layer_index(layer, self.num_layers, name)

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        return self.embed(input_ids)

    # The trainer may keep a shared prefix's keys and values (PrefixKV).
    supports_prefix_kv = True

    @torch.no_grad()
    def prefix_kv(self, ids: list[int]) -> PrefixKV:
        """Every layer's keys and values over the token ids `ids` (whatever
        is attached to the layers runs too: detach or disable it first)."""
        kv = PrefixKV()
        h = self.embed_tokens(torch.tensor([ids], device=self.device))
        ctx = self.context(h)
        ctx.past = kv
        for i in range(self.num_layers):
            h = self.run_layer(i, h, ctx)
        kv.length, kv.recording = len(ids), False
        return kv

    #: context() takes segments: several examples packed into one row.
    supports_packing = True

    def context(
        self,
        hidden: Tensor,
        attention_mask: Tensor | None = None,
        prefix: PrefixKV | None = None,
        segments: Tensor | None = None,
    ) -> LayerContext:
        """Causal mask, rotary embeddings and positions for a (B, T, D) batch.
        attention_mask: optional (B, T) 1/0 padding mask. prefix: the batch's
        rows continue this shared prefix (positions start after it, and
        every token also attends to all of it). segments: (B, T) ids of the
        examples packed into each row, each a contiguous run: a token attends
        only to its own example's earlier tokens (and the prefix), and
        positions restart with every example."""
        from transformers.masking_utils import create_causal_mask

        b, t = hidden.shape[:2]
        if prefix is not None or segments is not None:
            dev = hidden.device
            p = prefix.length if prefix is not None else 0
            steps = torch.arange(t, device=dev)
            allowed = torch.ones(t, t, dtype=torch.bool, device=dev).tril().unsqueeze(0).expand(b, t, t)
            if segments is None:
                position_ids = (p + steps).unsqueeze(0).expand(b, t)
            else:
                first = torch.ones(b, t, dtype=torch.bool, device=dev)
                first[:, 1:] = segments[:, 1:] != segments[:, :-1]
                start = torch.where(first, steps, 0).cummax(dim=1).values
                position_ids = p + steps - start
                allowed = allowed & (segments[:, :, None] == segments[:, None, :])
            if attention_mask is not None:
                allowed = allowed & attention_mask.bool()[:, None, :]
            if p:
                allowed = torch.cat([torch.ones(b, t, p, dtype=torch.bool, device=dev), allowed], dim=2)
            mask = allowed[:, None]
            if getattr(self.config, "_attn_implementation", "sdpa") != "sdpa":
                mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=dev).masked_fill(
                    ~mask, torch.finfo(hidden.dtype).min
                )
            return LayerContext(mask, self.rotary(hidden, position_ids=position_ids), position_ids, prefix)
        position_ids = torch.arange(t, device=hidden.device).unsqueeze(0).expand(b, t)
        # The cache argument is positional: transformers 5.19 calls it
        # past_key_values, later releases cache.
        mask = create_causal_mask(self.config, hidden, attention_mask, None, position_ids=position_ids)
        return LayerContext(mask, self.rotary(hidden, position_ids=position_ids), position_ids)

    def run_layer(self, layer: int, hidden: Tensor, ctx: LayerContext) -> Tensor:
        kw = {} if ctx.past is None else {"past_key_values": ctx.past}
        out = self.layers[layer](
            hidden,
            attention_mask=ctx.attention_mask,
            position_embeddings=ctx.position_embeddings,
            position_ids=ctx.position_ids,
            **kw,
        )
        # Older transformers return a tuple from decoder layers.
        return out[0] if isinstance(out, tuple) else out

    def frozen_tensors(self) -> dict[str, Tensor]:
        """Every parameter and buffer of the base model (tied tensors once)."""
        named = dict(self.model.named_parameters())
        named.update(self.model.named_buffers())
        return named
