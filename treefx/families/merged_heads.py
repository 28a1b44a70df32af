"""Merged heads (Bloom, XGLM, ...): attention computed over [B·H, N, D] rows becomes [B, H, N,
D] attention, in the compiler's "heads" pass (:mod:`treefx.compiler.registry`).

Bloom, the BART-style decoders (MVP, TrOCR, XGLM) and GPT-NeoX-Japanese merge the batch and
head axes before their score product::

    q3 = q.reshape(B * H, N, D)                    # q: [B, H, N, D]
    s = torch.bmm(q3, k3.transpose(1, 2))          # or bias.baddbmm(q3, k3^T, beta=, alpha=)
    s = (s.view(B, H, N, N) + mask).view(B * H, N, N)
    p = softmax(s, dim=-1)
    o = torch.bmm(p, v3)                           # [B * H, N, D]

The attention pass matches the [B, H, N, D] form, whose head axis it keeps apart from the
batch. This pass rewrites such a region into that form: every tensor of the score chain is
replaced by its [B, H, ...] equivalent (the merged index ``b * H + h`` split back into ``(b,
h)``, the order the model merged them in), a ``baddbmm`` becomes ``beta * bias + alpha * (q @
k^T)``, and the output is merged again for the model's own code after it. Nothing else
changes: the new region computes the same values (up to the rounding of the split
``baddbmm``), and the old one is left unread for dead-code elimination.

A region is rewritten only when it is closed: every value of the chain is read only by the
chain (no attention weights returned), its ops are elementwise, casts, the softmax over the
keys, dropout and the views between the two forms, and it ends in one product with values.
Anything else stays as it was, and the attention pass then refuses it with the node named.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..compiler.graph import GraphContext, arg, describe, example, is_call, same_size, set_example
from ..compiler.patterns import CASTS, DROPOUT, OUT_OF_PLACE, SOFTMAX, is_pointwise
from ..compiler.registry import register_rewrite

__all__ = ["merged_heads_pass"]

_VIEWS = (torch.reshape,)
_VIEW_METHODS = ("view", "reshape")
_BMM = (torch.bmm, torch.baddbmm)
_PRODUCTS = (torch.bmm, torch.matmul, operator.matmul)
_ZEROS = (torch.zeros, torch.zeros_like)


def _elementwise(node) -> bool:
    """An out-of-place elementwise op of a score chain, a cast, the softmax or dropout (the
    attention pass's own list; in-place ones are left alone)."""
    if node.op == "call_function" and node.target in OUT_OF_PLACE:
        return False
    return is_pointwise(node) or is_call(node, *SOFTMAX, *DROPOUT,
                                         methods=("softmax", *CASTS))


class _NotMerged(Exception):
    """This region is not a closed merged-heads attention; leave it as it is."""


def _shape(node) -> tuple | None:
    val = example(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _split_of(node) -> tuple[fx.Node, bool] | None:
    """``(x4, transposed)`` when ``node`` is ``x4`` [B, H, X, Y] with its first two axes
    merged (a view or reshape), or that merge with its last two axes transposed."""
    if is_call(node, torch.transpose, methods=("transpose",)):
        s = _shape(node)
        if s is None or len(s) != 3 or {d % 3 for d in node.args[1:3]} != {1, 2}:
            return None
        inner = _split_of(node.args[0])
        return None if inner is None else (inner[0], not inner[1])
    if not is_call(node, *_VIEWS, methods=_VIEW_METHODS):
        return None
    src, s, s4 = node.args[0], _shape(node), _shape(node.args[0])
    if s is None or s4 is None or len(s) != 3 or len(s4) != 4:
        return None
    if not (same_size(s[0], s4[0] * s4[1]) and same_size(s[1], s4[2])
            and same_size(s[2], s4[3])):
        return None
    return src, False


def _heads(split: tuple[fx.Node, bool]) -> int | None:
    s = _shape(split[0])
    return s[1] if isinstance(s[1], int) else None


class _Lifter:
    """Builds the [B, H, ...] region next to the old one."""

    def __init__(self, graph: fx.Graph, heads: int, merged):
        self.g, self.heads, self.merged = graph, heads, merged
        self.new: dict[fx.Node, fx.Node] = {}  # region node -> its [B, H, ...] equivalent
        self.created: list[fx.Node] = []

    def call(self, target, *args, **kwargs) -> fx.Node:
        node = self.g.call_function(target, args, kwargs)
        set_example(node)
        self.created.append(node)
        return node

    def drop(self) -> None:
        """Erase what was built (a region found not to be closed halfway)."""
        for node in reversed(self.created):
            self.g.erase_node(node)

    def split(self, split: tuple[fx.Node, bool]) -> fx.Node:
        x4, transposed = split
        return self.call(torch.transpose, x4, -2, -1) if transposed else x4

    def side(self, x, region_dim: int):
        """An operand from outside the chain, as the 4-D chain op must read it."""
        if not isinstance(x, fx.Node) or region_dim == 4:
            return x
        s = _shape(x)
        if s is None:
            raise _NotMerged(f"`{describe(x)}` has no recorded shape")
        if len(s) == 3 and not same_size(s[0], 1):
            if not same_size(s[0], self.merged):
                raise _NotMerged(f"`{describe(x)}` is not over the merged rows")
            return self.call(torch.unflatten, x, 0, (-1, self.heads))
        if len(s) > 3:
            raise _NotMerged(f"`{describe(x)}` broadcasts the chain to more axes")
        return x  # a scalar, a [.., X, Y] or [1, X, Y] tensor broadcasts the same way in 4-D


def _shape_read(node: fx.Node) -> bool:
    """``x.size()``, ``x.shape`` or ``x.dim()``: reads no values (a checkpointed body records
    the size checks the model makes)."""
    return is_call(node, methods=("size", "dim")) or (
        node.op == "call_function" and node.target is getattr and node.args[1] == "shape"
    ) or is_call(node, torch.ops.aten.sym_size.int, torch.ops.aten.sym_size)


def _operands(start: fx.Node):
    """The [B, H, ...] splits of a 3-D product's two operands, or None when they are not
    merged heads (an expert ``bmm`` of an MoE layer, ...)."""
    a, b = arg(start, 1, "batch1"), arg(start, 2, "batch2")
    if is_call(start, torch.bmm, methods=("bmm",)):
        a, b = start.args[:2]
    qa, kb = _split_of(a), _split_of(b)
    return None if qa is None or kb is None or qa[1] else (qa, kb)


def _plan(start: fx.Node, qa, kb):
    """The region from the score product ``start`` to its product with values: (heads, the
    chain's nodes in graph order with their ranks, the end product), or raise
    :class:`_NotMerged`."""
    heads = _heads(qa)
    if heads is None or _heads(kb) != heads:
        raise _NotMerged("its operands do not have the same, fixed number of heads")
    region, end, todo = {start: 3}, None, [start]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in region or _shape_read(u):
                continue
            s, dims = _shape(u), region[n]
            if is_call(u, *_PRODUCTS, methods=("bmm", "matmul")) and u.args[0] is n:
                if end is not None and end is not u:
                    raise _NotMerged("the chain ends in more than one product")
                end = u
                continue
            if s is None:
                raise _NotMerged(f"`{describe(u)}` has no recorded shape")
            if is_call(u, *_VIEWS, methods=_VIEW_METHODS):
                src = _shape(n)
                if len(s) == 4 and dims == 3 and same_size(s[1], heads) and same_size(
                        s[0] * s[1], src[0]) and all(same_size(x, y) for x, y in zip(s[2:],
                                                                                   src[1:])):
                    region[u] = 4
                elif len(s) == 3 and dims == 4 and same_size(s[0], src[0] * src[1]) and all(
                        same_size(x, y) for x, y in zip(s[1:], src[2:])):
                    region[u] = 3
                elif len(s) == len(src) and all(same_size(x, y) for x, y in zip(s, src)):
                    region[u] = dims
                else:
                    raise _NotMerged(f"`{describe(u)}` reshapes the scores")
            elif _elementwise(u):
                if len(s) != dims or not all(same_size(x, y) for x, y in zip(s, _shape(n))):
                    raise _NotMerged(f"`{describe(u)}` changes the shape of the scores")
                if is_call(u, *SOFTMAX, methods=("softmax",)) and arg(u, 1, "dim") not in (
                        -1, dims - 1):
                    raise _NotMerged(f"`{describe(u)}` is not over the keys")
                region[u] = dims
            else:
                raise _NotMerged(f"the scores are read by `{describe(u)}`")
            todo.append(u)
    if end is None:
        raise _NotMerged("the chain does not end in a product with values")
    v = end.args[1]
    if region[end.args[0]] == 3:
        vs = _split_of(v)
        if vs is None or vs[1] or _heads(vs) != heads:
            raise _NotMerged(f"the values `{describe(v)}` are not [B, H, N, D] merged")
    elif len(_shape(v) or ()) != 4:
        raise _NotMerged(f"the values `{describe(v)}` are not [B, H, N, D]")
    order = {n: i for i, n in enumerate(start.graph.nodes)}
    chain = sorted(region, key=order.__getitem__)
    return heads, chain, region, end


def _lift(ctx: GraphContext, start: fx.Node) -> fx.Node | None:
    ops = _operands(start)
    if ops is None:
        return None
    qa, kb = ops
    try:
        heads, chain, region, end = _plan(start, qa, kb)
    except _NotMerged as why:
        ctx.keep("heads", start, f"not rewritten: {why}")
        return None
    lift = _Lifter(ctx.graph, heads, _shape(start)[0])
    with ctx.graph.inserting_before(end):
        try:
            for n in chain:
                lift.new[n] = _lift_node(lift, n, region, qa, kb)
        except _NotMerged as why:
            lift.drop()
            ctx.keep("heads", start, f"not rewritten: {why}")
            return None
        p = lift.new[end.args[0]]
        if region[end.args[0]] == 3:
            out = lift.call(torch.matmul, p, lift.split(_split_of(end.args[1])))
            out = lift.call(torch.flatten, out, 0, 1)
        else:
            out = lift.call(torch.matmul, p, end.args[1])
    end.replace_all_uses_with(out)
    # The old region is unread now, and pure (products, views, elementwise ops, a softmax,
    # dropout): erased here, so the attention pass does not match its softmax a second time.
    for n in (end, *reversed(chain)):
        for u in [u for u in n.users if _shape_read(u) and not u.users]:
            ctx.graph.erase_node(u)
        if not n.users:  # (a size read that is used keeps it: its size is right)
            ctx.graph.erase_node(n)
    ctx.record("heads", start, f"[B, H, N, D] attention ({heads} heads) ending at {out.name}",
               note="batch and heads were merged")
    return out


def _lift_node(lift: _Lifter, n: fx.Node, region: dict, qa, kb) -> fx.Node:
    if is_call(n, *_BMM, methods=("bmm", "baddbmm")):
        s = lift.call(torch.matmul, lift.split(qa), lift.split(kb))
        if not is_call(n, torch.baddbmm, methods=("baddbmm",)):
            return s
        bias = n.args[0]
        beta, alpha = arg(n, 3, "beta", 1), arg(n, 4, "alpha", 1)
        if not all(isinstance(c, (int, float)) for c in (beta, alpha)):
            raise _NotMerged("its beta and alpha are computed in the graph")
        if alpha != 1:
            s = lift.call(torch.mul, s, alpha)
        if beta == 0 or is_call(bias, *_ZEROS, methods=("zero_", "new_zeros")):
            return s  # the bias does not count (beta 0 ignores it, NaN included)
        bias = lift.side(bias, 3)
        if beta != 1:
            bias = lift.call(torch.mul, bias, beta)
        return lift.call(torch.add, bias, s)
    if is_call(n, *_VIEWS, methods=_VIEW_METHODS):
        return lift.new[n.args[0]]
    dims = region[n]

    def operand(x):
        if isinstance(x, fx.Node) and x in region:
            return lift.new[x]
        return lift.side(x, dims)

    new = lift.g.node_copy(n, lambda x: operand(x) if isinstance(x, fx.Node) else x)
    lift.created.append(new)
    if is_call(n, *SOFTMAX, methods=("softmax",)):
        if len(new.args) > 1:
            new.args = (new.args[0], -1, *new.args[2:])
        else:
            new.kwargs = {**new.kwargs, "dim": -1}
    new.meta.pop("example_value", None)
    new.meta.pop("val", None)
    set_example(new)
    return new


def merged_heads_pass(ctx: GraphContext) -> int:
    """Rewrite every closed merged-heads attention region; returns how many."""
    count = 0
    for node in list(ctx.graph.nodes):
        if not is_call(node, *_BMM, methods=("bmm", "baddbmm")):
            continue
        s = _shape(node)
        if s is not None and len(s) == 3 and node.users and _lift(ctx, node) is not None:
            count += 1
    return count


register_rewrite("heads", merged_heads_pass)
