"""Per-token log-probabilities on the tree in plain torch, from materialized logits: the
reference of the fused op (:mod:`.fast`)."""

from __future__ import annotations

import torch.nn.functional as F

from ..cross_entropy.reference import tree_token_logprobs

__all__ = ["linear_tree_logprobs_reference"]


def linear_tree_logprobs_reference(h, weight, bias, input_ids, parent_token):
    """Plain autograd version (materializes the logits): the reference the fused op is tested
    against."""
    return tree_token_logprobs(F.linear(h, weight, bias), input_ids, parent_token)
