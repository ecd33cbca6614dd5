"""Layer replay: one training step on a frozen model at about one layer's
activation memory.

A step at layer L costs the activations of about one layer: the prefix
(layers < L) runs without grad; layer L runs with grad (the added block is the
only trainable thing in it); the suffix (layers > L) runs without grad keeping
only its boundary hidden states; backward replays the suffix one layer at a
time, newest first (recompute the layer with grad, take the gradient w.r.t.
its input, free it), then backpropagates through layer L into the block.
The replay calls the same layer code on the same inputs as the first pass,
so MoE routing recomputes identically and the boundaries do not drift.

The suffix may compute in a lower precision than the weights are held in
(`suffix_dtype`, torch.autocast: the first pass and the replay alike, so the
replay still recomputes what the first pass computed); layer L, the block
and the loss keep the weights' dtype. `suffix_dtype_for` resolves a
TrainConfig setting, "auto" by measuring this device's products.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from resident_trainer import _ext
from resident_trainer.models.adapter import DecoderAdapter, LayerContext
from resident_trainer.ops.saved import SavedBytes

#: "auto" takes bf16 for the suffix only where this device's bf16 products
#: are measured at least this much faster than fp32's. A 2-core Xeon with
#: AMX (family 6 model 207) ran the step's products 2.5-4.5x faster in bf16;
#: without bf16 instructions (AVX2-only EPYCs) bf16 products are slower.
AUTO_MIN_SPEEDUP = 1.5
_PROBE_ROWS = 256
_PROBE_RUNS = 5


def _best_seconds(fn, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(_PROBE_RUNS):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def bf16_speedup(device_type: str, hidden: int, threads: int) -> float:
    """fp32 time over bf16 time of a (256 x hidden) @ (hidden x 4 hidden)
    product on this device, best of 5 each (measured once per process;
    threads: the CPU thread count it was measured with); 0.0 where the
    device refuses bf16 products."""
    device = torch.device(device_type)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(_PROBE_ROWS, hidden, generator=g).to(device)
    b = torch.randn(hidden, 4 * hidden, generator=g).to(device)
    a16, b16 = a.bfloat16(), b.bfloat16()
    with torch.no_grad():
        try:
            slow = _best_seconds(lambda: a16 @ b16, device)
        except RuntimeError:  # a device without bf16 products: never faster
            return 0.0
        return _best_seconds(lambda: a @ b, device) / slow


def suffix_dtype_for(
    setting: str | None, weights: torch.dtype, device: torch.device, hidden: int
) -> torch.dtype | None:
    """The dtype the suffix computes in for TrainConfig.suffix_dtype
    `setting` (None: the weights' own, returned as None). "bfloat16": bf16
    where the weights are wider. "auto": bf16 where the weights are fp32 and
    bf16_speedup is at least AUTO_MIN_SPEEDUP; under
    RESIDENT_TRAINER_REPRODUCIBLE=1 the weights' own without measuring."""
    if setting is None or weights not in (torch.float32, torch.float64):
        return None
    if setting == "bfloat16":
        return torch.bfloat16
    if setting != "auto":
        raise ValueError(f"suffix_dtype must be None, 'auto' or 'bfloat16', got {setting!r}")
    if weights != torch.float32 or _ext.reproducible():
        return None
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    return torch.bfloat16 if bf16_speedup(device.type, hidden, threads) >= AUTO_MIN_SPEEDUP else None


@dataclass
class ReplayResult:
    """One step's loss (a detached scalar) and the peak bytes saved for
    backward by any one graph it built (the activation memory it held)."""

    loss: Tensor
    peak_saved_bytes: int


class LayerReplay:
    """One training step of whatever trains inside layer `layer` (the added
    block, attached to that layer), with the frozen suffix replayed in
    backward instead of kept as a graph."""

    def __init__(self, adapter: DecoderAdapter, layer: int | None = None, *, suffix_dtype: torch.dtype | None = None):
        self.adapter = adapter
        self.layer = adapter.layer_index(layer)
        # The dtype layers > layer compute in (autocast); None: the weights'.
        self.suffix_dtype = suffix_dtype

    def _suffix(self, device: torch.device):
        if self.suffix_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.suffix_dtype)

    def _meter(self) -> SavedBytes:
        # Activations only: the frozen weights a graph saves exist anyway.
        return SavedBytes(exclude=self.adapter.frozen_tensors().values())

    def _context(
        self, h: Tensor, attention_mask: Tensor | None, shared, segments: Tensor | None = None
    ) -> LayerContext:
        kw = {} if segments is None else {"segments": segments}
        if shared is None:
            return self.adapter.context(h, attention_mask, **kw)
        return self.adapter.context(h, attention_mask, prefix=shared, **kw)

    def prefix(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, shared=None
    ) -> tuple[Tensor, LayerContext]:
        """Hidden state entering layer `layer` (no grad) and the layer context.
        shared: a PrefixKV the rows continue (adapters with supports_prefix_kv)."""
        with torch.no_grad():
            h = self.adapter.embed_tokens(input_ids)
            ctx = self._context(h, attention_mask, shared)
            for i in range(self.layer):
                h = self.adapter.run_layer(i, h, ctx)
        return h, ctx

    def step(
        self,
        input_ids: Tensor,
        loss_fn: Callable[[Tensor], Tensor],
        *,
        attention_mask: Tensor | None = None,
        extra_loss: Callable[[], Tensor] | None = None,
        hidden_in: Tensor | None = None,
        shared=None,
        segments: Tensor | None = None,
    ) -> ReplayResult:
        """Forward and backward of ``loss_fn(last hidden)`` (+ ``extra_loss()``,
        e.g. a penalty on the block's output elsewhere); gradients land in
        the trainable parameters' ``.grad``. loss_fn: (B, T, D) -> scalar.
        hidden_in: the hidden state entering layer `layer` (B, T, D) when the
        caller has it (the prefix is then skipped). shared: a PrefixKV of a
        prefix every row continues (its tokens are not in input_ids).
        segments: (B, T) ids of the examples packed into each row (adapters
        with supports_packing; with hidden_in)."""
        a = self.adapter
        if hidden_in is None:
            if segments is not None:
                raise ValueError("segments needs hidden_in (each example's own prefix pass)")
            h_in, ctx = self.prefix(input_ids, attention_mask, shared=shared)
        else:
            if hidden_in.shape[:2] != input_ids.shape:
                raise ValueError(f"hidden_in is {tuple(hidden_in.shape)}, input_ids {tuple(input_ids.shape)}")
            h_in, ctx = hidden_in, self._context(hidden_in, attention_mask, shared, segments)
        peak = 0
        # Layer L with grad: the trainable block is the only leaf in it.
        with self._meter() as saved:
            h_out = a.run_layer(self.layer, h_in, ctx)
        layer_saved = saved.total
        # Suffix without grad: keep the boundaries only.
        bounds = [h_out.detach()]
        with torch.no_grad(), self._suffix(h_out.device):
            for i in range(self.layer + 1, a.num_layers):
                bounds.append(a.run_layer(i, bounds[-1], ctx))
        last = bounds[-1].to(h_out.dtype).requires_grad_(True)
        with self._meter() as saved:
            loss = loss_fn(last)
        peak = max(peak, saved.total)
        (grad,) = torch.autograd.grad(loss, last)
        # Replay the suffix newest first, one layer's graph at a time (layer
        # L's own graph stays alive meanwhile, hence its bytes on top).
        for i in range(a.num_layers - 1, self.layer, -1):
            x = bounds[i - self.layer - 1].requires_grad_(True)
            with torch.enable_grad(), self._meter() as saved, self._suffix(x.device):
                y = a.run_layer(i, x, ctx)
            peak = max(peak, saved.total)
            (grad,) = torch.autograd.grad(y, x, grad.to(y.dtype))
            bounds[i - self.layer] = None  # free the boundary it replaced
        grad = grad.to(h_out.dtype)
        total = loss.detach()
        if extra_loss is not None:
            with self._meter() as saved:
                extra = extra_loss()
            peak = max(peak, saved.total)
            torch.autograd.backward([h_out, extra], [grad, torch.ones_like(extra)])
            total = total + extra.detach()
        else:
            h_out.backward(grad)
        return ReplayResult(total, layer_saved + peak)


def full_graph_step(
    adapter: DecoderAdapter,
    input_ids: Tensor,
    loss_fn: Callable[[Tensor], Tensor],
    *,
    attention_mask: Tensor | None = None,
) -> ReplayResult:
    """The same step with plain autograd through every layer (the reference
    that replay is tested and benchmarked against)."""
    a = adapter
    with SavedBytes(exclude=a.frozen_tensors().values()) as saved:
        h = a.embed_tokens(input_ids)
        ctx = a.context(h, attention_mask)
        for i in range(a.num_layers):
            h = a.run_layer(i, h, ctx)
        loss = loss_fn(h)
    loss.backward()
    return ReplayResult(loss.detach(), saved.total)
