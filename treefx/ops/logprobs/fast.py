"""Per-token log-probabilities on the tree from hidden states and the output projection, the
[N, vocab] logits never materialized (the plain-torch forms are :mod:`.reference`).

``lp_t = z_t[y_t] − lse(z_t)`` with ``z_t = h[p_t] W^T + b``, ``p_t = parent_token[t]``
(0 where t has no predecessor): what :func:`treefx.ops.cross_entropy.tree_token_logprobs`
reads from materialized logits (the reference), computed here in chunks of tokens, each
chunk's [C, V] logits dropped once its log-sum-exp and its labels' logits are read.

Unlike the fused loss (:mod:`treefx.ops.cross_entropy.fast`), whose upstream gradient is one
scalar, the gradient of per-token log-probabilities is a vector known only in the backward (an
RL objective's, per token). So the forward keeps each token's log-sum-exp ([N] floats) and the
backward recomputes the logits once, in slices of the vocabulary (``_TOKEN_BLOCK``):
``d lp_t / d z_t = onehot(y_t) − softmax(z_t)``.
Tokens whose upstream gradient is 0 (prompts, tool results: everything an objective does not
train) are skipped in the backward, and the weight's and bias' gradients are computed only
when they are wanted (a LoRA model's frozen output projection).

On the GPU a chunk's log-sum-exp and a slice's gradient are :mod:`.from_logits`' Triton
kernels (one pass over the chunk or slice each); elsewhere, and for a bias (whose gradient sums
the slice's in float32), Inductor's or eager forms of the same math.

``torch.library`` custom ops with a registered backward: opaque to Inductor (which would
otherwise need the whole [N, V] tensor), traceable by AOTAutograd, any N. Peak memory: one
chunk's [C, V] (forward) or slice's [T, Vs] (backward) logits and their gradient, C·V and T·Vs
at most ``CHUNK_ELEMENTS`` (:mod:`treefx.ops.cross_entropy.fast`), on top of the hidden states
and, in the backward, their float32 gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cross_entropy import fast as ce_fast
from . import from_logits

__all__ = ["fused_linear_tree_logprobs"]


def _acc(h: torch.Tensor) -> torch.dtype:
    return torch.promote_types(h.dtype, torch.float32)


def _chunk(n_vocab: int) -> int:
    # Read at call time: the chunk budget is cross_entropy's (one setting for both ops).
    return max(1, ce_fast.CHUNK_ELEMENTS // max(n_vocab, 1))


def _lse_and_pick(logits, ids, acc: torch.dtype):
    """One chunk's log-sum-exp and its labels' logits, in ``acc``."""
    lg = logits.to(acc)
    return torch.logsumexp(lg, dim=-1), lg.gather(1, ids[:, None])[:, 0]


def _lse_and_pick_triton(logits, ids, acc: torch.dtype):
    return from_logits.lse_rows(logits), logits.gather(1, ids[:, None])[:, 0].to(acc)


def _forward(h, weight, bias, ids, parent):
    acc = _acc(h)
    h2 = h.reshape(-1, h.shape[-1])
    ids = ids.reshape(-1)
    row = parent.clamp(min=0)
    n = ids.shape[0]
    lp = torch.zeros(n, dtype=acc, device=h.device)
    lse = torch.zeros(n, dtype=acc, device=h.device)
    step = _chunk(weight.shape[0])
    # on the GPU one reduction reading the chunk's logits once in their own dtype (eagerly,
    # the float32 copy alone wrote and read [883, 151,936] twice more per chunk): Triton's
    # one-pass log-sum-exp (:mod:`.from_logits`), else Inductor's
    lse_fn = _lse_and_pick_triton if from_logits.available(h) else \
        ce_fast.gpu_compiled(_lse_and_pick, h.is_cuda)
    for s in range(0, n, step):
        e = min(s + step, n)
        lse_c, picked = lse_fn(F.linear(h2[row[s:e]], weight, bias), ids[s:e], acc)
        lse[s:e] = lse_c
        lp[s:e] = picked - lse_c
    return torch.where(parent >= 0, lp, torch.zeros_like(lp)), lse


# Tokens per block of the backward. Within a block the vocabulary is walked in slices of
# ``CHUNK_ELEMENTS // tokens`` rows, so each slice of the weight's gradient is one matrix
# product over the block's tokens, written once (summed over blocks when there are several):
# walking chunks of tokens over the whole vocabulary instead would add a [vocab, hidden] float32
# product into the gradient per chunk (13 GB of memory traffic per 900 tokens at a 152k vocab
# and hidden 4096). The hidden states' gradient [tokens, hidden] is what is summed over slices.
# 32k tokens: a step's usual 8k-32k tokens are one block (at 16k, a 17k-token step took a
# second block of 803 tokens, thin products, and a float32 weight gradient summed over both).
_TOKEN_BLOCK = 1 << 15
# Vocabulary slices are a multiple of this many rows: a [T, Vs] slice of the logits with Vs
# not a multiple of 8 makes cuBLAS fall back to unaligned kernels, several times slower.
_SLICE_ALIGN = 128


def _slice_grad(logits, lse, g, label, hit, acc: torch.dtype, out: torch.dtype):
    """d lp / d z · g on one [T, Vs] slice of the logits: ``g · (onehot(y) − softmax(z))``,
    the onehot where the label ``label`` (relative to the slice) lies in it (``hit``);
    computed in ``acc``, returned in ``out``. The onehot as a comparison with the slice's
    columns, not a scatter: Inductor makes it one kernel that reads the slice once and writes
    its gradient once (a scatter into the float32 product made it three passes)."""
    cols = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (cols[None, :] == label[:, None]) & hit[:, None]
    d = torch.exp(logits.to(acc) - lse[:, None]) * -g[:, None]
    return torch.where(onehot, d + g[:, None], d).to(out)


def _backward(grad, h, weight, bias, ids, parent, lse, need_h: bool, need_weight: bool,
              need_bias: bool, all_rows: bool = False, grad_into: torch.Tensor | None = None):
    """(d/d h, d/d weight, d/d bias); with ``grad_into`` (the weight's ``.grad``) the weight's
    gradient is added into it instead (the returned one is empty)."""
    acc = _acc(h)
    h2 = h.reshape(-1, h.shape[-1])
    ids = ids.reshape(-1)
    g = torch.where(parent >= 0, grad.to(acc), torch.zeros_like(grad, dtype=acc))
    dh = torch.zeros(h2.shape if need_h else (0,), dtype=acc, device=h.device)
    db = torch.zeros(weight.shape[0] if need_bias else 0, dtype=acc, device=h.device)
    # Only the tokens an objective trains carry a gradient: the others' logits are not rebuilt
    # (``all_rows``: the caller kept trained rows only; every row is taken, without the
    # host synchronization of finding the nonzero ones).
    tokens = torch.arange(g.shape[0], device=g.device) if all_rows else \
        torch.nonzero(g).reshape(-1)
    n_tok, n_vocab = tokens.shape[0], weight.shape[0]
    blocks = list(range(0, n_tok, _TOKEN_BLOCK))
    slice_grad = ce_fast.gpu_compiled(_slice_grad, h.is_cuda)
    # a slice's gradient in one pass by Triton (Inductor's fused form of _slice_grad ran far
    # below the memory rate); a bias's gradient sums it in float32: Inductor's
    triton = from_logits.available(h) and not need_bias
    # one block: each weight slice's gradient is written straight into the result (or added
    # straight into ``grad_into``); several: summed over blocks in ``acc``, then rounded once
    into = grad_into is not None and need_weight and len(blocks) <= 1
    dw = torch.zeros(weight.shape if need_weight and not into else (0,),
                     dtype=weight.dtype if len(blocks) <= 1 else acc, device=h.device)
    for b0 in blocks:
        t = tokens[b0:b0 + _TOKEN_BLOCK]
        rows = parent[t].clamp(min=0)  # a row without predecessor (all_rows) has g = 0
        hc = h2[rows]
        gt, yt, lse_t = g[t], ids[t], lse[t]
        dh_t = torch.zeros(hc.shape if need_h else (0,), dtype=acc, device=h.device)
        step = max(1, ce_fast.CHUNK_ELEMENTS // t.shape[0])
        if step > _SLICE_ALIGN:  # [T, Vs] slices whose rows the GPU's matmuls read aligned
            step -= step % _SLICE_ALIGN
        for v0 in range(0, n_vocab, step):
            v1 = min(v0 + step, n_vocab)
            w_s = weight[v0:v1]
            logits = F.linear(hc, w_s, None if bias is None else bias[v0:v1])
            hit = (yt >= v0) & (yt < v1)
            if triton:
                d = from_logits.own_rows_gradient(logits, lse_t, torch.where(hit, yt - v0, -1),
                                                  gt)
            else:
                d = slice_grad(logits, lse_t, gt, (yt - v0).clamp(0, v1 - v0 - 1), hit, acc,
                               acc if need_bias else weight.dtype)
            dc = d.to(weight.dtype)
            if need_h:
                ce_fast.add_mm_acc(dh_t, dc, w_s)
            if need_weight:
                if into:
                    grad_into[v0:v1].addmm_(dc.t(), hc)
                elif len(blocks) == 1:
                    torch.mm(dc.t(), hc, out=dw[v0:v1])
                else:
                    ce_fast.add_mm_acc(dw[v0:v1], dc.t(), hc)
            if need_bias:
                db[v0:v1] += d.sum(0)
        if need_h:
            dh.index_add_(0, rows, dh_t)
    if grad_into is not None and need_weight and not into:
        grad_into.add_(dw)
        dw = dw.new_zeros(0)
    return (dh.to(h.dtype).reshape(h.shape) if need_h else dh.to(h.dtype),
            dw.to(weight.dtype), db.to(weight.dtype))


@torch.library.custom_op("treefx::linear_tree_logprobs", mutates_args=())
def _linear_tree_logprobs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          ids: torch.Tensor, parent: torch.Tensor, all_rows: bool = False,
                          grad_into: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [N], log-sum-exp [N], kept for the backward)."""
    return _forward(h, weight, bias, ids, parent)


@_linear_tree_logprobs.register_fake
def _(h, weight, bias, ids, parent, all_rows=False, grad_into=None):
    n = parent.shape[0]
    return h.new_empty(n, dtype=_acc(h)), h.new_empty(n, dtype=_acc(h))


@torch.library.custom_op("treefx::linear_tree_logprobs_backward", mutates_args=())
def _linear_tree_logprobs_backward(grad: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None, ids: torch.Tensor,
                                   parent: torch.Tensor, lse: torch.Tensor, need_h: bool,
                                   need_weight: bool, need_bias: bool, all_rows: bool = False
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d/d h, d/d weight, d/d bias); each empty when not wanted."""
    return _backward(grad, h, weight, bias, ids, parent, lse, need_h, need_weight, need_bias,
                     all_rows)


@_linear_tree_logprobs_backward.register_fake
def _(grad, h, weight, bias, ids, parent, lse, need_h, need_weight, need_bias, all_rows=False):
    return (torch.empty_like(h) if need_h else h.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0] if need_bias else 0))


@torch.library.custom_op("treefx::linear_tree_logprobs_backward_into",
                         mutates_args=("grad_into",))
def _linear_tree_logprobs_backward_into(grad: torch.Tensor, h: torch.Tensor,
                                        weight: torch.Tensor, bias: torch.Tensor | None,
                                        ids: torch.Tensor, parent: torch.Tensor,
                                        lse: torch.Tensor, need_h: bool, need_bias: bool,
                                        all_rows: bool, grad_into: torch.Tensor
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d/d h, d/d bias), the weight's gradient added into ``grad_into``."""
    dh, _, db = _backward(grad, h, weight, bias, ids, parent, lse, need_h, True, need_bias,
                          all_rows, grad_into)
    return dh, db


@_linear_tree_logprobs_backward_into.register_fake
def _(grad, h, weight, bias, ids, parent, lse, need_h, need_bias, all_rows, grad_into):
    return (torch.empty_like(h) if need_h else h.new_empty(0),
            weight.new_empty(weight.shape[0] if need_bias else 0))


def _setup(ctx, inputs, output):
    h, weight, bias, ids, parent, all_rows, grad_into = inputs
    ctx.has_bias = bias is not None
    ctx.all_rows = all_rows
    ctx.save_for_backward(h, weight, bias, ids, parent, output[1])
    ctx.grad_into = grad_into  # written in place (not saved: its version changes)


def _grad(ctx, grad_lp, _grad_lse):
    h, weight, bias, ids, parent, lse = ctx.saved_tensors
    grad_into = ctx.grad_into
    need_h, need_weight, need_bias = ctx.needs_input_grad[:3]
    need_bias = bool(need_bias and ctx.has_bias)
    if grad_into is not None and need_weight:
        dh, db = _linear_tree_logprobs_backward_into(grad_lp, h, weight, bias, ids, parent, lse,
                                                     need_h, need_bias, ctx.all_rows, grad_into)
        dw, need_weight = None, False
    else:
        dh, dw, db = _linear_tree_logprobs_backward(grad_lp, h, weight, bias, ids, parent, lse,
                                                    need_h, need_weight, need_bias,
                                                    ctx.all_rows)
    return (dh if need_h else None, dw if need_weight else None, db if need_bias else None,
            None, None, None, None)


_linear_tree_logprobs.register_autograd(_grad, setup_context=_setup)


def fused_linear_tree_logprobs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               input_ids: torch.Tensor, parent_token: torch.Tensor,
                               all_rows: bool = False,
                               grad_into: torch.Tensor | None = None) -> torch.Tensor:
    """[N]: ``log softmax(h[parent_token[t]] W^T + b)[input_ids[t]]``, 0 where t has no
    predecessor, from hidden states ``h`` [.., N, D] and the output projection ``weight``
    [V, D] (``bias`` [V] or None), without materializing the logits; float32 (float64 for
    float64 inputs). Differentiable in ``h``, ``weight`` and ``bias`` for any upstream
    gradient [N]. ``all_rows``: the backward takes every row (else only those with a nonzero
    upstream gradient, found with a host synchronization), for a caller that keeps trained
    rows only (the parts of :func:`treefx.backward`). ``grad_into``: a tensor like ``weight``
    (its ``.grad``) into which the backward adds the weight's gradient, which autograd then
    does not get (:mod:`treefx.ops.grad_into`)."""
    return _linear_tree_logprobs(h, weight, bias, input_ids, parent_token, all_rows,
                                 grad_into)[0]


def fused_linear_tree_loss_and_logprobs_late(h: torch.Tensor, weight: torch.Tensor,
                                             bias: torch.Tensor | None, input_ids: torch.Tensor,
                                             parent_token: torch.Tensor, weights: torch.Tensor
                                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and log-probabilities of
    :func:`treefx.ops.cross_entropy.fused_linear_tree_loss_and_logprobs`, with the gradients
    made in the backward instead: the loss is ``-(weights · lp).sum()`` over the
    differentiable fused log-probabilities (:func:`fused_linear_tree_logprobs`, every row),
    whose backward builds each chunk's logits again (four products with the output weight,
    not three) and saves no [V, D] gradient from the forward. For the parts of
    :func:`treefx.backward` (``TREEFX_PART_LOSS_GRAD_LATE``): a part held for its backward then
    keeps no output-weight gradient. The same values and gradients up to rounding."""
    lp = fused_linear_tree_logprobs(h, weight, bias, input_ids, parent_token, True)
    valid = parent_token.reshape(-1) >= 0
    w = torch.where(valid, weights.detach().reshape(-1).to(lp.dtype), torch.zeros_like(lp))
    return -(w * lp).sum(), lp.detach()
