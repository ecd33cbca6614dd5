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


def kept(module: nn.Module, name: str = "weight") -> Tensor:
    """The plain tensor ``name`` of a vLLM module as it was loaded: the
    reference the plugin kept (``rt_<name>``) when vLLM repacked it for the
    CPU, else the module's own parameter."""
    t = getattr(module, f"rt_{name}", None)
    if t is None:
        t = getattr(module, name)
    if t.numel() == 0:
        raise RuntimeError(
            f"{type(module).__name__}.{name} has no plain tensor left (vLLM packed it for the CPU and dropped it); "
            "serve with the resident_trainer plugin enabled so it keeps a reference"
        )
    return t


def linear_weight(layer: nn.Module) -> Tensor:
    """The plain (out, in) weight of a vLLM linear layer."""
    return kept(layer, "weight")


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


# vLLM class names of the decoder layouts this adapter recomputes, and the
# attribute of each one's feed-forward block where it is not ``mlp``.
DENSE_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")
MOE_LAYERS = ("Qwen2MoeDecoderLayer", "MixtralDecoderLayer")
SUPPORTED_LAYERS = DENSE_LAYERS + MOE_LAYERS
FFN_ATTRIBUTE = {"MixtralDecoderLayer": "block_sparse_moe"}


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


class MoEFFN(nn.Module):
    """A top-k mixture of SwiGLU experts (vLLM's fused MoE, each expert's
    intermediate dimension split over the ranks) with Qwen2-MoE's optional
    gated shared expert, recomputed from the shards. Routing as Hugging Face
    and vLLM do it for these models: softmax over the router logits in fp32,
    the top k, renormalised when the model says so."""

    def __init__(self, block: nn.Module, group) -> None:
        super().__init__()
        experts = getattr(block.experts, "routed_experts", block.experts)
        unsupported = {
            "scoring_func": getattr(experts, "scoring_func", "softmax") != "softmax",
            "use_grouped_topk": bool(getattr(experts, "use_grouped_topk", False)),
            "e_score_correction_bias": getattr(experts, "e_score_correction_bias", None) is not None,
            "custom_routing_function": getattr(experts, "custom_routing_function", None) is not None,
            "apply_router_weight_on_input": bool(getattr(experts, "apply_router_weight_on_input", False)),
            "routed_scaling_factor": float(getattr(experts, "routed_scaling_factor", 1.0)) != 1.0,
            "expert parallelism": int(experts.local_num_experts) != int(experts.global_num_experts),
            "biased experts": getattr(experts, "w13_bias", None) is not None,
        }
        bad = sorted(k for k, v in unsupported.items() if v)
        if bad:
            raise TypeError(f"{experts.layer_name}: MoE routing with {bad} is not supported by the vLLM adapter")
        act = str(getattr(experts, "activation", "silu")).lower()
        if "silu" not in act:
            raise TypeError(f"{experts.layer_name}: expert activation {act} is not supported (SwiGLU only)")
        self.block, self.experts, self.group = block, experts, group
        self.top_k, self.renormalize = int(experts.top_k), bool(experts.renormalize)
        self.inter = int(experts.intermediate_size_per_partition)
        self.shared = getattr(block, "shared_expert", None)
        self.shared_gate = getattr(block, "shared_expert_gate", None) if self.shared is not None else None

    def expert_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's (gate (E, I, D), up (E, I, D), down (E, D, I)) views
        of the loaded expert weights, without vLLM's CPU padding."""
        w13, w2 = kept(self.experts, "w13_weight"), kept(self.experts, "w2_weight")
        i, half = self.inter, w13.shape[1] // 2
        return w13[:, :i], w13[:, half : half + i], w2[:, :, :i]

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.group is not None:
            x = copy_to_ranks(x, self.group)
        logits = F.linear(x, linear_weight(self.block.gate))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        gate, up, down = self.expert_weights()
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            tok, pos = torch.where(chosen == e)
            xe = x[tok]
            h = F.silu(F.linear(xe, gate[e])) * F.linear(xe, up[e])
            out = out.index_add(0, tok, F.linear(h, down[e]) * weights[tok, pos, None])
        if self.shared is not None:
            gu = F.linear(x, linear_weight(self.shared.gate_up_proj))
            g, u = gu.chunk(2, dim=-1)
            sh = F.linear(F.silu(g) * u, linear_weight(self.shared.down_proj))
            if self.shared_gate is not None:
                sh = torch.sigmoid(F.linear(x, linear_weight(self.shared_gate))) * sh
            out = out + sh
        if self.group is not None:
            out = sum_over_ranks(out, self.group)
        return out.reshape(shape)


def ffn_module(layer: nn.Module) -> nn.Module:
    """The feed-forward module of a vLLM decoder layer (its output, already
    reduced over the TP ranks, is added to the residual stream): Mixtral's is
    ``block_sparse_moe``, the others' ``mlp``."""
    return getattr(layer, FFN_ATTRIBUTE.get(type(layer).__name__, "mlp"))


def ffn_recompute(layer: nn.Module, group) -> nn.Module:
    """The functional recomputation of a decoder layer's feed-forward block."""
    module = ffn_module(layer)
    return MoEFFN(module, group) if hasattr(module, "experts") else DenseFFN(module, group)


@dataclass
class VllmLayerContext(LayerContext):
    """The layer context: an SDPA boolean mask (B, 1, T, T) that is causal and
    hides right padding, and the positions."""


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
        kinds = sorted({type(layer).__name__ for layer in layers} - set(SUPPORTED_LAYERS))
        if kinds:
            raise TypeError(
                f"decoder layers {kinds} are not supported by the vLLM adapter (supported: {SUPPORTED_LAYERS})"
            )
        self.model = model
        self.config = model.config
        self.group = group if world > 1 else None
        self.rank, self.world = rank, world
        self.embed = inner.embed_tokens
        self.layers = layers
        self.final_norm = inner.norm
        self.lm_head = model.lm_head
        self._attn = [_Attention(layer.self_attn, self.group) for layer in layers]
        self._ffn = nn.ModuleList(ffn_recompute(layer, self.group) for layer in layers)
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
        parameter name; the CPU-packed ones by their kept plain tensors."""
        out: dict[str, Tensor] = {}
        for name, module in self.model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name else pname
                plain = getattr(module, f"rt_{pname}", None)
                if plain is not None:
                    out[full] = plain
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


def _dense_pieces(out: CheckpointPieces, prefix: str, mlp: nn.Module, rank: int, world: int) -> None:
    """A SwiGLU MLP's shards: gate_up_proj rows are slices of gate_proj and
    up_proj, down_proj is a column shard."""
    gu = linear_weight(mlp.gate_up_proj)
    inter = gu.shape[0] // 2
    g, u = gu.split([inter, inter], dim=0)
    for name, part in (("gate_proj", g), ("up_proj", u)):
        out.add(f"{prefix}.{name}.weight", (inter * world, gu.shape[1]), gu.dtype, [_row_piece(part, rank * inter)])
    w = linear_weight(mlp.down_proj)
    out.add(f"{prefix}.down_proj.weight", (w.shape[0], w.shape[1] * world), w.dtype,
            _column_pieces(w, rank * w.shape[1], w.shape[1] * world))  # fmt: skip


def _moe_pieces(out: CheckpointPieces, prefix: str, ffn: MoEFFN, rank: int, world: int) -> None:
    """A mixture's shards as the per-expert checkpoint tensors
    (``experts.{e}.{gate,up,down}`` under the model's checkpoint names:
    gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2): each expert's gate and
    up rows and down columns are this rank's slice of its intermediate
    dimension; the router (and the shared expert's gate) are replicated."""
    lead = rank == 0
    for name, module in (("gate", ffn.block.gate), ("shared_expert_gate", ffn.shared_gate)):
        if module is not None:
            w = linear_weight(module)
            out.add(f"{prefix}.{name}.weight", w.shape, w.dtype, [(w, 0)] if lead else [])
    if ffn.shared is not None:
        _dense_pieces(out, f"{prefix}.shared_expert", ffn.shared, rank, world)
    ex = ffn.experts
    names = [getattr(ex, f"ckpt_{k}_proj_name", f"{k}_proj") for k in ("gate", "up", "down")]
    gate, up, down = ffn.expert_weights()
    inter, hidden = ffn.inter, gate.shape[2]
    total = inter * world
    for e in range(gate.shape[0]):
        for name, part in ((names[0], gate[e]), (names[1], up[e])):
            out.add(
                f"{prefix}.experts.{e}.{name}.weight", (total, hidden), part.dtype, [_row_piece(part, rank * inter)]
            )
        out.add(f"{prefix}.experts.{e}.{names[2]}.weight", (hidden, total), down.dtype,
                _column_pieces(down[e], rank * inter, total))  # fmt: skip


def checkpoint_pieces(adapter: VllmAdapter) -> CheckpointPieces:
    """Map this rank's shards of a vLLM model to the Hugging Face checkpoint
    tensors they are slices of: qkv_proj rows are slices of
    q_proj/k_proj/v_proj, gate_up_proj rows of gate_proj/up_proj, o_proj and
    down_proj are column shards, MoE experts as `_moe_pieces`, the vocabulary
    shards are rows (their padding rows excluded), norms are replicated."""
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
        ffn_name = FFN_ATTRIBUTE.get(type(layer).__name__, "mlp")
        ffn = adapter._ffn[i]
        if isinstance(ffn, MoEFFN):
            _moe_pieces(out, f"{p}.{ffn_name}", ffn, rank, world)
        else:
            _dense_pieces(out, f"{p}.{ffn_name}", getattr(layer, ffn_name), rank, world)
        for name in ("input_layernorm", "post_attention_layernorm"):
            w = getattr(layer, name).weight
            out.add(f"{p}.{name}.weight", w.shape, w.dtype, [(w, 0)] if lead else [])
    return out
