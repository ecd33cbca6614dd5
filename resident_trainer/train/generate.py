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


@torch.no_grad()
def generate_greedy_batch_ids(
    model, tokenizer, questions: Sequence[str], max_new_tokens: int = 24, *, batch_size: int = 32
) -> list[list[int]]:
    """`generate_greedy_ids` for many questions, `batch_size` at a time (left
    padded): on a CPU one token for 32 prompts costs about what one prompt's
    costs (each step reads every weight once)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # A row ends at the first end-of-turn token generate stops at (it pads
    # the rows that ended while others go on).
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = {tokenizer.eos_token_id} if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
    out: list[list[int]] = []
    for start in range(0, len(questions), batch_size):
        prompts = [chat_prompt_ids(tokenizer, q) for q in questions[start : start + batch_size]]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        for row in gen[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in eos), None)
            out.append(row if end is None else row[: end + 1])
    return out


def generate_greedy(model, tokenizer, question: str, max_new_tokens: int = 24) -> str:
    """The model's greedy chat reply to `question`, as text."""
    return tokenizer.decode(generate_greedy_ids(model, tokenizer, question, max_new_tokens), skip_special_tokens=True)


def generate_greedy_batch(model, tokenizer, questions: Sequence[str], max_new_tokens: int = 24) -> list[str]:
    """The greedy chat replies to `questions` as text (batched)."""
    ids = generate_greedy_batch_ids(model, tokenizer, questions, max_new_tokens)
    return [tokenizer.decode(r, skip_special_tokens=True) for r in ids]


def make_anchors(
    model, tokenizer, prompts: Sequence[str] = ANCHOR_PROMPTS, max_new_tokens: int = 32
) -> list[tuple[str, list[int]]]:
    """Anchor examples: each generic prompt with the base model's own greedy
    reply, as the token ids it generated (text would not always tokenize back
    to them). Generate these before any block is published."""
    prompts = list(prompts)
    return list(zip(prompts, generate_greedy_batch_ids(model, tokenizer, prompts, max_new_tokens)))
