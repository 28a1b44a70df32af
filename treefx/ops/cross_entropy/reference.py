"""The tree loss in plain torch, from materialized logits: each token predicted from its tree
predecessor ``parent_token[t]``.

:func:`tree_token_logprobs` and :func:`tree_cross_entropy` read materialized logits (the
reference, and the path when the logits feed more than the loss);
:func:`linear_tree_cross_entropy_reference` is the plain autograd form of the fused op
(:mod:`.fast`), which never materializes the logits.
"""

from __future__ import annotations

import torch

__all__ = [
    "linear_tree_cross_entropy_reference",
    "tree_cross_entropy",
    "tree_cross_entropy_and_logprobs",
    "tree_token_logprobs",
    "weighted_logprob_loss",
]


def tree_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                        parent_token: torch.Tensor) -> torch.Tensor:
    """[N]: log softmax(logits[parent_token[t]])[input_ids[t]], 0 where t has no predecessor;
    float32 (float64 for float64 logits).

    Reads each logit row once for its log-sum-exp and gathers one logit per token: no
    float32 copy of the [N, V] logits is needed (Inductor fuses the upcast into the reduction).
    """
    lg = logits.reshape(-1, logits.shape[-1])
    acc = torch.promote_types(lg.dtype, torch.float32)
    row = parent_token.clamp(min=0)
    lse = torch.logsumexp(lg.to(acc), dim=-1)
    picked = lg[row, input_ids.reshape(-1)].to(acc) - lse[row]
    return torch.where(parent_token >= 0, picked, torch.zeros_like(picked))


def weighted_logprob_loss(token_logprobs: torch.Tensor, loss_weights: torch.Tensor) -> torch.Tensor:
    """``Σ_t loss_weights[t] · (−token_logprobs[t])``: the tree loss from per-token
    log-probabilities and the batch's loss weights (:func:`treefx.pack`)."""
    w = loss_weights.to(device=token_logprobs.device, dtype=token_logprobs.dtype)
    return -(w * token_logprobs).sum()


def tree_cross_entropy(logits: torch.Tensor, input_ids: torch.Tensor, parent_token: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
    """Σ_t weights[t] · (−log softmax(logits[parent_token[t]])[input_ids[t]]), over tokens with
    a predecessor (see :func:`tree_token_logprobs`)."""
    lp = tree_token_logprobs(logits, input_ids, parent_token)
    return -(weights.to(lp.dtype) * lp).sum()


def tree_cross_entropy_and_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                                    parent_token: torch.Tensor, weights: torch.Tensor
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`tree_cross_entropy`, the tokens' log-probabilities detached): the plain form of
    :func:`.fast.fused_linear_tree_loss_and_logprobs`."""
    lp = tree_token_logprobs(logits, input_ids, parent_token)
    return -(weights.to(lp.dtype) * lp).sum(), lp.detach()


def linear_tree_cross_entropy_reference(h, weight, bias, input_ids, parent_token, weights):
    """Plain autograd version (materializes the logits): the reference the fused op is tested
    against."""
    logits = torch.nn.functional.linear(h, weight, bias).to(
        torch.promote_types(h.dtype, torch.float32))
    return tree_cross_entropy(logits, input_ids, parent_token, weights)
