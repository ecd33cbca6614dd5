"""Tensor-parallel and optimiser helpers of the training core: which neurons
a rank holds, and gradient clipping over every rank's shard."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def shard_range(total: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of `total` items (the first
    `total % world` ranks get one more)."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def clip_grad_norm_(params: Sequence[Tensor], max_norm: float, process_group=None) -> float:
    """Clip the gradients of `params` (each rank's shard under TP) to a global
    norm of `max_norm`; returns the norm before clipping, the same on every rank."""
    sq = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for p in params:
        if p.grad is not None:
            sq = sq + p.grad.float().square().sum()
    if process_group is not None:
        dist.all_reduce(sq, group=process_group)
    norm = float(sq.sqrt())
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
