"""Tree recurrence: a chunked/recurrent state kernel over a DFS-packed tree, each node from its
parent node's final state. The per-depth runner in plain torch (:mod:`.reference`), the opaque
custom op that traced graphs call (:mod:`.traced`), and both for a part of a tree
(:mod:`.part`)."""

from .part import TracedTreeRecurrencePart, tree_recurrence_part
from .reference import (Recurrence, kernel_runs, padding_is_neutral, tree_nodes,
                        tree_recurrence)
from .traced import TracedTreeRecurrence, backward_paths, register_site

__all__ = ["Recurrence", "TracedTreeRecurrence", "TracedTreeRecurrencePart", "backward_paths",
           "kernel_runs", "padding_is_neutral", "register_site", "tree_nodes",
           "tree_recurrence", "tree_recurrence_part"]
