"""Tree causal depthwise conv1d: over the whole tree (:mod:`.reference`, plain torch) and over
a part of a tree with its context (:mod:`.part`)."""

from .part import tree_causal_conv1d_context
from .reference import ancestor_table, tree_causal_conv1d

__all__ = ["ancestor_table", "tree_causal_conv1d", "tree_causal_conv1d_context"]
