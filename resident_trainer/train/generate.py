"""Greedy generation through the model (attached blocks serve their
published weights), and the anchors made from the base model's own replies."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from resident_trainer.train.data import ANCHOR_PROMPTS, chat_prompt_ids


@torch.no_grad()
def generate_greedy_ids(model, tokenizer, question: str, max_new_tokens: int = 24) -> list[int]:
    """Token ids of the model's greedy chat reply to `question` (attached
    blocks serve their published weights); ends with the end-of-turn token
    when the model produced it."""
    ids = torch.tensor([chat_prompt_ids(tokenizer, question)], device=next(model.parameters()).device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return out[0, ids.shape[1] :].tolist()


def generate_greedy(model, tokenizer, question: str, max_new_tokens: int = 24) -> str:
    """The model's greedy chat reply to `question`, as text."""
    return tokenizer.decode(generate_greedy_ids(model, tokenizer, question, max_new_tokens), skip_special_tokens=True)


def make_anchors(
    model, tokenizer, prompts: Sequence[str] = ANCHOR_PROMPTS, max_new_tokens: int = 32
) -> list[tuple[str, list[int]]]:
    """Anchor examples: each generic prompt with the base model's own greedy
    reply, as the token ids it generated (text would not always tokenize back
    to them). Generate these before any block is published."""
    return [(p, generate_greedy_ids(model, tokenizer, p, max_new_tokens)) for p in prompts]
