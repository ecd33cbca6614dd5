"""A model served by vLLM, seen from inside one of its tensor-parallel
workers as the pieces the trainer needs: the same interface as
`DecoderAdapter` (embed, layers with their context, final norm, the
vocabulary-head shard, the frozen tensors), over vLLM's sharded modules.

vLLM's own layer forward needs its forward context and paged KV cache, and its
RMSNorm and rotary kernels work in place, so a training step recomputes each
layer functionally, in plain torch, from the layer's sharded weights (by
reference: nothing is copied):

    x = rmsnorm(h)                      input_layernorm
    q, k, v = split(x @ W_qkv^T)        this rank's heads (qkv_proj: q rows, k rows, v rows)
    q, k = rotary(q, k)                 from rotary_emb.cos_sin_cache (neox style)
    a = sdpa(q, k, v, GQA, causal + padding mask, scale = attn.scaling)
    h = h + allreduce(a @ W_o^T)        o_proj: a column shard
    h = h + ffn(rmsnorm(h))             gate_up_proj/down_proj (or the MoE block), all-reduced

with Megatron's differentiable collectives on the TP group (identity forward,
all-reduce backward on the replicated input; all-reduce forward, identity
backward on the partial output). The feed-forward part is a small module,
`ffn(layer)`, so an added block attaches to it with a forward hook exactly as
on a Hugging Face model. The hidden state is the whole residual stream (vLLM
keeps hidden state and residual apart; their sum is this).

On the CPU vLLM repacks linear weights for oneDNN and drops the plain ones;
the serving plugin (resident_trainer.integrations.vllm.plugin) keeps a
reference to each plain weight as ``layer.rt_weight`` before that, and this
adapter reads it (on GPUs ``layer.weight`` stays and is used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from resident_trainer.models.adapter import LayerContext, layer_index
from resident_trainer.ops.collectives import copy_to_ranks, sum_over_ranks


def linear_weight(layer: nn.Module) -> Tensor:
    """The plain (out, in) weight of a vLLM linear layer: the reference the
    plugin kept before CPU packing, else the layer's own parameter."""
    w = getattr(layer, "rt_weight", None)
    if w is None:
        w = layer.weight
    if w.numel() == 0:
        raise RuntimeError(
            f"{type(layer).__name__} has no plain weight left (vLLM packed it for the CPU and dropped it); "
            "serve with the resident_trainer plugin enabled so it keeps a reference"
        )
    return w


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, round, scale."""
    h = x.float()
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox-style rotary on the leading rotary_dim of the head dimension;
    x: (B, H, T, hd), cos/sin: (B, 1, T, rotary_dim / 2)."""
    rot = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out


class _Attention:
    """One layer's self-attention, recomputed from its sharded weights."""

    def __init__(self, attn: nn.Module, group) -> None:
        self.qkv = attn.qkv_proj
        self.o = attn.o_proj
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.rotary = attn.rotary_emb
        self.group = group

    def __call__(self, x: Tensor, ctx: VllmLayerContext) -> Tensor:
        b, t, _ = x.shape
        if self.group is not None:
            x = copy_to_ranks(x, self.group)
        qkv = F.linear(x, linear_weight(self.qkv), self.qkv.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        hd = self.head_dim
        q = q.view(b, t, -1, hd).transpose(1, 2)
        k = k.view(b, t, -1, hd).transpose(1, 2)
        v = v.view(b, t, -1, hd).transpose(1, 2)
        cos_sin = self.rotary.cos_sin_cache.index_select(0, ctx.position_ids.reshape(-1)).to(q.dtype)
        cos, sin = cos_sin.view(b, t, -1).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=ctx.attention_mask, scale=self.scaling, enable_gqa=q.shape[1] != k.shape[1]
        )
        a = a.transpose(1, 2).reshape(b, t, -1)
        out = F.linear(a, linear_weight(self.o))
        if self.group is not None:
            out = sum_over_ranks(out, self.group)
        if self.o.bias is not None:
            out = out + self.o.bias
        return out


class DenseFFN(nn.Module):
    """A SwiGLU MLP (gate_up_proj + down_proj) recomputed from its shards: the
    module an added block hooks onto; its input is the normalized hidden."""

    def __init__(self, mlp: nn.Module, group) -> None:
        super().__init__()
        self.gate_up, self.down = mlp.gate_up_proj, mlp.down_proj
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        if self.group is not None:
            x = copy_to_ranks(x, self.group)
        gu = F.linear(x, linear_weight(self.gate_up), self.gate_up.bias)
        g, u = gu.chunk(2, dim=-1)
        out = F.linear(F.silu(g) * u, linear_weight(self.down))
        if self.group is not None:
            out = sum_over_ranks(out, self.group)
        if self.down.bias is not None:
            out = out + self.down.bias
        return out


@dataclass
class VllmLayerContext(LayerContext):
    """The layer context: an SDPA boolean mask (B, 1, T, T) that is causal and
    hides right padding, and the positions."""


# vLLM class names of the decoder layouts this adapter recomputes.
DENSE_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")


class VllmAdapter:
    """embed, layers, final norm and vocabulary-head shard of a vLLM model in
    one tensor-parallel worker, by reference.

    model: the worker's ``model_runner.model``; group: the TP group's
    torch.distributed process group (the device group: gloo on CPUs, NCCL on
    GPUs), or None at TP 1; rank, world: this worker's place in it."""

    def __init__(self, model: nn.Module, group=None, *, rank: int = 0, world: int = 1) -> None:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or not hasattr(model, "lm_head"):
            raise TypeError(f"{type(model).__name__} does not have the decoder layout (model.model.layers, lm_head)")
        kinds = sorted({type(layer).__name__ for layer in layers} - set(DENSE_LAYERS))
        if kinds:
            raise TypeError(f"decoder layers {kinds} are not supported by the vLLM adapter (supported: {DENSE_LAYERS})")
        self.model = model
        self.config = model.config
        self.group = group if world > 1 else None
        self.rank, self.world = rank, world
        self.embed = inner.embed_tokens
        self.layers = layers
        self.final_norm = inner.norm
        self.lm_head = model.lm_head
        self._attn = [_Attention(layer.self_attn, self.group) for layer in layers]
        self._ffn = nn.ModuleList(DenseFFN(layer.mlp, self.group) for layer in layers)
        self.eps = float(self.config.rms_norm_eps)

    # --- the DecoderAdapter interface -------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """The real (unpadded) vocabulary size."""
        return int(self.config.vocab_size)

    @property
    def vocab_shard(self) -> tuple[int, int]:
        """[start, stop) of the real vocabulary rows this rank's head holds
        (the rows past stop - start in its shard are vLLM's zero padding)."""
        ix = self.lm_head.shard_indices
        return int(ix.org_vocab_start_index), int(ix.org_vocab_end_index)

    @property
    def head_weight(self) -> Tensor:
        """This rank's real rows of the vocabulary head: a view (tied heads
        share the embedding's storage)."""
        start, stop = self.vocab_shard
        return self.lm_head.weight[: stop - start]

    @property
    def head_bias(self) -> Tensor | None:
        bias = getattr(self.lm_head, "bias", None)
        if bias is None:
            return None
        start, stop = self.vocab_shard
        return bias[: stop - start]

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def layer_index(self, layer: int | None, name: str = "layer") -> int:
        return layer_index(layer, self.num_layers, name)

    def ffn(self, layer: int) -> nn.Module:
        """The feed-forward module of layer `layer` as the replay runs it."""
        return self._ffn[self.layer_index(layer)]

    def norm(self, hidden: Tensor) -> Tensor:
        return rms_norm(hidden, self.final_norm.weight, self.eps)

    @torch.no_grad()
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """Token embeddings (the prefix runs without grad): each rank looks up
        the ids in its rows, and the ranks sum."""
        w = self.embed.weight
        ix = self.embed.shard_indices
        start, stop = int(ix.org_vocab_start_index), int(ix.org_vocab_end_index)
        mine = (input_ids >= start) & (input_ids < stop)
        out = F.embedding(torch.where(mine, input_ids - start, 0), w) * mine.unsqueeze(-1).to(w.dtype)
        if self.group is not None:
            torch.distributed.all_reduce(out, group=self.group)
        return out

    def context(self, hidden: Tensor, attention_mask: Tensor | None = None) -> VllmLayerContext:
        b, t = hidden.shape[:2]
        pos = torch.arange(t, device=hidden.device)
        allowed = pos[None, :] <= pos[:, None]  # (T query, T key): causal
        allowed = allowed.expand(b, 1, t, t)
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        return VllmLayerContext(allowed, (), pos.unsqueeze(0).expand(b, t))

    def run_layer(self, layer: int, hidden: Tensor, ctx: LayerContext) -> Tensor:
        vl = self.layers[layer]
        h = hidden + self._attn[layer](rms_norm(hidden, vl.input_layernorm.weight, self.eps), ctx)
        return h + self._ffn[layer](rms_norm(h, vl.post_attention_layernorm.weight, self.eps))

    def frozen_tensors(self) -> dict[str, Tensor]:
        """Every base tensor this rank's replay reads (its shards), by vLLM
        parameter name; the CPU-packed linears by their kept plain weights."""
        out: dict[str, Tensor] = {}
        for name, module in self.model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name else pname
                if pname == "weight" and getattr(module, "rt_weight", None) is not None:
                    out[full] = module.rt_weight
                elif p.numel():
                    out[full] = p
        # Tied heads: one tensor, first name (the embedding).
        seen: dict[int, str] = {}
        for name in list(out):
            key = out[name].data_ptr()
            if key in seen and out[name].shape == out[seen[key]].shape:
                del out[name]
            else:
                seen[key] = name
        return out


# --- the frozen base, as the checkpoint names it ------------------------------------


def _row_piece(t: Tensor, row0: int) -> tuple[Tensor, int]:
    """(t, element offset) of a block of whole rows starting at global row0."""
    row_elems = t[0].numel() if t.dim() > 1 else 1
    return t.contiguous(), row0 * row_elems


def _column_pieces(t: Tensor, col0: int, cols: int) -> list[tuple[Tensor, int]]:
    """The rows of a (R, c) column shard of a (R, cols) tensor, each at its
    global offset ``r * cols + col0``."""
    t = t.contiguous()
    return [(row, r * cols + col0) for r, row in enumerate(t.unbind(0))]


class CheckpointPieces:
    """What this rank holds of each checkpoint tensor: name -> (global shape,
    dtype, [(piece, element offset)]). Pieces of all ranks tile each tensor
    exactly once (replicated tensors come from rank 0 only); every rank has
    the same names, so their lane sums reduce name by name."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[Tensor, int]]]] = {}

    def add(self, name: str, shape, dtype: torch.dtype, pieces: list[tuple[Tensor, int]]) -> None:
        entry = self.tensors.setdefault(name, (tuple(int(s) for s in shape), dtype, []))
        entry[2].extend(pieces)


def checkpoint_pieces(adapter: VllmAdapter) -> CheckpointPieces:
    """Map this rank's shards of a dense (Llama-layout) vLLM model to the
    Hugging Face checkpoint tensors they are slices of: qkv_proj rows are
    slices of q_proj/k_proj/v_proj, gate_up_proj rows of gate_proj/up_proj,
    o_proj and down_proj are column shards, the vocabulary shards are rows
    (their padding rows excluded), norms are replicated."""
    out = CheckpointPieces()
    rank, world = adapter.rank, adapter.world
    lead = rank == 0

    def vocab(name: str, module: nn.Module) -> None:
        ix = module.shard_indices
        start, stop = int(ix.org_vocab_start_index), int(ix.org_vocab_end_index)
        w = module.weight
        out.add(
            name,
            (adapter.vocab_size, w.shape[1]),
            w.dtype,
            [_row_piece(w[: stop - start], start)] if stop > start else [],
        )

    vocab("model.embed_tokens.weight", adapter.embed)
    if not getattr(adapter.config, "tie_word_embeddings", False):
        vocab("lm_head.weight", adapter.lm_head)
    w = adapter.final_norm.weight
    out.add("model.norm.weight", w.shape, w.dtype, [(w, 0)] if lead else [])
    for i, layer in enumerate(adapter.layers):
        p = f"model.layers.{i}"
        attn = layer.self_attn
        hd = attn.head_dim
        q_rows, kv_rows = attn.q_size, attn.kv_size
        total_q, total_kv = attn.total_num_heads * hd, attn.total_num_kv_heads * hd
        # Key/value heads split over the ranks, or replicated over groups of
        # ranks when there are fewer heads than ranks (one rank per group reports).
        kv_share = max(1, world // attn.total_num_kv_heads)
        kv_index, kv_lead = rank // kv_share, rank % kv_share == 0
        for kind, t in (("weight", linear_weight(attn.qkv_proj)), ("bias", attn.qkv_proj.bias)):
            if t is None:
                continue
            q, k, v = t.split([q_rows, kv_rows, kv_rows], dim=0)
            tail = tuple(t.shape[1:])
            out.add(f"{p}.self_attn.q_proj.{kind}", (total_q, *tail), t.dtype, [_row_piece(q, rank * q_rows)])
            for name, part in (("k_proj", k), ("v_proj", v)):
                pieces = [_row_piece(part, kv_index * kv_rows)] if kv_lead else []
                out.add(f"{p}.self_attn.{name}.{kind}", (total_kv, *tail), t.dtype, pieces)
        w = linear_weight(attn.o_proj)
        out.add(
            f"{p}.self_attn.o_proj.weight",
            (w.shape[0], total_q),
            w.dtype,
            _column_pieces(w, rank * w.shape[1], total_q),
        )
        mlp = layer.mlp
        gu = linear_weight(mlp.gate_up_proj)
        inter = gu.shape[0] // 2
        g, u = gu.split([inter, inter], dim=0)
        for name, part in (("gate_proj", g), ("up_proj", u)):
            out.add(f"{p}.mlp.{name}.weight", (inter * world, gu.shape[1]), gu.dtype, [_row_piece(part, rank * inter)])
        w = linear_weight(mlp.down_proj)
        out.add(f"{p}.mlp.down_proj.weight", (w.shape[0], w.shape[1] * world), w.dtype,
                _column_pieces(w, rank * w.shape[1], w.shape[1] * world))  # fmt: skip
        for name in ("input_layernorm", "post_attention_layernorm"):
            w = getattr(layer, name).weight
            out.add(f"{p}.{name}.weight", w.shape, w.dtype, [(w, 0)] if lead else [])
    return out
