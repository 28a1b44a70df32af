"""SSM recogniser: causal conv1d, cumulative sums and recurrent kernels along the tokens, as
sites (:mod:`treefx.compiler.sites`) that the lowerings read from the tree, not from DFS
neighbours.

- A depthwise ``conv1d`` with left padding K-1 whose output is cut back to the sequence length
  (how causal short convolutions are written) becomes a tree convolution: token t's K-1 left
  inputs are its K-1 tree predecessors.
- A ``cumsum`` along the tokens (positions counted by the model itself: RoBERTa counts its
  non-padding tokens) becomes a sum along each token's path.
- A registered recurrent kernel (see :mod:`treefx.compiler.recurrences`), kept as one graph node
  during capture, becomes a tree recurrence: each tree node's initial state is its parent node's
  final state.
- Whatever else runs along the sequence (a conv1d in another form, a cumulative sum over the
  tokens) is an :class:`UnmatchedStateError` naming the node and module.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph import GraphContext, arg, example, is_call, on_sequence, same_size, state_error
from ..recurrences import registered
from ..sites import ConvSite, PathSumSite, RecurrenceSite

__all__ = ["sites"]

_CONV1D = (F.conv1d, torch.conv1d)

_fail = state_error


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

    def norm(v):  # a size as traced: an int, or a SymInt where the widths are symbolic
        v = v[0] if isinstance(v, (list, tuple)) else v
        return example(v) if isinstance(v, fx.Node) else v

    if not same_size(norm(stride), 1) or not same_size(norm(dilation), 1):
        raise _fail(conv, f"a conv1d with stride {stride} and dilation {dilation}")
    if not same_size(norm(groups), xv.shape[1]) or not same_size(wv.shape[1], 1):
        raise _fail(conv, "a conv1d that is not depthwise (groups != channels)")
    if not same_size(norm(padding), k - 1):
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


def sites(ctx: GraphContext):
    """Every recurrence marker, cumulative sum along the tokens and causal conv1d of
    ``ctx``'s graph, each yielded in turn (lowered before the next is looked at); a conv1d
    along the tokens in another form raises."""
    for node in list(ctx.graph.nodes):
        rec = registered(node.target) if node.op == "call_function" else None
        if rec is not None:
            yield RecurrenceSite(node, rec)
        elif is_call(node, torch.cumsum, methods=("cumsum",)) and \
                _token_scan_dim(ctx, node) is not None:
            yield PathSumSite(node, _token_scan_dim(ctx, node))
        elif is_call(node, *_CONV1D) and on_sequence(ctx, arg(node, 0, "input")):
            cut, x, w, bias = _causal_conv_site(ctx, node)
            yield ConvSite(node, cut, x, w, bias)
