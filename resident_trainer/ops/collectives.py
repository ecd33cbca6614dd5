"""Differentiable collectives over a process group, for tensor-parallel pieces:
the added expert's neurons split over ranks, the gate score's max over them.

| function | forward | backward |
|---|---|---|
| `copy_to_ranks(x, g)` | identity (x is replicated) | all-reduce SUM of the ranks' partial gradients |
| `sum_over_ranks(x, g)` | all-reduce SUM of the ranks' partial outputs | identity |
| `max_over_ranks(x, g)` | all-reduce MAX, elementwise | the gradient goes to the rank(s) holding the max |
| `amax_over_ranks(x, g)` | the max over the last dimension of every rank's x | split evenly over every rank's tied maxima, as `amax` in one process |
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class _CopyToRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # A fresh contiguous buffer: the incoming gradient may be a strided or
        # expanded view, and all_reduce works in place.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, group):
        if out.is_contiguous():
            ctx.mark_dirty(out)  # the caller's fresh output: summed in place
        else:
            out = out.contiguous()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _MaxOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        ctx.save_for_backward(t == out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (owner,) = ctx.saved_tensors
        return grad * owner, None


def copy_to_ranks(x: Tensor, group) -> Tensor:
    """x unchanged; its gradient is the sum of every rank's partial gradient."""
    return _CopyToRanks.apply(x, group)


def sum_over_ranks(out: Tensor, group) -> Tensor:
    """The sum of every rank's `out` (in place when `out` is contiguous: pass
    a fresh tensor); the gradient passes through unchanged."""
    return _SumOverRanks.apply(out, group)


def max_over_ranks(t: Tensor, group) -> Tensor:
    """Elementwise max of `t` over the ranks; the gradient reaches the rank(s)
    holding the max."""
    return _MaxOverRanks.apply(t, group)


class _AmaxOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        top = x.amax(-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        tie = x == top.unsqueeze(-1)
        count = tie.sum(-1, dtype=x.dtype)
        dist.all_reduce(count, group=group)
        ctx.save_for_backward(tie, count)
        return top

    @staticmethod
    def backward(ctx, grad):
        tie, count = ctx.saved_tensors
        return tie * (grad / count).unsqueeze(-1), None


def amax_over_ranks(x: Tensor, group) -> Tensor:
    """The max over the last dimension of the whole tensor whose shards
    along that dimension the ranks hold; the gradient is split evenly over
    every tied maximum on every rank, as ``x.amax(-1)`` splits it in one
    process (max_over_ranks of each rank's amax would give each rank's share
    in full, and a tie across ranks twice the gradient)."""
    return _AmaxOverRanks.apply(x, group)
