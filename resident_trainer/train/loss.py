"""The streamed loss: final norm and exact cross-entropy over the vocabulary
head the model already holds, in tiles, never allocating the logits."""

from __future__ import annotations

from torch import Tensor

from resident_trainer.models.adapter import DecoderAdapter
from resident_trainer.ops.linear_cross_entropy import linear_cross_entropy


class StreamedCrossEntropy:
    """Final norm + ``linear_cross_entropy`` over the model's own vocabulary head
    (tied embeddings included): ``F.cross_entropy(lm_head(norm(h)), y)``
    without the logits. With a process group, `head_weight` is this rank's
    contiguous shard of the head rows starting at `vocab_start`, a view of the
    model's tensor. No base weight is copied."""

    def __init__(
        self,
        adapter: DecoderAdapter,
        *,
        head_weight: Tensor | None = None,
        head_bias: Tensor | None = None,
        process_group=None,
        vocab_start: int = 0,
        impl: str = "auto",
        **ce_kwargs,
    ):
        self.adapter = adapter
        self.head_weight = adapter.head_weight if head_weight is None else head_weight
        self.head_bias = adapter.head_bias if head_weight is None else head_bias
        self.process_group = process_group
        self.vocab_start = vocab_start
        self.impl = impl
        self.ce_kwargs = ce_kwargs

    def __call__(self, hidden: Tensor, targets: Tensor, **kw) -> Tensor:
        """hidden: (B, T, D) output of the last layer; targets: (B, T) with
        ignore_index (-100) where no loss is wanted. Extra keyword arguments go
        to linear_cross_entropy (reduction, return_lse, ...).

        With the default reductions ("mean", "sum") and no per-token output
        asked for, only the tokens that have a target go through the norm and
        the head: a chat example's answer is a fifth of its tokens, and the
        vocabulary head is most of a step's loss work. The loss and its
        gradient are the same (ignored tokens add nothing to either)."""
        kw = {**self.ce_kwargs, **kw}
        ignore = kw.get("ignore_index", -100)
        if kw.get("reduction", "mean") in ("mean", "sum") and not kw.get("return_lse", False):
            keep = targets != ignore
            hidden, targets = hidden[keep], targets[keep]
        normed = self.adapter.norm(hidden)
        return linear_cross_entropy(
            normed,
            self.head_weight,
            targets,
            linear_bias=self.head_bias,
            process_group=self.process_group,
            vocab_start=self.vocab_start,
            impl=self.impl,
            **kw,
        )
