"""Weight gradients summed straight into ``.grad``: a linear layer whose weight's gradient is
added into a given buffer (the parameter's ``.grad``) by the matrix product that computes it.

:func:`treefx.backward` runs a tree in parts, one backward per part, so every weight gets one
gradient per part. Returned to autograd, each is a fresh [out, in] tensor that
``AccumulateGrad`` then adds into ``.grad``: the gradient's size written once, read and added
to ``.grad`` (read and written) once more, per weight and part. Here the product adds into
``.grad`` itself (``addmm`` with beta 1: ``.grad`` read and written once, in the matrix
multiply's epilogue, the sum formed in the product's accumulator type and rounded once), and
autograd gets no gradient for the weight.

The buffer is an input of the op, mutated in its backward; under AOTAutograd that is a
mutation of a forward input during the backward, which it keeps in the backward graph and
Inductor performs in place.
"""

from __future__ import annotations

import torch

__all__ = ["linear_grad_into", "mm_into_"]


@torch.library.custom_op("treefx::mm_into_", mutates_args=("out",))
def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    out.addmm_(a, b)


@_mm_into.register_fake
def _(out, a, b):
    return None


def mm_into_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` in place (one ``addmm``)."""
    _mm_into(out, a, b)


@torch.library.custom_op("treefx::linear_grad_into", mutates_args=())
def _linear_grad_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      grad_into: torch.Tensor) -> torch.Tensor:
    # Written into a tensor of the output's own shape: F.linear of a 3-d input returns a view
    # of its 2-d product, and a custom op's output that is a view may not be modified in place
    # (models add embeddings into a projection's output with +=).
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    x2, o2 = x.reshape(-1, x.shape[-1]), out.view(-1, weight.shape[0])
    if bias is None:
        torch.mm(x2, weight.t(), out=o2)
    else:
        torch.addmm(bias, x2, weight.t(), out=o2)
    return out


@_linear_grad_into.register_fake
def _(x, weight, bias, grad_into):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup(ctx, inputs, output):
    x, weight, bias, grad_into = inputs
    ctx.save_for_backward(x, weight)
    # not saved for backward: written in place by every use before this one runs backward
    ctx.grad_into = grad_into
    ctx.has_bias = bias is not None


def _grad(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_into = ctx.grad_into
    need_x = ctx.needs_input_grad[0]
    need_bias = ctx.has_bias and ctx.needs_input_grad[2]
    g2 = grad.reshape(-1, grad.shape[-1])
    if ctx.needs_input_grad[1]:
        _mm_into(grad_into, g2.t(), x.reshape(-1, x.shape[-1]).to(g2.dtype))
    dx = grad.matmul(weight) if need_x else None
    db = g2.sum(0) if need_bias else None
    return dx, None, db, None


_linear_grad_into.register_autograd(_grad, setup_context=_setup)


def linear_grad_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     grad_into: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose weight gradient is added into ``grad_into`` (a
    tensor of ``weight``'s shape and dtype: the parameter's ``.grad``) in the backward, not
    returned to autograd (``x``'s and ``bias``'s gradients are, as usual)."""
    return _linear_grad_into(x, weight, bias, grad_into)
