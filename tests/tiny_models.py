"""Tiny random-weight causal LMs of each supported architecture (no download)."""

import torch


def tiny_model(arch: str, layers: int = 4, seed: int = 0, vocab: int = 97):
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2MoeConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=True)
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(
            **common, moe_intermediate_size=16, shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2
        )
    elif arch == "mixtral":
        config = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


ARCHS = ["llama", "qwen2_moe", "mixtral"]
