"""Every import of a treefx module outside its public API, in one place.

The benchmarks build block masks and call treefx's attention op directly (to time them alone
and to build the hand-written baselines from the same pieces); those live in modules the
package may rename. When they move, this file is the one to change.
"""

from treefx.mask import (  # noqa: F401
    block_indices,
    dense_tree_mask,
    tree_block_mask,
    tree_block_tensors,
    tree_mask_mod,
)
from treefx.ops.attention import flex as attention_ops  # noqa: F401  (kernel options: --tma)
from treefx.ops.attention import (  # noqa: F401
    TreeFlexAttention,
    heads_to_row,
    interleaved_block_mask,
    row_to_heads,
)


def recurrence_registry() -> dict:
    """The registered recurrences (name -> Recurrence), to tell which have a varlen fast path."""
    from treefx.compiler.recurrences import all_recurrences

    return all_recurrences()
