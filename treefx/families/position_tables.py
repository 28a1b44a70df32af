"""Position tables cut to the token count (GPT-Neo's local-attention bias table, MPT's ALiBi):
read at path positions, in the compiler's positions pass (:mod:`treefx.compiler.registry`)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..compiler.graph import GraphContext, example, is_call, same_size, set_example
from ..compiler.mask_lift import TABLE
from ..compiler.patterns import POINTWISE, POINTWISE_METHODS
from ..compiler.registry import register_node_rewrite
from ..compiler.taint import DATA, Taint

__all__ = ["SymFn", "rewrite_table_cut"]


class SymFn:
    """A size expression of the token count N (``max(0, S - N)``) evaluated at a tensor of
    token counts, elementwise: the slice start a model computes from the length of its
    sequence, for each query's own prefix length."""

    def __init__(self, expr: sympy.Expr, symbol: sympy.Symbol):
        self.expr, self.symbol = expr, symbol
        self.__name__ = "size_at_prefix_length"

    def __call__(self, n: torch.Tensor) -> torch.Tensor:
        return self._eval(self.expr, n) + torch.zeros_like(n)

    def _eval(self, e, n):
        import sympy  # lazily: 0.4 s of `import treefx` otherwise
        if e == self.symbol:
            return n
        if e.is_Integer:
            return int(e)
        args = [self._eval(a, n) for a in e.args]
        if isinstance(e, sympy.Add):
            out = args[0]
            for a in args[1:]:
                out = out + a
            return out
        if isinstance(e, sympy.Mul):
            out = args[0]
            for a in args[1:]:
                out = out * a
            return out
        name = type(e).__name__
        if name in ("Max", "Min"):  # sympy's, or torch's own (torch.utils._sympy)
            op = torch.maximum if name == "Max" else torch.minimum
            out = torch.as_tensor(args[0])
            for a in args[1:]:
                out = op(out, torch.as_tensor(a))
            return out
        if name == "FloorDiv":
            return torch.div(args[0], args[1], rounding_mode="floor")
        if name in ("Mod", "PythonMod"):
            return torch.remainder(args[0], args[1])
        raise NotImplementedError(f"size expression {e}")

    def __repr__(self) -> str:
        return f"SymFn({self.expr})"


def _size_expr(x):
    """A size or slice bound as a sympy expression (None for an absent bound)."""
    import sympy  # lazily: 0.4 s of `import treefx` otherwise
    if x is None:
        return None
    if isinstance(x, fx.Node):
        x = x.meta.get("example_value")
    if isinstance(x, torch.SymInt):
        return x.node.expr
    if isinstance(x, int) and not isinstance(x, bool):
        return sympy.Integer(x)
    raise TypeError(x)


def _broadcasts_into_users(node, r: int) -> bool:
    """Whether a [..., N, N] value in place of ``node``'s [..., 1 or N, N] leaves every user's
    result unchanged: each user is elementwise and its result already has both token axes."""
    for u in node.users:
        uv = example(u)
        if not is_call(u, *POINTWISE, methods=POINTWISE_METHODS) or not isinstance(
                uv, torch.Tensor) or uv.dim() < r:
            return False
        n = uv.shape[-1]
        if not (same_size(uv.shape[-2], n)):
            return False
    return True


def rewrite_table_cut(ctx: GraphContext, node) -> bool:
    """A table cut to the token count (``bias[:, :, K - Q:K, :K]``, GPT-Neo's local-attention
    table; ``alibi[:, max(0, S - N):]``, MPT's ALiBi) reads, for a sequence of L tokens, the
    entries ``start(L) + i`` at the sequence's own offsets ``i``. On the tree each token's row
    is what its own prefix computes (a decoder's output at a token does not depend on the
    tokens after it), so the table is read at ``start(pos_q + 1) + pos``: a gather at path
    positions, which the attention pass then lifts like any mask or bias built from index
    grids. Cuts it cannot prove to be that form are left to the token-axis check (refused)."""
    import sympy  # lazily: 0.4 s of `import treefx` otherwise

    table, key = node.args[0], node.args[1]
    tv, out = example(table), example(node)
    n = ctx.seq_len
    if not isinstance(tv, torch.Tensor) or not isinstance(out, torch.Tensor) or not isinstance(
            n, torch.SymInt):
        return False
    sym = n.node.expr
    if not isinstance(sym, sympy.Symbol):
        return False
    key = key if isinstance(key, tuple) else (key,)
    if any(isinstance(k, fx.Node) and isinstance(example(k), torch.Tensor) for k in key):
        return False
    if any(sym in _size_expr(d).free_symbols for d in tv.shape):
        return False  # not a table: it already has a token axis
    found = _token_cuts(tv, out, key, sym)
    if found is None:
        return False
    cuts, full_key = found
    # (A checkpointed layer takes the table as an operand: its taint is its caller's.)
    if not cuts or DATA in Taint(ctx).of(ctx.resolve(table)):
        return False
    pos = ctx.positions
    shape = _read_shape(node, out, cuts)
    if shape is None:
        return False
    g = ctx.graph
    with g.inserting_before(node):
        base = g.call_function(operator.getitem, (table, tuple(full_key)))
        base.meta[TABLE] = True
        if shape == "token":
            new = _read_per_token(g, pos, base, cuts)
        else:
            new = _read_per_pair(g, pos, base, cuts, shape, sym, out)
    set_example(new)
    ctx.record("positions", node, f"{new.name} (the table read at path positions)",
               note="a table cut to the token count")
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return True


def _token_cuts(tv: torch.Tensor, out: torch.Tensor, key: tuple, sym):
    """The output dims ``key`` cuts to the token count, as ``(output dim, slice start
    expression)``, and the key with those cuts made whole (``slice(None)``); None where a cut
    is not of the form ``[start(L) : start(L) + L]``."""
    import sympy  # lazily: 0.4 s of `import treefx` otherwise

    cuts, d_out, full_key = [], 0, []
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    for k in key:
        if k is Ellipsis:
            d_out += tv.dim() - used
            full_key.append(k)
        elif k is None:
            d_out += 1
            full_key.append(k)
        elif isinstance(k, slice):
            try:
                size = _size_expr(out.shape[d_out])
                start = _size_expr(k.start) if k.start is not None else sympy.Integer(0)
            except TypeError:
                return None
            if sym in size.free_symbols:
                if k.step not in (None, 1) or start.free_symbols - {sym}:
                    return None
                # The cut must hold exactly L entries for a sequence of L tokens.
                if any(size.subs(sym, v) != v for v in range(1, 65)):
                    return None
                cuts.append((d_out, start))
                full_key.append(slice(None))
            else:
                full_key.append(k)
            d_out += 1
        else:
            full_key.append(k)
    return cuts, full_key


def _read_shape(node, out: torch.Tensor, cuts) -> str | None:
    """How the cut table is read on the tree: ``"qk"`` ([..., Q, K]: queries, keys), ``"1k"``
    ([..., 1, K]: keys, the same for every query; becomes [..., N, N]), ``"token"`` (at each
    token's own position), or None (none of these)."""
    r = out.dim()
    dims = [d for d, _ in cuts]
    depends = any(start.free_symbols for _, start in cuts)
    if dims == [r - 2, r - 1]:
        return "qk"
    if dims == [r - 1] and r >= 2 and same_size(out.shape[r - 2], 1) and (
            _broadcasts_into_users(node, r)):
        return "1k"
    if len(cuts) == 1 and not depends:
        return "token"
    return None


def _read_per_token(g: fx.Graph, pos: fx.Node, base: fx.Node, cuts) -> fx.Node:
    """The table read at each token's own position (plus the cut's constant start)."""
    (d, start), = cuts
    idx = pos if start == 0 else g.call_function(torch.add, (pos, int(start)))
    return g.call_function(operator.getitem, (base, (*[slice(None)] * d, idx)))


def _read_per_pair(g: fx.Graph, pos: fx.Node, base: fx.Node, cuts, shape: str, sym,
                   out: torch.Tensor) -> fx.Node:
    """The table read at each (query, key) pair of path positions: [..., N, N]."""
    r = out.dim()
    pq = g.call_function(operator.getitem, (pos, (slice(None), None)))  # [N, 1]
    pk = g.call_function(operator.getitem, (pos, (None, slice(None))))  # [1, N]
    prefix = g.call_function(torch.add, (pq, 1))  # each query's own sequence length

    # A key after its query (a pair the tree hides) is read at the query's own offset instead,
    # so it stays inside the table; the tree mask drops it anyway. A query past the table's
    # end fails in the gather, as the model fails on a sequence longer than its table.
    pk = g.call_function(torch.minimum, (pk, pq))

    def at(start, p):
        if not start.free_symbols:
            return p if start == 0 else g.call_function(torch.add, (p, int(start)))
        return g.call_function(torch.add, (g.call_function(SymFn(start, sym), (prefix,)), p))

    starts = dict(cuts)
    if shape == "qk":
        iq = at(starts[r - 2], pq)
    else:  # the table's one query row, read at every query
        iq = g.call_function(torch.mul, (pq, 0))
    ik = at(starts[r - 1], pk)
    return g.call_function(operator.getitem, (base, (*_leading_grids(g, pos, out), iq, ik)))


def _leading_grids(g: fx.Graph, pos: fx.Node, out: torch.Tensor) -> list[fx.Node]:
    """Every leading dim indexed by its own arange (broadcast), so the result is [..., N, N]
    with the table's leading dims and every index a grid the attention pass can lift (a head
    axis of the table becomes the head index)."""
    r = out.dim()
    device = example(pos).device
    lead = []
    for j in range(r - 2):
        ar = g.call_function(torch.arange, (out.shape[j],), {"device": device})
        with example(pos).fake_mode:  # no tensor input to take a fake mode from
            ar.meta["example_value"] = torch.arange(out.shape[j], device=device)
        view = [1] * r
        view[j] = -1
        lead.append(g.call_method("view", (ar, *view)))
    return lead


register_node_rewrite("positions", rewrite_table_cut)
