"""Per-token log-probabilities on the tree from hidden states and the output projection: the
plain-torch reference on materialized logits (:mod:`.reference`), the fused op that never
materializes them (:mod:`.fast`), the graph node a compiled model's ``logits=False`` is
captured as (:mod:`.site`), and the log-probabilities read from materialized logits on the GPU
in one pass each way (:mod:`.from_logits`)."""

from .fast import fused_linear_tree_logprobs, fused_linear_tree_loss_and_logprobs_late
from .from_logits import tree_logprobs_from_logits
from .reference import linear_tree_logprobs_reference
from .site import register_site, token_logprobs_site, token_loss_site

__all__ = ["fused_linear_tree_logprobs", "fused_linear_tree_loss_and_logprobs_late",
           "linear_tree_logprobs_reference", "register_site",
           "token_logprobs_site", "token_loss_site", "tree_logprobs_from_logits"]
