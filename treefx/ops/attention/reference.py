"""Tree attention in plain torch: query ``q`` sees key ``k`` iff ``k <= q < subtree_end[k]``.

- :func:`tree_attention_dense`: SDPA with the dense [N, N] boolean mask (CPU, reference,
  differentiable everywhere), ANDed with the model's own mask evaluated at path positions (so
  a sliding window or any other position-based mask stays exact per sequence);
- :class:`TreeScoredAttention`: the same for a model that transforms its scores itself
  (softcap, bias) before the softmax, returning the log-sum-exp too;
- :func:`sink_rescale`: an attention sink from the plain attention's output and log-sum-exp.

The GPU form is :mod:`.flex` (FlexAttention with a block mask); a part of a tree over its
context is :mod:`.part`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["tree_attention_dense", "TreeScoredAttention", "sink_rescale"]


def tree_attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tree_mask: torch.Tensor,
    model_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA over the tree: ``tree_mask`` [N, N] bool (from :func:`dense_tree_mask`) ANDed with
    the model's own mask (boolean, or additive float), which must already be evaluated at path
    positions."""
    mask = tree_mask
    if model_mask is not None:
        if model_mask.dtype == torch.bool:
            mask = mask & model_mask
        else:
            mask = model_mask.masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )


class TreeScoredAttention:
    """Dense tree attention for a model that transforms its scores itself before the softmax
    (a ``tanh`` softcap, a bias, a second mask): ``score_fn(scores, *sides)`` replays the
    model's own ops from ``q @ k^T`` to its softmax input, ``sides`` being the other tensors
    those ops read (the model's masks, evaluated at path positions). The tree mask is applied
    last, to the softmax input, so every key a query does not see gets probability 0 whatever
    the model did to the scores.

    Called ``(scores, v, tree_mask, *sides)`` with the model's ``q @ k^T``; returns
    ``(out, lse)``: the attention output in ``v``'s dtype and the natural log-sum-exp of each
    query's row (float32 or wider), which attention sinks and models that use it read.
    """

    def __init__(self, score_fn, *, name: str = "tree_scored_attention"):
        self.score_fn = score_fn
        self.__name__ = name

    def __call__(self, scores, v, tree_mask, *sides):
        s = self.score_fn(scores, *sides)
        s = s.to(torch.promote_types(s.dtype, torch.float32))
        s = s.masked_fill(~tree_mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)
        return out, lse

    def __repr__(self) -> str:
        return self.__name__


def sink_rescale(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Attention with a *sink*: one more logit ``sink`` [B, H, N, 1] in each query's softmax
    that takes probability but has no value. Its softmax over ``[scores, sink]`` is the
    softmax over the scores times ``Z / (Z + e^sink) = sigmoid(lse - sink)``, so the sink needs
    only the plain attention's output and log-sum-exp (in float32)."""
    w = torch.sigmoid(lse.float() - sink.squeeze(-1).float())
    return out * w.unsqueeze(-1).to(out.dtype)
