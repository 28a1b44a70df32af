"""Tree causal depthwise conv1d: over the whole tree (:mod:`.reference`, plain torch; :mod:`.fast`,
the row's conv fixed at node boundaries, one opaque op for traced graphs) and over a part of a
tree with its context (:mod:`.part`)."""

from .fast import boundary_taps, causal_conv1d_row, tree_causal_conv1d_fast
from .part import tree_causal_conv1d_context
from .reference import ancestor_table, tree_causal_conv1d

__all__ = ["ancestor_table", "boundary_taps", "causal_conv1d_row", "tree_causal_conv1d",
           "tree_causal_conv1d_context", "tree_causal_conv1d_fast"]
