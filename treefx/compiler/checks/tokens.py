"""The token-axis check: after the passes, nothing in the graph moves data along the tokens.

On the DFS row, the token before t is not its predecessor, the tokens after it are not its
sequence's, and the row's length is not any sequence's. So after the passes have rewritten
every op that legitimately runs along the tokens (attention, causal convs, recurrences, the
loss's shift) into a tree op, a correct graph treats the token axis as a set of independent
rows: per-token ops, and permutations of rows (MoE routing gathers tokens by expert and puts
them back). This module proves that for every node, or stops compilation naming the node.

The token axis is found by its symbolic size: N is a dynamic size, so any axis whose size is
N, or a multiple of N (tokens flattened with heads), carries tokens. Rules:

1. *Sizes and shifts*: an axis whose size depends on N must be a positive multiple of N. A
   slice (``x[:, :-1]``), a concatenation, a strided or chunked split of the tokens (an
   unrolled scan) all leave other sizes; a pad along the tokens is refused even when it
   keeps the size (``F.pad(x, (0, 0, 1, -1))`` shifts the tokens by one).
2. *Reductions and scans*: no reduction, softmax, top-k, cumulative op, roll or flip
   over a token axis of a value that depends on the tokens or their positions (a sink's
   log-sum-exp over the scores, a mean over the sequence, a dynamic RoPE scale from the longest
   position).
3. *Indexing*: the token axis may be indexed by data (routing) or by the tree's own rows
   (``parent_token``), not by positions (``x[:, positions - 1]`` is a shift).
4. *Shapes*: a graph specialized to one token count (a Python loop over the sequence unrolled
   by Dynamo) cannot be checked and is refused.

What treefx inserted (tree attention, tree convs and recurrences, the block mask) is exempt:
those ops are the tree versions, tested against the per-sequence reference.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph import (
    KEY_SELECTION,
    GraphContext,
    SpecializedGraphError,
    TokenAxisError,
    example,
    is_call,
    token_axis_error,
)
from ..taint import DATA, POSITION, Taint, is_treefx

__all__ = ["TokenAxisError", "SpecializedGraphError", "check_token_axis"]

_fail = token_axis_error


# ---------------------------------------------------------------------------- token axes


def _ratio(size, n_expr):
    """size / N as a sympy number, or None when size does not depend on N."""
    import sympy  # lazily: 0.4 s of `import treefx` otherwise
    expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
    if not expr.free_symbols & n_expr.free_symbols:
        return None
    return sympy.simplify(expr / n_expr)


def _token_dims(val, n_expr) -> tuple[list[int], list[int]]:
    """(token dims, bad dims) of a tensor: dims whose size is a positive multiple of N, and
    dims whose size depends on N otherwise."""
    good, bad = [], []
    for d, s in enumerate(val.shape):
        r = _ratio(s, n_expr)
        if r is None:
            continue
        if r.is_Integer and r > 0:
            good.append(d)
        else:
            bad.append(d)
    return good, bad


def _in_n(size, n_expr) -> str:
    """A size as an expression of N (the token count) for messages."""
    import sympy  # lazily: 0.4 s of `import treefx` otherwise
    if not isinstance(size, torch.SymInt):
        return str(size)
    return str(size.node.expr.subs(n_expr, sympy.Symbol("N")))


def _tensors(val) -> list[torch.Tensor]:
    out = []
    fx.node.map_aggregate(val, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


# ---------------------------------------------------------------------------- rule tables

_ALL = "all"
# name -> (position of the dim argument, its keyword, default when absent)
_DIM_ARG = {}
for _n in ("sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "argmax",
           "argmin", "all", "any", "count_nonzero", "std", "var", "std_mean", "var_mean",
           "median", "nanmedian", "logsumexp", "aminmax"):
    _DIM_ARG[_n] = (1, "dim", _ALL)
# Sorting tokens (MoE routing groups them by expert) only permutes them; what is computed
# from the permuted rows is checked on its own. Selecting some tokens over others (top-k over
# the tokens: expert-choice routing) is not a permutation.
for _n in ("softmax", "log_softmax", "softmin", "gumbel_softmax", "cumsum", "cumprod",
           "cummax", "cummin", "logcumsumexp", "mode"):
    _DIM_ARG[_n] = (1, "dim", -1)
for _n in ("topk", "kthvalue", "diff", "roll", "quantile", "nanquantile"):
    _DIM_ARG[_n] = (2, "dims" if _n == "roll" else "dim", _ALL if _n == "roll" else -1)
_DIM_ARG["norm"] = (2, "dim", _ALL)
_DIM_ARG["normalize"] = (2, "dim", 1)
_DIM_ARG["flip"] = (1, "dims", _ALL)
_DIM_ARG["unique"] = (99, "dim", _ALL)
_DIM_ARG["unique_consecutive"] = (99, "dim", _ALL)
_NORMS_OVER_SPATIAL = (F.group_norm, F.batch_norm, F.instance_norm)
_LAST_DIMS_NORMS = (F.layer_norm, getattr(F, "rms_norm", None))

# Index ops along a dim: name -> (position of dim, position of the index)
_INDEX_ALONG = {"index_select": (1, 2), "gather": (1, 2), "take_along_dim": (2, 1),
                "scatter": (1, 2), "scatter_add": (1, 2), "scatter_reduce": (1, 2),
                "index_add": (1, 2), "index_copy": (1, 2), "index_fill": (1, 2),
                "scatter_": (1, 2), "scatter_add_": (1, 2), "index_add_": (1, 2),
                "index_copy_": (1, 2), "index_fill_": (1, 2), "scatter_reduce_": (1, 2)}


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", "") or ""
    return ""


def _arg(node: fx.Node, pos: int, key: str, default):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(key, default)


def _reduced_dims(node: fx.Node, ndim: int):
    """The dims an op reduces/scans/permutes over, or None if it is not such an op."""
    name = _name(node)
    if node.op == "call_function" and node.target in _NORMS_OVER_SPATIAL:
        return set(range(1 if node.target is F.group_norm else 2, ndim)) | (
            {0} if node.target is F.batch_norm else set())
    if node.op == "call_function" and node.target in _LAST_DIMS_NORMS and node.target:
        shape = _arg(node, 1, "normalized_shape", ())
        k = len(shape) if isinstance(shape, (list, tuple)) else 1
        return set(range(ndim - k, ndim))
    if name not in _DIM_ARG:
        return None
    pos, key, default = _DIM_ARG[name]
    dim = _arg(node, pos, key, default)
    if name in ("max", "min") and isinstance(dim, fx.Node):
        return None  # the elementwise max/min of two tensors
    if isinstance(dim, bool) or dim is None:
        dim = default if default == _ALL else (-1 if dim is None else _ALL)
    if dim == _ALL:
        return set(range(ndim))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return set(range(ndim))  # a computed dim: assume the worst
    return {d % ndim for d in dims} if ndim else set()


def _padded_dims(node: fx.Node, ndim: int) -> set[int]:
    """Dims ``F.pad`` pads (or crops) by a nonzero amount."""
    if not is_call(node, F.pad, torch._C._nn.pad, torch.constant_pad_nd):
        return set()
    pad = _arg(node, 1, "pad", ())
    out = set()
    for i in range(0, len(pad), 2):
        if any(not isinstance(p, int) or p != 0 for p in pad[i:i + 2]):
            out.add(ndim - 1 - i // 2)
    return out


def _index_on_token_dims(node: fx.Node, val: torch.Tensor, tokens: list[int]):
    """Index tensors that select along a token axis of ``val`` (the indexed value), as
    (dim, index node) pairs."""
    out = []
    if node.op == "call_function" and node.target is operator.getitem:
        key = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        d = 0
        consumed = sum(1 for k in key if k is not None and k is not Ellipsis)
        for i, k in enumerate(key):
            if k is Ellipsis:
                d += val.dim() - consumed
                continue
            if k is None:
                continue
            if isinstance(k, fx.Node) and isinstance(example(k), torch.Tensor) and d in tokens:
                out.append((d, k))
            d += 1
        return out
    name = _name(node)
    if name in _INDEX_ALONG:
        dpos, ipos = _INDEX_ALONG[name]
        dim = _arg(node, dpos, "dim", None)
        index = _arg(node, ipos, "index", None)
        if isinstance(dim, int) and isinstance(index, fx.Node) and dim % val.dim() in tokens:
            out.append((dim % val.dim(), index))
    return out


_SLICES = (operator.getitem, torch.narrow, torch.ops.aten.slice.Tensor, torch.ops.aten.slice)


def _cuts_table_to_tokens(node: fx.Node, src: torch.Tensor, n_expr) -> bool:
    """A slice or narrow whose output has a token axis where its input's axis did not
    depend on N (``table[:, :N]``)."""
    if not is_call(node, *_SLICES, methods=("narrow",)):
        return False
    out = example(node)
    if not isinstance(out, torch.Tensor):
        return False
    pairs = []  # (input dim, output dim) of the sliced axes
    if node.target is operator.getitem:
        key = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if any(isinstance(k, fx.Node) and isinstance(example(k), torch.Tensor) for k in key):
            return False  # tensor indexing: the axes come from the index
        d_in = d_out = 0
        used = sum(1 for k in key if k is not None and k is not Ellipsis)
        for k in key:
            if k is Ellipsis:
                skip = src.dim() - used
                d_in, d_out = d_in + skip, d_out + skip
            elif k is None:
                d_out += 1
            elif isinstance(k, slice):
                pairs.append((d_in, d_out))
                d_in, d_out = d_in + 1, d_out + 1
            else:
                d_in += 1  # an integer index drops the axis
    else:
        dim = _arg(node, 1, "dim", 0)
        if isinstance(dim, int) and out.dim() == src.dim():
            pairs.append((dim % src.dim(), dim % src.dim()))
    for d_in, d_out in pairs:
        if d_in >= src.dim() or d_out >= out.dim():
            continue
        r_in, r_out = _ratio(src.shape[d_in], n_expr), _ratio(out.shape[d_out], n_expr)
        if r_in is None and r_out is not None and r_out.is_Integer and r_out > 0:
            return True
    return False


# ---------------------------------------------------------------------------- the check


def check_token_axis(ctx: GraphContext) -> None:
    """Apply the rules above to every node of ``ctx``'s graph (run it on every scope)."""
    import sympy  # lazily: 0.4 s of `import treefx` otherwise
    n = ctx.seq_len
    n_expr = n.node.expr if isinstance(n, torch.SymInt) else sympy.Integer(int(n))
    if not n_expr.free_symbols:  # Dynamo replaced the token count's symbol by a number
        if int(n_expr) >= 2:
            raise SpecializedGraphError(ctx)
        return  # a row of one token is one sequence: nothing can mix
    taint = Taint(ctx)
    for node in ctx.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or is_treefx(node):
            continue
        if node.meta.get(KEY_SELECTION):
            continue  # a top-k over a score row's keys, made per sequence (find/selection.py)
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            continue  # bodies are checked on their own; opaque ones by check_opaque_ops
        for val in _tensors(example(node)):
            _, bad = _token_dims(val, n_expr)
            if bad:
                size = _in_n(val.shape[bad[0]], n_expr)
                raise _fail(node, f"it makes a token axis of size {size} from the N tokens (a "
                                  "slice, pad, shift or split along the sequence)")
        first = node.args[0] if node.args else None
        src = example(first) if isinstance(first, fx.Node) else None
        if not isinstance(src, torch.Tensor):
            continue
        tokens, _ = _token_dims(src, n_expr)
        if _cuts_table_to_tokens(node, src, n_expr):
            raise _fail(node, "it cuts a table to the token count, so the table is read by DFS "
                              "index instead of by each token's position (position ids from a "
                              "buffer?); index it by positions, or give the model "
                              "position_ids (treefx.compile(..., pass_position_ids=True))")
        if not tokens:
            continue
        padded = _padded_dims(node, src.dim())
        if padded & set(tokens):
            raise _fail(node, f"it pads the token axis (dim {sorted(padded & set(tokens))[0]}): "
                              "a shift along the sequence")
        reduced = _reduced_dims(node, src.dim())
        if reduced and reduced & set(tokens) and taint.of(first) & {DATA, POSITION}:
            shape = tuple(_in_n(x, n_expr) for x in src.shape)
            if _name(node).startswith(("cum", "logcumsumexp")):
                raise _fail(node, f"a cumulative op runs along the tokens (dim "
                                  f"{sorted(reduced & set(tokens))[0]} of {shape}; an "
                                  "unregistered recurrence? see treefx.register_recurrence)")
            raise _fail(node, f"`{_name(node)}` runs over the token axis (dim "
                              f"{sorted(reduced & set(tokens))[0]} of {shape}), "
                              "mixing the tokens of different sequences")
        if taint.of(first) & {DATA, POSITION}:
            for dim, index in _index_on_token_dims(node, src, tokens):
                if POSITION in taint.of(index) and DATA not in taint.of(index):
                    raise _fail(node, f"it indexes the token axis (dim {dim}) by positions; on "
                                      "the DFS row position p is not the token p steps into the "
                                      "sequence (a shift along the sequence?)")
