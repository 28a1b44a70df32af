"""Lifting: the subgraph that computes a mask (or a value the scores read) from index sources
found, classified (index vectors, filled tensors, their reductions) and copied into a private
graph, a :class:`LiftedMask` of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph import KEY_SELECTION, GraphContext, describe, example, is_call
from ..taint import DATA, Taint
from .applications import is_zero, very_negative
from .fills import keeps_uniform, reduces_uniform, uniform_fill
from .lifted import TABLE, LiftedMask, MaskLiftError

__all__ = ["leaves_of", "lift_mask", "lift_value"]


def _is_index_source(ctx: GraphContext, node) -> bool:
    if node.meta.get(TABLE):
        return False
    return ctx.is_tree_input(node, "positions") or is_call(node, torch.arange)


def lift_mask(ctx: GraphContext, mask: fx.Node) -> tuple[LiftedMask, tuple[fx.Node, ...]]:
    """The mask_mod of ``mask`` and the graph nodes to pass it as buffers.

    The subgraph is followed through the placeholders of higher-order-op bodies into the
    graphs that call them (a checkpointed layer receives the mask its model built outside),
    so buffers may be nodes of an enclosing graph: ``ctx.local`` makes them this graph's."""
    mask = ctx.resolve(mask)
    val = example(mask)
    if val is None or val.dim() < 2:
        raise MaskLiftError("the mask has no recorded shape")
    negate = False
    if val.dtype != torch.bool:
        # Additive masks the usual way: where(allowed, 0, -big), or where(blocked, -big, 0)
        # (a triu of -inf). The -big must really be -big: anything else is a bias, not a mask.
        if not is_call(mask, torch.where) or len(mask.args) < 3:
            raise MaskLiftError(f"it is an additive float mask made by `{describe(mask)}`, which "
                                "may carry a bias, not only -inf")
        cond, a, b = (ctx.resolve(x) for x in mask.args[:3])
        if is_zero(ctx, a) and very_negative(ctx, b):
            mask = cond
        elif very_negative(ctx, a) and is_zero(ctx, b):
            mask, negate = cond, True
        else:
            raise MaskLiftError(f"it is an additive float mask made by `{describe(mask)}` whose "
                                "values are not only 0 and -inf: it may carry a bias")
        if example(mask) is None or example(mask).dtype != torch.bool:
            raise MaskLiftError("the additive mask's condition is not boolean")
    return _snapshot(ctx, mask, negate=negate)


def lift_value(ctx: GraphContext, node: fx.Node) -> tuple[LiftedMask, tuple[fx.Node, ...]]:
    """Like :func:`lift_mask` for a tensor of any dtype that a model combines elementwise with
    its attention scores (an additive mask, a bias): ``(b, h, q_pos, kv_pos, *buffers)`` -> its
    value there. A tensor that depends on no index (a 0-d constant) is read whole, so it must
    hold one element."""
    node = ctx.resolve(node)
    val = example(node)
    if not isinstance(val, torch.Tensor):
        raise MaskLiftError(f"`{describe(node)}` has no recorded value")
    lifted, leaves = _snapshot(ctx, node, boolean=False)
    if lifted.mask in lifted.leaves and val.numel() != 1:
        raise MaskLiftError(f"`{describe(node)}` (shape {tuple(val.shape)}) is read by the "
                            "scores but is not a function of the query and key positions")
    return lifted, leaves


def _snapshot(ctx: GraphContext, mask: fx.Node, *, negate: bool = False,
              boolean: bool = True) -> tuple[LiftedMask, tuple[fx.Node, ...]]:
    """The subgraph computing ``mask`` from index sources, copied into a private graph."""
    sub = _Subgraph.of(ctx, mask)
    # Snapshot the subgraph into a private graph: the attention pass removes the original
    # nodes once the attention no longer reads the mask.
    copy = _PrivateCopy(ctx.root_node("positions"))
    _refuse_token_data(ctx, sub)
    for n in sub.order:
        copy.node(ctx, n, sub.dep)
    if mask not in copy.copies:  # depends on no index: one buffer, read whole
        copy.outer(mask)
    copies, positions = copy.copies, copy.positions
    lifted = LiftedMask(copies[positions] if positions in copies else None,
                        copies[mask], [copies[n] for n in copy.leaves],
                        dep={copies[n] for n in sub.dep},
                        vectors={copies[n] for n in sub.vectors},
                        uniform={copies[n] for n in sub.uniform},
                        fills={copies[n] for n in sub.order if uniform_fill(n) is not None},
                        reductions={copies[n] for n in sub.reductions},
                        negate=negate, boolean=boolean)
    return lifted, tuple(copy.leaves)


@dataclass
class _Subgraph:
    """The nodes ``mask`` is computed from (``order``: inputs first), and which of them depend
    on an index source (``dep``), are still 1-D vectors (``vectors``), have the same value at
    every index (``uniform``: a uniform constructor's, elementwise) or reduce a filled tensor
    to its value (``reductions``)."""

    order: list = field(default_factory=list)
    dep: set = field(default_factory=set)
    vectors: set = field(default_factory=set)
    uniform: set = field(default_factory=set)
    reductions: set = field(default_factory=set)

    @classmethod
    def of(cls, ctx: GraphContext, mask: fx.Node) -> _Subgraph:
        sub = cls(order=_inputs_first(ctx, mask))
        for n in sub.order:
            sub.classify(ctx, n)
        return sub

    def classify(self, ctx: GraphContext, n: fx.Node) -> None:
        dep, vectors, uniform = self.dep, self.vectors, self.uniform
        ins = [ctx.resolve(a) for a in n.all_input_nodes]
        if uniform_fill(n) is not None:
            dep.add(n)
            uniform.add(n)
        elif _is_index_source(ctx, n):
            dep.add(n)
            vectors.add(n)
        elif any(a in uniform for a in ins) and reduces_uniform(n, ctx):
            dep.add(n)  # its value is its filled input's (Llama 4's zeros_like(..).sum(-1))
            uniform.add(n)
            self.reductions.add(n)
        elif any(a in uniform for a in ins) and not keeps_uniform(n):
            raise MaskLiftError(f"`{describe(n)}` reads a filled tensor other than "
                                "elementwise")
        elif any(a in dep for a in ins) and all(a in uniform for a in ins if a in dep):
            dep.add(n)
            uniform.add(n)
        elif any(ctx.resolve(a) in dep for a in n.all_input_nodes):
            dep.add(n)
            v = example(n)
            if isinstance(v, torch.Tensor) and v.dim() == 1 and all(
                ctx.resolve(a) in vectors for a in n.all_input_nodes if ctx.resolve(a) in dep
            ):
                vectors.add(n)


def _inputs_first(ctx: GraphContext, mask: fx.Node) -> list[fx.Node]:
    """The nodes ``mask`` is computed from and ``mask``, each after its inputs (a table and a
    uniform constructor without theirs)."""
    order = []
    seen = set()

    def visit(n):
        if not isinstance(n, fx.Node) or n in seen:
            return
        seen.add(n)
        if n.meta.get(KEY_SELECTION):
            raise MaskLiftError(f"`{describe(n)}` holds the keys an indexer selected, which "
                                "are data, not a function of positions")
        # A table is read whole, however it was computed; a uniform constructor's inputs give
        # it only a shape.
        if not n.meta.get(TABLE) and uniform_fill(n) is None:
            for a in n.all_input_nodes:
                visit(ctx.resolve(a))
        order.append(n)

    visit(mask)
    return order


def _refuse_token_data(ctx: GraphContext, sub: _Subgraph) -> None:
    taint = Taint(ctx)
    for a in leaves_of(sub.order, sub.dep):
        v = example(a)
        if DATA in taint.of(a) and isinstance(v, torch.Tensor) and v.numel() != 1:
            # Its index grids are path positions (the positions pass), so it would look a
            # value per token up at a position instead of the token's own row.
            raise MaskLiftError(f"it reads `{describe(a)}`, computed from the tokens' data (a "
                                "flag per token, such as `input_ids != pad_token_id`?), at "
                                "query or key indices, which are path positions on a tree")


class _PrivateCopy:
    """The private graph the subgraph is copied into: ``copies`` (each original node's copy),
    ``leaves`` (the tensors from outside it, its buffers), ``positions`` (the root graph's
    positions node, a placeholder of it but no buffer)."""

    def __init__(self, positions: fx.Node | None):
        self.graph = fx.Graph()
        self.copies: dict = {}
        self.leaves: list = []
        self.positions = positions

    def outer(self, a: fx.Node) -> fx.Node:
        # A value from outside the subgraph: a placeholder of the private graph.
        if a not in self.copies:
            ph = self.graph.placeholder(a.name)
            ph.meta = dict(a.meta)
            self.copies[a] = ph
            if a is not self.positions and isinstance(example(a), torch.Tensor):
                self.leaves.append(a)
        return self.copies[a]

    def node(self, ctx: GraphContext, n: fx.Node, dep: set) -> None:
        def arg(a: fx.Node) -> fx.Node:
            a = ctx.resolve(a)
            return self.copies[a] if a in self.copies else self.outer(a)

        fill = uniform_fill(n)
        if fill is not None:  # its one value, as a 0-d tensor of its dtype
            self.copies[n] = self.graph.call_function(torch.full, ((), fill),
                                                      {"dtype": example(n).dtype})
            self.copies[n].meta = dict(n.meta)
        elif n in dep and n is not self.positions:
            self.copies[n] = self.graph.node_copy(n, arg)
        elif n is self.positions:
            self.outer(n)


def leaves_of(order, dep) -> list:
    """The nodes outside ``dep`` that nodes of ``dep`` read (the lifted mask's buffers)."""
    out = []
    for n in order:
        if n in dep and uniform_fill(n) is None:
            out.extend(a for a in n.all_input_nodes if a not in dep and a not in out)
    return out

