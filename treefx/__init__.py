"""treefx: train LLMs on prefix trees of agent trajectories, computing every shared prefix once."""

import importlib
import logging

from . import data, distributed, parts, reference, rl
from ._version import __version__
from .compiler import (
    GraphBreakError,
    TreeCompileError,
    UnmatchedAttentionError,
    UnmatchedStateError,
    UnsupportedSubgraphError,
)
from .compiler.recurrences import Recurrence, register_recurrence
from .layout import TreeBatch, pack
from .partition import err, partition, partition_ids
from .run.parts import backward
from .run.model import TreeModel, TreeOutput, compile, tree_loss, verify
from .run.step import TreeStep, step
from .tree import Tree, bound, por, read_jsonl, write_jsonl
from .verification import Tolerance, TreeVerificationError, VerificationReport, probe_forest

# Quiet unless the application configures logging (logger "treefx").
logging.getLogger("treefx").addHandler(logging.NullHandler())

# The tools (treefx.tools) are no part of the core, and ``import treefx`` does not load them:
# these names import them on first use (PEP 562).
_LAZY = {
    "debug": ("treefx.tools.debug", None),
    "explain": ("treefx.tools.debug", "explain"),
    "synth": ("treefx.tools.synth", None),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # later look-ups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

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
