"""SSM pass: causal conv1d and recurrent state read from the tree, not from DFS neighbours.

- A depthwise ``conv1d`` with left padding K-1 whose output is cut back to the sequence length
  (how causal short convolutions are written) becomes a tree convolution: token t's K-1 left
  inputs are its K-1 tree predecessors.
- A ``cumsum`` along the tokens (positions counted by the model itself: RoBERTa counts its
  non-padding tokens) becomes a sum along each token's path.
- A registered recurrent kernel (see :mod:`treefx.kernels`), kept as one graph node during
  capture, becomes a tree recurrence: each tree node's initial state is its parent node's
  final state.
- Whatever else runs along the sequence (a conv1d in another form, a cumulative sum over the
  tokens) is an :class:`UnmatchedStateError` naming the node and module.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..kernels import registered
from ..ops.conv import tree_causal_conv1d, tree_causal_conv1d_context
from ..ops.recurrence import (
    TracedTreeRecurrence,
    TracedTreeRecurrencePart,
    register_site,
    tree_recurrence,
    tree_recurrence_part,
)
from ..ops.scan import tree_cumsum
from .common import (
    GraphContext,
    UnmatchedStateError,
    arg,
    describe,
    example,
    is_call,
    module_path,
    same_size,
)

__all__ = ["ssm_pass", "check_no_state_left", "UnmatchedStateError"]

_CONV1D = (F.conv1d, torch.conv1d)
_SCANS = (torch.cumsum, torch.cumprod, torch.logcumsumexp, torch.cummax, torch.cummin)
_SCAN_METHODS = ("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin")


def _fail(node: fx.Node, why: str) -> UnmatchedStateError:
    return UnmatchedStateError(
        f"treefx cannot route the sequence state at {module_path(node)} (graph node "
        f"`{describe(node)}`) through the tree: {why}. Running it over the DFS row would carry "
        "state from one branch into the next, so compilation stops here.",
        node=node,
    )


class TreeRecurrenceCall:
    """A registered kernel, run over the tree (eager backend)."""

    def __init__(self, rec):
        self.rec = rec
        self.__name__ = f"tree_recurrence_{rec.name}"

    def __call__(self, parent_token, *args, **kwargs):
        return tree_recurrence(self.rec, parent_token, args, kwargs)

    def __repr__(self):
        return self.__name__



class TreeRecurrencePartCall:
    """A registered kernel over one part of a tree (eager backend): returns (what the kernel
    returns, the exit states)."""

    def __init__(self, rec):
        self.rec = rec
        self.__name__ = f"tree_recurrence_part_{rec.name}"

    def __call__(self, parent_local, state_entry, state_exit, context_states, *args, **kwargs):
        return tree_recurrence_part(self.rec, parent_local, state_entry, state_exit,
                                    context_states, args, kwargs)

    def __repr__(self):
        return self.__name__


def _state_spec(rec, node: fx.Node):
    """(shape, dtype) of one node's state for the kernel at ``node``, from a run of the
    kernel on meta tensors of two tokens."""
    bound = rec.bind(fx.map_arg(node.args, example), fx.map_arg(node.kwargs, example))

    def meta(name, v):
        if not isinstance(v, torch.Tensor):
            return v
        shape = [s if isinstance(s, int) else (s.node.hint or 2) for s in v.shape]
        if name in rec.seq_args:
            shape[rec.seq_args[name]] = 2
        return torch.empty(shape, dtype=v.dtype, device="meta")

    args = {k: meta(k, v) for k, v in bound.items()
            if k not in (rec.initial_state, rec.output_final_state)}
    try:
        _, fin = rec.run(**args, **{rec.initial_state: None, rec.output_final_state: True})
    except Exception as e:  # noqa: BLE001
        raise _fail(node, f"in parts (treefx.backward) the state's shape is read from a run "
                          f"of the kernel on meta tensors, which failed ({type(e).__name__}: "
                          f"{e})") from None
    return tuple(int(x) for x in fin.shape[1:]), fin.dtype


def _traced_site(rec, node: fx.Node):
    """(site key, the tensor arguments in order) for the custom op that runs a registered
    kernel under AOTAutograd: the non-tensor arguments and the output's dtype are kept with
    the key (:func:`treefx.ops.recurrence.register_site`)."""
    bound = rec.bind(node.args, node.kwargs)
    names = [k for k, v in bound.items() if isinstance(v, fx.Node)]
    static = {k: v for k, v in bound.items() if not isinstance(v, fx.Node)}
    out = example(node)
    out = out[0] if isinstance(out, (tuple, list)) else out
    key = register_site(rec, names, static, out.dtype if isinstance(out, torch.Tensor) else None)
    return key, [bound[k] for k in names]


def _rewrite_part_recurrence(ctx: GraphContext, node: fx.Node, rec) -> fx.Node:
    part = ctx.part
    g = ctx.graph
    shape, dtype = _state_spec(rec, node)
    with g.inserting_before(node):
        init = part.state_in(ctx, shape, dtype)
        parent = part.parent_local(ctx)
        head = (parent, ctx.local(part.state_entry), ctx.local(part.state_exit), init)
        if ctx.backend == "eager":
            pair = g.call_function(TreeRecurrencePartCall(rec), (*head, *node.args),
                                   node.kwargs)
        else:  # one opaque op under AOTAutograd, as for whole trees
            key, tensors = _traced_site(rec, node)
            pair = g.call_function(TracedTreeRecurrencePart(key), (*head, *tensors))
        new = g.call_function(operator.getitem, (pair, 0))
        exits = g.call_function(operator.getitem, (pair, 1))
        part.state_out(ctx, exits)
    return new


def _on_sequence(ctx: GraphContext, node, dim: int = -1) -> bool:
    val = example(node)
    return val is not None and val.dim() > 0 and same_size(val.shape[dim], ctx.seq_len)


def _causal_conv_site(ctx: GraphContext, conv: fx.Node):
    """(slice node, x, weight, bias) when ``conv`` is conv1d(x, w, b, padding=K-1,
    groups=C)[..., :N]; raises when it is a conv along the sequence in another form."""
    x, w = arg(conv, 0, "input"), arg(conv, 1, "weight")
    bias = arg(conv, 2, "bias")
    stride, padding, dilation = (arg(conv, 3, "stride", 1), arg(conv, 4, "padding", 0),
                                 arg(conv, 5, "dilation", 1))
    groups = arg(conv, 6, "groups", 1)
    wv, xv = example(w), example(x)
    k = wv.shape[-1]
    norm = lambda v: v[0] if isinstance(v, (list, tuple)) else v  # noqa: E731
    if norm(stride) != 1 or norm(dilation) != 1:
        raise _fail(conv, f"a conv1d with stride {stride} and dilation {dilation}")
    if groups != xv.shape[1] or wv.shape[1] != 1:
        raise _fail(conv, "a conv1d that is not depthwise (groups != channels)")
    if norm(padding) != k - 1:
        raise _fail(conv, f"a conv1d with padding {padding}, not the causal K-1 = {k - 1}")
    users = list(conv.users)
    if len(users) == 1 and is_call(users[0], operator.getitem):
        key = users[0].args[1]
        key = key if isinstance(key, tuple) else (key,)
        last = key[-1]
        rest_ok = all(k_ == slice(None) or k_ is Ellipsis for k_ in key[:-1])
        if rest_ok and isinstance(last, slice) and last.start in (None, 0) and \
                last.step in (None, 1) and last.stop is not None and \
                (last.stop is ctx.seq_len or isinstance(last.stop, fx.Node) and
                 same_size(example(users[0]).shape[-1], ctx.seq_len)
                 or isinstance(last.stop, int) and same_size(last.stop, ctx.seq_len)):
            return users[0], x, w, bias
    raise _fail(conv, "a padded conv1d whose output is not cut back to [..., :N] (not causal)")


def _token_scan_dim(ctx: GraphContext, node: fx.Node) -> int | None:
    """The dim of a ``cumsum`` when it runs along the tokens (a dim of size exactly N)."""
    val = example(node.args[0])
    dim = arg(node, 1, "dim")
    if not isinstance(val, torch.Tensor) or not isinstance(dim, int) or val.dim() == 0:
        return None
    dim %= val.dim()
    return dim if same_size(val.shape[dim], ctx.seq_len) and not isinstance(
        ctx.seq_len, int) else None


def ssm_pass(ctx: GraphContext) -> int:
    g = ctx.graph
    count = 0
    for node in list(g.nodes):
        rec = registered(node.target) if node.op == "call_function" else None
        if rec is not None:
            parent = ctx.parent_token()
            with g.inserting_before(node):
                if ctx.part is not None:
                    new = _rewrite_part_recurrence(ctx, node, rec)
                elif ctx.backend == "eager":
                    new = g.call_function(TreeRecurrenceCall(rec), (parent, *node.args),
                                          node.kwargs)
                else:
                    # Traced by AOTAutograd: one opaque op (the tree's structure is data).
                    key, tensors = _traced_site(rec, node)
                    new = g.call_function(TracedTreeRecurrence(key), (parent, *tensors))
            new.meta.update(node.meta)
            ctx.record("ssm", node, describe(new), note=f"recurrence {rec.name}")
            node.replace_all_uses_with(new)
            g.erase_node(node)
            count += 1
        elif is_call(node, torch.cumsum, methods=("cumsum",)) and \
                _token_scan_dim(ctx, node) is not None:
            dim = _token_scan_dim(ctx, node)
            if ctx.part is not None:
                raise _fail(node, "in parts (treefx.backward) a cumulative sum along the "
                                  "tokens (positions the model counts itself) is not "
                                  "supported yet; pass position ids (pass_position_ids=True)")
            parent, se = ctx.parent_token(), ctx.subtree_end
            with g.inserting_before(node):
                new = g.call_function(tree_cumsum, (node.args[0], dim, parent, se),
                                      {"dtype": arg(node, 2, "dtype")})
            new.meta.update(node.meta)
            ctx.record("ssm", node, describe(new), note="cumulative sum along each path")
            node.replace_all_uses_with(new)
            g.erase_node(node)
            count += 1
        elif is_call(node, *_CONV1D) and _on_sequence(ctx, arg(node, 0, "input")):
            cut, x, w, bias = _causal_conv_site(ctx, node)
            parent = ctx.parent_token()
            with g.inserting_before(cut):
                if ctx.part is not None:
                    xv = example(x)
                    if xv.dim() != 3 or not same_size(xv.shape[0], 1):
                        raise _fail(node, "in parts (treefx.backward) a conv's input must be "
                                          "[1, channels, tokens]")
                    cx = ctx.part.channels(ctx, x, int(xv.shape[1]))
                    new = g.call_function(tree_causal_conv1d_context,
                                          (cx, x, w, bias, ctx.part.ext(ctx, "parent")))
                else:
                    new = g.call_function(tree_causal_conv1d, (x, w, bias, parent))
            new.meta.update(cut.meta)
            ctx.record("ssm", node, describe(new), note="causal conv1d")
            cut.replace_all_uses_with(new)
            g.erase_node(cut)
            g.erase_node(node)
            count += 1
    return count


_RESHAPES = (torch.reshape,)
_RESHAPE_METHODS = ("view", "reshape", "unflatten")
_MATMULS = (torch.matmul, operator.matmul, torch.bmm)


def _has_seq_axis(ctx: GraphContext, val) -> bool:
    """Some axis runs along the tokens: its size is N, or (with dynamic shapes) depends on N,
    as a padded token axis does."""
    if not isinstance(val, torch.Tensor):
        return False
    n = ctx.seq_len
    syms = n.node.expr.free_symbols if isinstance(n, torch.SymInt) else set()
    for s in val.shape:
        if same_size(s, n):
            return True
        if syms and isinstance(s, torch.SymInt) and s.node.expr.free_symbols & syms:
            return True
    return False


def _keeps_tokens_whole(ctx: GraphContext, val) -> bool:
    """Some axis is a whole multiple of N: tokens merged with other axes (a per-token
    flatten, like [1, N, H, D] -> [N*H, D]), not cut into chunks."""
    n = ctx.seq_len
    for s in val.shape:
        if isinstance(s, torch.SymInt) or isinstance(n, torch.SymInt):
            import sympy

            expr = getattr(s, "node", None)
            nexpr = getattr(n, "node", None)
            ratio = sympy.simplify((expr.expr if expr is not None else sympy.Integer(s)) /
                                   (nexpr.expr if nexpr is not None else sympy.Integer(n)))
            if ratio.is_Integer and ratio > 0:
                return True
        elif n and s % n == 0 and s > 0:
            return True
    return False


def check_no_state_left(ctx: GraphContext) -> None:
    """After the passes, nothing may still mix tokens along the DFS row: every op that does
    (attention, convs, recurrences, the loss's shift) has been rewritten to read the tree.
    Flags scans along the tokens, reshapes that cut the token axis into chunks (how chunked
    recurrences start), and matmuls that contract over the tokens."""
    for node in ctx.graph.nodes:
        if is_call(node, *_RESHAPES, methods=_RESHAPE_METHODS):
            src, out = example(node.args[0]), example(node)
            if _has_seq_axis(ctx, src) and isinstance(out, torch.Tensor) and \
                    not _keeps_tokens_whole(ctx, out):
                raise _fail(node, f"a reshape cuts the token axis {tuple(src.shape)} -> "
                                  f"{tuple(out.shape)} (chunks of an unregistered recurrence? see "
                                  "treefx.register_recurrence)")
        if is_call(node, *_MATMULS, methods=("matmul", "bmm")):
            a, b = (example(x) for x in node.args[:2])
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2 and \
                    same_size(a.shape[-1], ctx.seq_len) and same_size(b.shape[-2], ctx.seq_len):
                raise _fail(node, "a matmul contracts over the tokens (attention or a linear "
                                  "recurrence treefx does not recognise)")
        if is_call(node, *_SCANS, methods=_SCAN_METHODS):
            x = node.args[0]
            dim = arg(node, 1, "dim")
            val = example(x)
            if val is not None and isinstance(dim, int) and _on_sequence(ctx, x, dim) and \
                    val.shape[dim] != 1:
                raise _fail(node, "a cumulative op runs along the tokens (an unregistered "
                                  "recurrence? see treefx.register_recurrence)")
