"""The compiler: recognise what runs along the sequence in a captured graph and rewrite it
for the tree (see docs/ARCHITECTURE.md, "The compiler"). :func:`run_passes` runs it."""

from .checks.subgraphs import UnsupportedSubgraphError
from .graph import (
    GraphBreakError,
    GraphContext,
    Rewrite,
    SpecializedGraphError,
    TokenAxisError,
    TreeCompileError,
    UnmatchedAttentionError,
    UnmatchedStateError,
)
from .pipeline import run_passes

__all__ = [
    "GraphBreakError",
    "GraphContext",
    "Rewrite",
    "SpecializedGraphError",
    "TokenAxisError",
    "TreeCompileError",
    "UnmatchedAttentionError",
    "UnmatchedStateError",
    "UnsupportedSubgraphError",
    "run_passes",
]
