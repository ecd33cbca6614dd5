"""Toy models for examples and tests: tiny random-weight causal LMs of each
supported architecture (built from a config, nothing downloaded) and a byte
tokenizer with the chat-template interface the trainer uses."""

from __future__ import annotations

import torch

TOY_ARCHS = ("llama", "qwen2_moe", "mixtral")


def toy_model(arch: str = "llama", *, layers: int = 4, hidden: int = 32, vocab: int = 260, seed: int = 0):
    """A tiny random causal LM (eval mode, every parameter frozen)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2MoeConfig

    if hidden % 8:
        raise ValueError(f"hidden must be a multiple of 8 (4 heads of even size), got {hidden}")
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Large enough that a tiny model can express confident predictions
        # (with 0.02, logits stay within +-1 and no loss falls below ~ln V - 1).
        initializer_range=0.2,
    )
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=True)
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(
            **common,
            moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden,
            num_experts=4,
            num_experts_per_tok=2,
        )
    elif arch == "mixtral":
        config = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    else:
        raise ValueError(f"arch must be one of {TOY_ARCHS}, got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 4..259) with 0 = pad, 1 = user turn,
    2 = end of turn (eos), 3 = assistant turn; enough of the Hugging Face
    tokenizer interface for the trainer and greedy generation."""

    pad_token_id = 0
    eos_token_id = 2
    vocab_size = 260

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"\x01{m['content']}\x02" for m in messages)
        return text + ("\x03" if add_generation_prompt else "")

    def __call__(self, text: str, add_special_tokens: bool = False):
        ids = []
        for ch in text:
            if ch in "\x01\x02\x03":
                ids.append(ord(ch))
            else:
                ids.extend(4 + b for b in ch.encode("utf-8"))
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        data = bytes(i - 4 for i in ids if i >= 4)
        return data.decode("utf-8", errors="replace")
