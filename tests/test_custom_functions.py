"""Custom ``autograd.Function``s in a model (Bloom's GeLU): one whose forward and backward are
elementwise on tensors of one shape treats each token alone and runs on the tree as written;
one whose forward or backward runs along the tokens is refused, naming the node."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB, check_against_oracle, hf_model
from trees import odd_forest

import treefx


class _TanhGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        d = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        return d * g


class _RunningSum(torch.autograd.Function):
    """Mixes the tokens in its forward: a prefix sum along the sequence."""

    @staticmethod
    def forward(ctx, x):
        return x.cumsum(1)

    @staticmethod
    def backward(ctx, g):
        return g.flip(1).cumsum(1).flip(1)


class _MixingBackward(torch.autograd.Function):
    """Elementwise forward, but a backward that runs along the tokens: refused too."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g.cumsum(1)


class Act(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x)


def qwen3_with(fn) -> torch.nn.Module:
    model = hf_model("qwen3", "eager")
    for layer in model.model.layers:
        layer.mlp.act_fn = Act(fn)
    return model


def test_elementwise_function_matches_oracle():
    tm = treefx.compile(qwen3_with(_TanhGelu), backend="eager")
    check_against_oracle(tm, odd_forest(2, VOCAB))


@pytest.mark.parametrize("fn", [_RunningSum, _MixingBackward])
def test_function_along_the_tokens_is_refused(fn):
    tm = treefx.compile(qwen3_with(fn), backend="eager", verify=False)
    with pytest.raises(treefx.TreeCompileError, match="autograd_function_apply at model.layers"):
        tm(treefx.pack(odd_forest(2, VOCAB)))
