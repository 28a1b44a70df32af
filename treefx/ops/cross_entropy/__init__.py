"""The tree loss: the plain-torch forms on materialized logits (:mod:`.reference`) and the loss
fused with the output projection, in chunks of tokens (:mod:`.fast`; its chunk budget,
``fast.CHUNK_ELEMENTS``, is read at call time from that module and is not re-exported here)."""

from .fast import fused_linear_tree_cross_entropy, fused_linear_tree_loss_and_logprobs
from .reference import (
    linear_tree_cross_entropy_reference,
    tree_cross_entropy,
    tree_cross_entropy_and_logprobs,
    tree_token_logprobs,
    weighted_logprob_loss,
)

__all__ = [
    "fused_linear_tree_cross_entropy",
    "fused_linear_tree_loss_and_logprobs",
    "linear_tree_cross_entropy_reference",
    "tree_cross_entropy",
    "tree_cross_entropy_and_logprobs",
    "tree_token_logprobs",
    "weighted_logprob_loss",
]
