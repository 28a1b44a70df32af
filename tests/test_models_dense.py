"""The dense decoder: both attention implementations agree, default positions equal arange, it is
causal, it batches, its config validates, and torch.compile captures it in one graph."""

from __future__ import annotations

import pytest
import torch

from treefx.models import Decoder, DecoderConfig, tiny_decoder

IMPLS = ["sdpa", "eager"]


def _ids(b: int = 2, t: int = 11, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g)


def _model(seed: int = 0, **overrides) -> Decoder:
    torch.manual_seed(seed)
    return tiny_decoder(**overrides).eval()


def test_config_defaults():
    cfg = DecoderConfig()
    assert cfg.head_dim == cfg.dim // cfg.n_heads == 16
    assert cfg.intermediate_size == 176 and cfg.intermediate_size % 16 == 0
    assert DecoderConfig(dim=96, n_heads=3, n_kv_heads=1).intermediate_size == 256


def test_init_is_deterministic():
    a, b, c = _model(1), _model(1), _model(2)
    for (n, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert abs(a.layers[0].attention.wq.weight.std().item() - 0.02) < 0.003


def test_sdpa_and_eager_agree_float64():
    ids = _ids()
    sdpa = _model(3, attn_impl="sdpa").double()
    eager = _model(3, attn_impl="eager").double()
    with torch.no_grad():
        a, b = sdpa(ids), eager(ids)
    assert a.shape == (2, 11, 256) and a.dtype == torch.float64
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_arange_positions_equal_default(impl):
    model, ids = _model(attn_impl=impl), _ids()
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids, position_ids=pos), rtol=0, atol=0)
        torch.testing.assert_close(model(ids), model(ids, pos[0]), rtol=0, atol=0)
        # positions matter: shifted positions change the logits
        assert not torch.allclose(model(ids), model(ids, pos + 5))


@pytest.mark.parametrize("impl", IMPLS)
def test_causal(impl):
    model, ids = _model(attn_impl=impl).double(), _ids(b=1, t=12)
    changed = ids.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_equals_rows(impl):
    model, ids = _model(attn_impl=impl).double(), _ids(b=2, t=9)
    with torch.no_grad():
        both = model(ids)
        rows = torch.cat([model(ids[i : i + 1]) for i in range(2)])
    assert both.shape == (2, 9, 256)
    torch.testing.assert_close(both, rows, rtol=0, atol=1e-12)


def test_tied_embeddings_and_overrides():
    model = _model(tie_embeddings=True, n_layers=1, n_kv_heads=4, head_dim=8)
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert len(model.layers) == 1 and model.layers[0].attention.wk.out_features == 32
    assert "inv_freq" not in model.state_dict()
    out = model(_ids(b=1, t=5))
    out.sum().backward()
    assert model.tok_embeddings.weight.grad is not None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_heads=4, n_kv_heads=3), "divisible by n_kv_heads"),
        (dict(dim=66, n_heads=4), "divisible by n_heads"),
        (dict(head_dim=7), "even"),
        (dict(attn_impl="flash"), "attn_impl"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(n_layers=-1), "n_layers"),
        (dict(n_kv_heads=0), "n_kv_heads"),
        (dict(intermediate_size=0), "intermediate_size"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(norm_eps=-1.0), "norm_eps"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_fullgraph(impl):
    torch._dynamo.reset()
    model, ids = _model(attn_impl=impl), _ids()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids))  # fullgraph=True raises on any graph break
