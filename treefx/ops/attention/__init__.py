"""Tree attention: the plain-torch reference (:mod:`.reference`), FlexAttention over the tree
(:mod:`.flex`) and the variants for a part of a tree (:mod:`.part`)."""

from .flex import (
    STANDARD_KERNEL,
    FlexSite,
    TreeFlexAttention,
    check_interleave_heads,
    check_kernel_options,
    heads_to_row,
    identity_score,
    interleave_block_tensors,
    interleave_wanted,
    interleaved_block_mask,
    row_to_heads,
    standard_kernel_options,
)
from .part import TreePartAttention, TreePartFlexAttention, ones_for_positions
from .reference import TreeScoredAttention, sink_rescale, tree_attention_dense

__all__ = [
    "FlexSite",
    "STANDARD_KERNEL",
    "TreeFlexAttention",
    "TreePartAttention",
    "TreePartFlexAttention",
    "TreeScoredAttention",
    "check_interleave_heads",
    "check_kernel_options",
    "heads_to_row",
    "identity_score",
    "interleave_block_tensors",
    "interleave_wanted",
    "interleaved_block_mask",
    "ones_for_positions",
    "row_to_heads",
    "sink_rescale",
    "standard_kernel_options",
    "tree_attention_dense",
]
