"""The trainer's thin pieces on every supported architecture: replay + streamed
loss + fused block give plain autograd's gradients; activation memory is one
layer's; no base weight is copied or changed."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import ARCHS, tiny_model

from resident_trainer.models import DecoderAdapter
from resident_trainer.ops.fingerprint import fingerprint_tensors
from resident_trainer.train import AddedSharedNeurons, LayerReplay, StreamedCrossEntropy, full_graph_step


def make_block(adapter, layer, neurons=16, seed=1):
    block = AddedSharedNeurons(adapter.hidden_size, neurons, seed=seed)
    with torch.no_grad():  # a trained-looking block, so every weight gets a gradient
        block.w_down.copy_(torch.randn(block.w_down.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    handle = block.attach(adapter, layer)
    return block, handle


def batch(vocab, b=2, t=11, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    targets[0, :3] = -100
    return ids, targets


def grads(block):
    return [p.grad.clone() for p in (block.w_gate_up, block.w_down)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_replay_gradients_equal_plain_autograd(arch, where):
    model = tiny_model(arch, layers=5)
    a = DecoderAdapter(model)
    layer = {"first": 0, "middle": 2, "last": 4}[where]
    block, _ = make_block(a, layer)
    ids, targets = batch(a.vocab_size)
    with block.training_weights():
        logits = model(ids).logits
        want_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        want_loss.backward()
        want = grads(block)
        block.zero_grad()
        res = LayerReplay(a, layer).step(ids, lambda h: StreamedCrossEntropy(a)(h, targets))
        got = grads(block)
    # fp32 throughout; the only differences are summation orders in the loss
    # kernel and the fused block (measured max relative error ~1e-6).
    assert abs(res.loss.item() - want_loss.item()) <= 1e-5 * abs(want_loss.item())
    for g, w in zip(got, want):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("arch", ARCHS)
def test_peak_activation_memory_is_one_layer(arch):
    # Saved-for-backward bytes of the largest live graph, with 2 and 8 suffix
    # layers: replay stays flat, the full graph grows with depth.
    peaks = {}
    for layers in (4, 10):
        model = tiny_model(arch, layers=layers)
        a = DecoderAdapter(model)
        block, _ = make_block(a, 1)
        ids, targets = batch(a.vocab_size, b=2, t=24)
        loss_fn = lambda h: StreamedCrossEntropy(a)(h, targets)
        with block.training_weights():
            peaks[("replay", layers)] = LayerReplay(a, 1).step(ids, loss_fn).peak_saved_bytes
            for p in model.parameters():  # plain autograd needs a graph through every layer
                p.requires_grad_(False)
            peaks[("full", layers)] = full_graph_step(a, ids, loss_fn).peak_saved_bytes
    assert peaks[("replay", 10)] <= 1.05 * peaks[("replay", 4)], peaks
    assert peaks[("full", 10)] >= 2.0 * peaks[("full", 4)], peaks
    assert peaks[("replay", 10)] <= 0.25 * peaks[("full", 10)], peaks


def test_streamed_loss_shares_storage_with_the_model():
    model = tiny_model("llama")
    a = DecoderAdapter(model)
    ce = StreamedCrossEntropy(a)
    assert ce.head_weight.data_ptr() == model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    h = torch.randn(2, 5, a.hidden_size)
    y = torch.randint(0, a.vocab_size, (2, 5))
    want = F.cross_entropy(model.lm_head(model.model.norm(h)).reshape(-1, a.vocab_size), y.reshape(-1))
    torch.testing.assert_close(ce(h, y), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_block_changes_nothing_and_serving_sees_only_published(arch):
    model = tiny_model(arch)
    a = DecoderAdapter(model)
    ids, targets = batch(a.vocab_size)
    with torch.no_grad():
        before = model(ids).logits
    block = AddedSharedNeurons(a.hidden_size, 8)
    block.attach(a, 2)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # w_down starts at zero: exactly no-op
        block.w_down.add_(0.5)  # a training step's worth of change, unpublished
        assert torch.equal(model(ids).logits, before)
        with block.training_weights():
            assert not torch.equal(model(ids).logits, before)
        block.publish()
        assert not torch.equal(model(ids).logits, before)
        block.revert()
        assert not torch.equal(model(ids).logits, before)  # revert goes back to the published


def test_training_leaves_base_weights_bit_identical():
    model = tiny_model("qwen2_moe")
    a = DecoderAdapter(model)
    table = fingerprint_tensors(a.frozen_tensors())
    block, _ = make_block(a, 1)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
    ids, targets = batch(a.vocab_size)
    with block.training_weights():
        for _ in range(3):
            opt.zero_grad()
            LayerReplay(a, 1).step(ids, lambda h: StreamedCrossEntropy(a)(h, targets))
            opt.step()
    assert fingerprint_tensors(a.frozen_tensors()) == table
    assert not any(p.requires_grad for p in model.parameters())


def test_adapter_rejects_other_models():
    with pytest.raises(TypeError, match="missing"):
        DecoderAdapter(torch.nn.Linear(3, 3))
    a = DecoderAdapter(tiny_model("llama"))
    with pytest.raises(ValueError, match="layer must be in \\[0, 4\\)"):
        a.ffn(4)
    with pytest.raises(ValueError, match="layer must be in \\[0, 4\\) for this model of 4 layers, got 35"):
        a.layer_index(35)
    assert a.layer_index(None) == 0  # 4 // 5: the default is a fifth of the way in


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_suffix_replay_equals_autograd_through_the_same_casts(arch):
    # The suffix under bf16 autocast, block at layer 1 of 5: the replay's
    # loss and gradients are plain autograd's through the same layer code
    # with the same casts, and they differ from the fp32 step by bf16's
    # rounding (so the casts did run).
    model = tiny_model(arch, layers=5)
    a = DecoderAdapter(model)
    block, _ = make_block(a, 1)
    ids, targets = batch(a.vocab_size, t=13)
    loss_fn = lambda h: StreamedCrossEntropy(a)(h, targets)
    with block.training_weights():
        LayerReplay(a, 1).step(ids, loss_fn)
        fp32 = grads(block)
        block.zero_grad()
        res = LayerReplay(a, 1, suffix_dtype=torch.bfloat16).step(ids, loss_fn)
        got = grads(block)
        block.zero_grad()
        h = a.embed_tokens(ids)
        ctx = a.context(h, None)
        for i in range(a.num_layers):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i > 1):
                h = a.run_layer(i, h, ctx)
        want_loss = loss_fn(h.float())
        want_loss.backward()
        want = grads(block)
    assert res.loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got)
    assert abs(res.loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
    for g, w, f in zip(got, want, fp32):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
        # Against fp32, the replay is as far as torch's own bf16 computation
        # (autograd through the same casts), and that is bf16's rounding,
        # not fp32 noise (measured 0.7-1.7% of the norm).
        ours, torch_bf16 = ((g - f).norm() / f.norm()).item(), ((w - f).norm() / f.norm()).item()
        assert torch_bf16 > 1e-3, torch_bf16
        assert abs(ours - torch_bf16) <= 1e-3 * torch_bf16, (ours, torch_bf16)
