"""The fused, chunked tree cross-entropy against the plain autograd version: value and the
gradients of hidden states, projection and bias, over several chunks, odd lengths, roots."""

import pytest
import torch

import treefx.ops.cross_entropy as ce
from treefx.ops.cross_entropy import fast as ce_fast


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n", [1, 37, 64])
def test_fused_matches_reference(monkeypatch, dtype, bias, n):
    vocab, dim = 50, 16
    monkeypatch.setattr(ce_fast, "CHUNK_ELEMENTS", 10 * vocab)  # chunks of 10 tokens
    g = torch.Generator().manual_seed(n)
    h = torch.randn(1, n, dim, dtype=dtype, generator=g, requires_grad=True)
    w = torch.randn(vocab, dim, dtype=dtype, generator=g, requires_grad=True)
    b = torch.randn(vocab, dtype=dtype, generator=g, requires_grad=True) if bias else None
    ids = torch.randint(0, vocab, (1, n), generator=g)
    parent = torch.arange(n) - 1
    parent[n // 2] = n // 4 - 1  # a branch: predecessor far back (or a second root)
    weights = torch.rand(n, dtype=dtype, generator=g)
    params = [h, w] + ([b] if bias else [])
    fused, lp = ce.fused_linear_tree_loss_and_logprobs(h, w, b, ids, parent, weights)
    ref = ce.linear_tree_cross_entropy_reference(h, w, b, ids, parent, weights)
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, ref, **tol)
    for a, r in zip(torch.autograd.grad(fused, params), torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, r, **tol)
    # the by-product: each token's log-probability (0 at a root), detached
    logits = torch.nn.functional.linear(h, w, b).to(lp.dtype)
    torch.testing.assert_close(lp, ce.tree_token_logprobs(logits, ids, parent).detach(), **tol)
    assert not lp.requires_grad and fused.requires_grad


def test_fused_traces_under_compile():
    h = torch.randn(1, 9, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    ids, parent, weights = torch.randint(0, 20, (1, 9)), torch.arange(9) - 1, torch.rand(9)
    compiled = torch.compile(ce.fused_linear_tree_cross_entropy, backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(h, w, None, ids, parent, weights),
                               ce.linear_tree_cross_entropy_reference(h, w, None, ids, parent,
                                                                     weights))


def test_fused_without_grad_gives_the_value():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(1, 13, 8, generator=g), torch.randn(30, 8, generator=g, requires_grad=True)
    ids, parent, weights = torch.randint(0, 30, (1, 13), generator=g), torch.arange(13) - 1, \
        torch.rand(13, generator=g)
    with torch.no_grad():
        value = ce.fused_linear_tree_cross_entropy(h, w, None, ids, parent, weights)
        ref = ce.linear_tree_cross_entropy_reference(h, w, None, ids, parent, weights)
    assert not value.requires_grad
    torch.testing.assert_close(value, ref)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_frozen_projection_is_not_differentiated(bias):
    """A LoRA model's output projection is frozen: the hidden states' gradient is the
    reference's, and the projection's [V, D] gradient is neither returned nor computed."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(1, 21, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, generator=g)
    b = torch.randn(30, dtype=torch.float64, generator=g) if bias else None
    ids, parent = torch.randint(0, 30, (1, 21), generator=g), torch.arange(21) - 1
    weights = torch.rand(21, dtype=torch.float64, generator=g)
    fused = ce.fused_linear_tree_cross_entropy(h, w, b, ids, parent, weights)
    (got,) = torch.autograd.grad(fused, h)
    ref = ce.linear_tree_cross_entropy_reference(h, w, b, ids, parent, weights)
    (expected,) = torch.autograd.grad(ref, h)
    torch.testing.assert_close(fused, ref)
    torch.testing.assert_close(got, expected)
    op = torch.ops.treefx.linear_tree_ce_with_grad.default
    _, _, _, dw, db = op(h, w, b, ids, parent, weights, False)
    assert dw.numel() == 0 and db.numel() == 0
    for want_weight in (False, True):
        torch.library.opcheck(op, (h, w.requires_grad_(want_weight), b, ids, parent, weights,
                                   want_weight))
