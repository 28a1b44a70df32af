"""treefx: train LLMs on prefix trees of agent trajectories, computing every shared prefix once."""

import logging

from . import debug, reference, rl, synth
from .compile import TreeModel, TreeOutput, compile, tree_loss
from .debug import explain
from .layout import TreeBatch, pack
from .partition import err, partition, partition_ids
from .passes import (
    GraphBreakError,
    TreeCompileError,
    UnmatchedAttentionError,
    UnmatchedStateError,
    UnsupportedSubgraphError,
)
from .recurrence import Recurrence, register_recurrence
from .step import TreeStep, step
from .tree import Tree, bound, por, read_jsonl, write_jsonl
from .verification import TreeVerificationError, VerificationReport, probe_forest, verify

__version__ = "0.1.0"

# Quiet unless the application configures logging (logger "treefx").
logging.getLogger("treefx").addHandler(logging.NullHandler())

__all__ = [
    "GraphBreakError",
    "Tree",
    "TreeBatch",
    "TreeCompileError",
    "TreeModel",
    "TreeOutput",
    "TreeStep",
    "TreeVerificationError",
    "VerificationReport",
    "Recurrence",
    "register_recurrence",
    "UnmatchedAttentionError",
    "UnmatchedStateError",
    "UnsupportedSubgraphError",
    "bound",
    "compile",
    "debug",
    "err",
    "explain",
    "pack",
    "partition",
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
