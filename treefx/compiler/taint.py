"""What a value of the graph depends on: the tokens' data, their positions, the tree's
structure, or nothing per token (read by the token-axis check and by the recognisers that ask
whether a mask depends on the tokens' hidden states)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph import GraphContext, is_call

__all__ = ["DATA", "POSITION", "TREE", "Taint", "is_treefx"]

# What a value depends on: the tokens' data (input_ids and everything computed from them),
# their positions (an index grid), the tree's structure (parent_token, subtree_end), or
# nothing per token (parameters, constants, shapes).
DATA, POSITION, TREE = "data", "position", "tree"

# Calls whose result depends only on the shape of their tensor argument.
_SHAPE_ONLY = (torch.ones_like, torch.zeros_like, torch.empty_like, torch.full_like,
               torch.rand_like, torch.randn_like)
_SHAPE_ONLY_METHODS = ("new_ones", "new_zeros", "new_empty", "new_full", "size", "dim",
                       "numel", "new_tensor")


def is_treefx(node: fx.Node) -> bool:
    """A node treefx inserted (tree ops, block tensors) or reads its tree rows with."""
    t = node.target
    if node.op != "call_function":
        return False
    mod = getattr(t, "__module__", "") or getattr(type(t), "__module__", "") or ""
    if mod.startswith("treefx"):
        return True
    name = getattr(t, "__name__", "") or str(t)
    if "treefx" in name or getattr(t, "namespace", None) == "treefx":  # torch.ops.treefx.*
        return True
    if t is operator.getitem and isinstance(node.args[0], fx.Node):
        return is_treefx(node.args[0])
    return False


class Taint:
    """Per node: the set of {DATA, POSITION, TREE} it depends on."""

    def __init__(self, ctx: GraphContext):
        self.ctx = ctx
        self.memo: dict[fx.Node, frozenset] = {}

    def of(self, node) -> frozenset:
        if not isinstance(node, fx.Node):
            return frozenset()
        if node in self.memo:
            return self.memo[node]
        ctx = self.ctx.root
        # A body's placeholder resolves through the body's context (the root's cannot see it).
        outer = self.ctx.resolve(node) if node.op == "placeholder" else node
        if outer is not node:
            out = self.of(outer)
        elif node.op == "placeholder":
            if ctx.is_tree_input(node, "input_ids"):
                out = frozenset({DATA})
            elif ctx.is_tree_input(node, "tree_info"):
                out = frozenset({POSITION, TREE})
            elif node.graph is not ctx.graph:
                out = frozenset({DATA})  # a body input whose callers disagree: assume the worst
            else:
                out = frozenset()  # parameters, buffers, sizes, loss weights
        elif node.op == "get_attr":
            out = frozenset()
        elif self._tree_row(node) is not None:
            out = frozenset({self._tree_row(node)})
        elif is_call(node, *_SHAPE_ONLY, methods=_SHAPE_ONLY_METHODS):
            out = frozenset()
        elif is_call(node, torch.arange):
            out = frozenset({POSITION})
        else:
            out = frozenset().union(*(self.of(a) for a in node.all_input_nodes))
        self.memo[node] = out
        return out

    def _tree_row(self, node: fx.Node):
        """POSITION or TREE when ``node`` reads one row of ``tree_info``."""
        if node.op != "call_function" or not node.args:
            return None
        src = node.args[0]
        if not (isinstance(src, fx.Node) and self.ctx.root.is_tree_input(src, "tree_info")):
            return None
        key = node.args[1] if len(node.args) > 1 else None
        if isinstance(key, int):
            return POSITION if key == 0 else TREE
        if isinstance(key, slice) and key.start in (None, 0) and key.stop == 1:
            return POSITION
        if isinstance(key, tuple) and key and isinstance(key[0], int):
            return POSITION if key[0] == 0 else TREE
        return None
