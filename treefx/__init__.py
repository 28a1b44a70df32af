"""treefx: train LLMs on prefix trees of agent trajectories, computing every shared prefix once."""

from .layout import TreeBatch, pack
from .tree import Tree, bound, por, read_jsonl, write_jsonl

__version__ = "0.1.0"

__all__ = ["Tree", "TreeBatch", "bound", "pack", "por", "read_jsonl", "write_jsonl"]
