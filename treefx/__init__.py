"""treefx: train LLMs on prefix trees of agent trajectories, computing every shared prefix once."""

import logging

from . import data, debug, distributed, parts, reference, rl, synth
from ._version import __version__
from .debug import explain
from .compiler import (
    GraphBreakError,
    TreeCompileError,
    UnmatchedAttentionError,
    UnmatchedStateError,
    UnsupportedSubgraphError,
)
from .compiler.recurrences import Recurrence, register_recurrence
from .layout import TreeBatch, pack
from .part_run import backward
from .partition import err, partition, partition_ids
from .step import TreeStep, step
from .tree import Tree, bound, por, read_jsonl, write_jsonl
from .tree_model import TreeModel, TreeOutput, compile, tree_loss, verify
from .verification import Tolerance, TreeVerificationError, VerificationReport, probe_forest

# Quiet unless the application configures logging (logger "treefx").
logging.getLogger("treefx").addHandler(logging.NullHandler())

__all__ = [
    "__version__",
    "GraphBreakError",
    "Tree",
    "TreeBatch",
    "TreeCompileError",
    "TreeModel",
    "TreeOutput",
    "TreeStep",
    "Tolerance",
    "TreeVerificationError",
    "VerificationReport",
    "Recurrence",
    "register_recurrence",
    "UnmatchedAttentionError",
    "UnmatchedStateError",
    "UnsupportedSubgraphError",
    "backward",
    "bound",
    "compile",
    "data",
    "debug",
    "distributed",
    "err",
    "explain",
    "pack",
    "partition",
    "parts",
    "partition_ids",
    "por",
    "probe_forest",
    "read_jsonl",
    "reference",
    "rl",
    "step",
    "synth",
    "tree_loss",
    "verify",
    "write_jsonl",
]
