"""Weight gradients added straight into ``.grad`` (:mod:`treefx.ops.grad_into`), as the parts
of :func:`treefx.backward` do: the same gradients as autograd's, in place, through eager
autograd and through AOTAutograd (where the buffer is a forward input written in the backward,
kept in the backward graph)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treefx.ops.grad_into import linear_grad_into


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_grad_into_adds_the_weight_gradient(backend, bias):
    torch.manual_seed(0)
    w = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True) if bias else None
    x = torch.randn(1, 7, 5, dtype=torch.float64, requires_grad=True)
    before = torch.randn(6, 5, dtype=torch.float64)
    into = before.clone()

    def f(x, w, b, into):  # the weight used twice: both products add into the buffer
        y = linear_grad_into(torch.tanh(x), w, b, into)
        return (y.sin() ** 2).sum() + (linear_grad_into(x * 2, w, None, into) ** 3).sum()

    fn = f if backend is None else torch.compile(f, backend=backend, fullgraph=True)
    fn(x, w, b, into).backward()
    assert w.grad is None
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    b2 = b.detach().requires_grad_() if bias else None
    ref = (torch.sin(F.linear(torch.tanh(x2), w2, b2)) ** 2).sum() + \
        (F.linear(x2 * 2, w2) ** 3).sum()
    ref.backward()
    torch.testing.assert_close(into - before, w2.grad, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-12, rtol=1e-12)
    if bias:
        torch.testing.assert_close(b.grad, b2.grad, atol=1e-12, rtol=1e-12)


def test_a_frozen_weight_adds_nothing():
    w = torch.randn(4, 3)
    x = torch.randn(2, 3, requires_grad=True)
    into = torch.zeros(4, 3)
    linear_grad_into(x, w, None, into).sum().backward()
    assert torch.all(into == 0)
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 3))
