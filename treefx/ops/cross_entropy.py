"""Weighted tree cross-entropy fused with the output projection, in chunks of tokens.

``Σ_t w_t · (lse(h[p_t] W^T + b) − (h[p_t] W^T + b)[y_t])`` with ``p_t = parent_token[t]``:
token t is predicted from its tree predecessor's hidden state. The [N, V] logits are never
materialized: each chunk of tokens computes its logits, log-sum-exp and gradient and drops
them, so peak memory is one chunk's [C, V] in float32 on top of the hidden states.

A ``torch.library`` custom op with a registered backward: opaque to Inductor (which would
otherwise need the whole [N, V] tensor), traceable by AOTAutograd, any N.
"""

from __future__ import annotations

import torch

__all__ = ["fused_linear_tree_cross_entropy", "linear_tree_cross_entropy_reference"]

_CHUNK_ELEMENTS = 1 << 27  # logits per chunk: 128M floats (512 MiB in float32)


def _chunk(n_vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(n_vocab, 1))


def _acc(h: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.promote_types(h.dtype, torch.float32)


def _prepare(h, parent, ids, weights):
    valid = parent >= 0
    row = parent.clamp(min=0)
    w = torch.where(valid, weights.to(_acc(h)), torch.zeros_like(weights, dtype=_acc(h)))
    return h.reshape(-1, h.shape[-1]), row, ids.reshape(-1), w


@torch.library.custom_op("treefx::linear_tree_ce", mutates_args=())
def _linear_tree_ce(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    ids: torch.Tensor, parent: torch.Tensor, weights: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse per token) — lse is saved for the backward."""
    h2, row, ids, w = _prepare(h, parent, ids, weights)
    n = ids.shape[0]
    lse = torch.empty(n, dtype=_acc(h), device=h.device)
    total = torch.zeros((), dtype=_acc(h), device=h.device)
    step = _chunk(weight.shape[0])
    for s in range(0, n, step):
        e = min(s + step, n)
        hc = h2[row[s:e]]
        logits = torch.nn.functional.linear(hc, weight, bias).to(_acc(h))
        lse_c = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, ids[s:e, None])[:, 0]
        lse[s:e] = lse_c
        total += (w[s:e] * (lse_c - picked)).sum()
    return total, lse


@_linear_tree_ce.register_fake
def _(h, weight, bias, ids, parent, weights):
    return h.new_empty((), dtype=_acc(h)), h.new_empty(ids.numel(), dtype=_acc(h))


@torch.library.custom_op("treefx::linear_tree_ce_backward", mutates_args=())
def _linear_tree_ce_backward(grad: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, ids: torch.Tensor, parent: torch.Tensor,
                             weights: torch.Tensor, lse: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d h, d weight, d bias); d bias is empty when there is no bias."""
    h2, row, ids, w = _prepare(h, parent, ids, weights)
    n = ids.shape[0]
    acc = _acc(h)
    dh = torch.zeros(h2.shape, dtype=acc, device=h.device)
    dw = torch.zeros(weight.shape, dtype=acc, device=h.device)
    db = torch.zeros(weight.shape[0] if bias is not None else 0, dtype=acc, device=h.device)
    scale = w * grad.to(acc)
    step = _chunk(weight.shape[0])
    for s in range(0, n, step):
        e = min(s + step, n)
        hc = h2[row[s:e]]
        logits = torch.nn.functional.linear(hc, weight, bias).to(acc)
        d = torch.exp(logits - lse[s:e, None])  # softmax
        d[torch.arange(e - s, device=h.device), ids[s:e]] -= 1.0
        d *= scale[s:e, None]
        dc = d.to(weight.dtype)
        dh.index_add_(0, row[s:e], (dc @ weight).to(acc))
        dw += (dc.t() @ hc).to(acc)
        if bias is not None:
            db += d.sum(0)
    return dh.to(h.dtype).reshape(h.shape), dw.to(weight.dtype), db.to(weight.dtype)


@_linear_tree_ce_backward.register_fake
def _(grad, h, weight, bias, ids, parent, weights, lse):
    return (torch.empty_like(h), torch.empty_like(weight),
            weight.new_empty(weight.shape[0] if bias is not None else 0))


def _setup(ctx, inputs, output):
    h, weight, bias, ids, parent, weights = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(h, weight, bias if bias is not None else weight.new_empty(0), ids,
                          parent, weights, output[1])


def _backward(ctx, grad_loss, grad_lse):
    h, weight, bias, ids, parent, weights, lse = ctx.saved_tensors
    dh, dw, db = _linear_tree_ce_backward(grad_loss, h, weight,
                                          bias if ctx.has_bias else None, ids, parent,
                                          weights, lse)
    return dh, dw, (db if ctx.has_bias else None), None, None, None


_linear_tree_ce.register_autograd(_backward, setup_context=_setup)


def fused_linear_tree_cross_entropy(h: torch.Tensor, weight: torch.Tensor,
                                    bias: torch.Tensor | None, input_ids: torch.Tensor,
                                    parent_token: torch.Tensor, weights: torch.Tensor
                                    ) -> torch.Tensor:
    """The weighted tree loss from hidden states [.., N, D] and the output projection
    ``weight`` [V, D] (``bias`` [V] or None), without materializing the logits. Gradients flow
    to ``h``, ``weight`` and ``bias``; ``weights`` are constants (the tree's loss weights)."""
    loss, _ = _linear_tree_ce(h, weight, bias, input_ids, parent_token, weights.detach())
    return loss


def linear_tree_cross_entropy_reference(h, weight, bias, input_ids, parent_token, weights):
    """Plain autograd version (materializes the logits): the reference the fused op is tested
    against."""
    from ..passes.loss import tree_cross_entropy

    logits = torch.nn.functional.linear(h, weight, bias).to(_acc(h))
    return tree_cross_entropy(logits, input_ids, parent_token, weights)
