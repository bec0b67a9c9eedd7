"""Tests for uc_checkpoint.demo.model: shapes, presets, causality, dropout, FSDP2 sharding."""

from __future__ import annotations

import math

import pytest
import torch

from uc_checkpoint.demo.model import GPT, GPTConfig, num_parameters, shard_model

TINY = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_layer=2, n_head=4, dropout=0.1)


def _tokens(batch: int, steps: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, steps), generator=torch.Generator().manual_seed(seed))


def test_forward_shapes_and_finite_loss() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    idx, targets = _tokens(3, 16), _tokens(3, 16, seed=1)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, 256)
    assert loss is not None and loss.dim() == 0 and torch.isfinite(loss)
    # Small init gives near-uniform predictions: loss close to ln(256).
    assert abs(loss.item() - math.log(256)) < 0.5
    logits_short, no_loss = model(idx[:, :5])
    assert logits_short.shape == (3, 5, 256) and no_loss is None


def test_forward_rejects_bad_shapes() -> None:
    model = GPT(TINY)
    with pytest.raises(ValueError, match="seq_len"):
        model(_tokens(1, 17))
    with pytest.raises(ValueError):
        model(_tokens(1, 8)[0])
    with pytest.raises(ValueError):
        model(_tokens(2, 8), _tokens(2, 7))


def test_backward_reaches_every_parameter() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    _, loss = model(_tokens(2, 16), _tokens(2, 16, seed=1))
    assert loss is not None
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
    assert model.tok_emb.weight.grad is not None and model.tok_emb.weight.grad.abs().sum() > 0


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = _tokens(2, 16)
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_dropout_uses_global_rng() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).train()
    idx = _tokens(2, 16)
    torch.manual_seed(5)
    first, _ = model(idx)
    torch.manual_seed(5)
    again, _ = model(idx)
    torch.manual_seed(6)
    other, _ = model(idx)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    model.eval()
    with torch.no_grad():
        torch.manual_seed(1)
        e1, _ = model(idx)
        torch.manual_seed(2)
        e2, _ = model(idx)
    assert torch.equal(e1, e2)


def test_tied_head_has_single_parameter() -> None:
    tied = GPT(TINY)
    assert tied.lm_head is None
    assert "lm_head.weight" not in tied.state_dict()
    untied = GPT(GPTConfig(**{**TINY.__dict__, "tie_weights": False}))
    assert untied.lm_head is not None
    assert num_parameters(untied) - num_parameters(tied) == TINY.vocab_size * TINY.d_model


def test_same_seed_same_init() -> None:
    torch.manual_seed(7)
    a = GPT(TINY)
    torch.manual_seed(7)
    b = GPT(TINY)
    torch.manual_seed(8)
    c = GPT(TINY)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.qkv.weight"], sc["blocks.0.attn.qkv.weight"])


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError):
        GPTConfig(dropout=1.0)
    with pytest.raises(ValueError):
        GPTConfig(n_layer=0)


def test_demo_preset_state_size() -> None:
    config = GPTConfig.demo()
    assert (config.vocab_size, config.seq_len) == (256, 128)
    assert config.dropout > 0
    model = GPT(config)
    n = num_parameters(model)
    # fp32 params + AdamW exp_avg + exp_avg_sq.
    state_mb = 3 * 4 * n / 1e6
    assert 20 <= state_mb <= 40, (n, state_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, loss = model(_tokens(2, 32), _tokens(2, 32, seed=1))
    assert loss is not None
    loss.backward()
    optimizer.step()
    moments = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for key, t in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    )
    assert moments == 2 * 4 * n


def test_gpt2_small_preset_on_meta() -> None:
    config = GPTConfig.gpt2_small()
    assert (config.n_layer, config.d_model, config.n_head, config.seq_len) == (12, 768, 12, 1024)
    assert config.vocab_size == 50257
    with torch.device("meta"):
        model = GPT(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    n = num_parameters(model)
    assert 120_000_000 <= n <= 130_000_000, n
    assert len(model.blocks) == 12


def test_meta_then_materialize() -> None:
    with torch.device("meta"):
        model = GPT(TINY)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    eager = GPT(TINY)
    torch.manual_seed(0)
    eager.init_weights()
    for (name, a), (_, b) in zip(model.state_dict().items(), eager.state_dict().items()):
        assert torch.equal(a, b), name
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.2)


def test_shard_model_single_rank(single_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    plain = GPT(TINY)
    torch.manual_seed(0)
    sharded = shard_model(GPT(TINY), init_device_mesh("cpu", (1,)))
    assert isinstance(sharded, FSDPModule)
    assert all(isinstance(block, FSDPModule) for block in sharded.blocks)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    assert num_parameters(sharded) == num_parameters(plain)

    idx, targets = _tokens(2, 16), _tokens(2, 16, seed=1)
    plain.eval()
    sharded.eval()
    with torch.no_grad():
        want, want_loss = plain(idx, targets)
        got, got_loss = sharded(idx, targets)
    assert torch.allclose(want, got, atol=1e-6)
    assert want_loss is not None and got_loss is not None
    assert torch.allclose(want_loss, got_loss, atol=1e-6)

    sharded.train()
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    before = sharded.tok_emb.weight.full_tensor().clone()
    _, loss = sharded(idx, targets)
    assert loss is not None
    loss.backward()
    optimizer.step()
    assert not torch.equal(before, sharded.tok_emb.weight.full_tensor())
