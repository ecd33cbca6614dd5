"""A Hugging Face model directory (config.json, model.safetensors, tokenizer)
from a model loaded in memory, optionally with attention heads padded so a
tensor-parallel server can split them.

vLLM serves a directory, not a GGUF file, and transformers refuses
``save_pretrained`` on a GGUF-loaded model, so the tensors and the config are
written here directly. Padding: SmolLM2 has 9 query heads in 3 key/value
groups, which 2 ranks cannot split; a copy with 12 query and 4 key/value
heads, the new heads' weights zero (their query rows, key and value rows, and
output-projection columns), computes the same function: the padded query
heads attend to zero values and their output columns are zero.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from resident_trainer._files import write_atomic


def _pad_rows(w: torch.Tensor, heads: int, new_heads: int, head_dim: int) -> torch.Tensor:
    out = w.new_zeros((new_heads * head_dim, *w.shape[1:]))
    out[: heads * head_dim] = w
    return out


def padded_heads(num_heads: int, num_kv_heads: int, world: int) -> tuple[int, int]:
    """The smallest (query heads, key/value heads) >= the model's that `world`
    ranks can split while keeping each query head's key/value group: the
    group size stays num_heads / num_kv_heads, key/value heads grow to a
    multiple of `world`."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    kv = -(-num_kv_heads // world) * world
    return kv * group, kv


def export_hf_dir(model, tokenizer, out_dir: str | os.PathLike, *, tp: int = 1) -> Path:
    """Write `model` (a Hugging Face Llama-layout causal LM) and `tokenizer`
    to `out_dir` as a directory any Hugging Face-compatible server loads; with
    `tp` > 1, attention heads are zero-padded (see the module docstring) so
    `tp` ranks can split them. Tied embeddings are written once. Returns the
    directory."""
    from safetensors.torch import save

    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    new_heads, new_kv = padded_heads(heads, kv_heads, tp)
    tensors = {}
    for name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach().contiguous()
        if new_heads != heads:
            if name.endswith("self_attn.q_proj.weight"):
                t = _pad_rows(t, heads, new_heads, head_dim)
            elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                t = _pad_rows(t, kv_heads, new_kv, head_dim)
            elif name.endswith("self_attn.o_proj.weight"):
                t = _pad_rows(t.T.contiguous(), heads, new_heads, head_dim).T.contiguous()
        tensors[name] = t.cpu()
    write_atomic(out / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    config = cfg.to_dict()
    config.update(num_attention_heads=new_heads, num_key_value_heads=new_kv, head_dim=head_dim)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    # The in-memory model is dequantized: nothing of the GGUF source remains.
    for key in ("dtype", "quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    write_atomic(out / "config.json", json.dumps(config, indent=2, sort_keys=True).encode())
    tokenizer.save_pretrained(out)
    return out
