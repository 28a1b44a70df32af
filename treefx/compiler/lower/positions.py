"""Positions pass: every position the model builds itself becomes the tree's position.

A model that takes ``position_ids`` gets the tree's positions as an input (the capture passes
them). A model that builds positions itself does it with an ``arange`` over the sequence
length, feeding rotary tables, a learned position embedding, or the index grids of its
attention mask. Each such ``arange`` becomes each token's offset in its own sequence. For mask
grids that is exactly the lifting the attention pass needs: the model's mask (causal, sliding
window, ...) evaluated at path positions, which the attention pass then ANDs with the tree.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import GraphContext, arg, example, is_call, same_size, set_example

__all__ = ["positions_pass"]


def _rewrite_band(ctx: GraphContext, node) -> bool:
    """``triu``/``tril`` over a [..., N, N] grid keeps or drops entries by their distance
    in the DFS row; on a tree it is the distance in positions. Rewritten to a ``where`` on
    the position grids (exact for every query/key pair on one path: the pairs tree attention
    lets through)."""
    val = example(node.args[0])
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or not (
            same_size(val.shape[-1], ctx.seq_len) and same_size(val.shape[-2], ctx.seq_len)):
        return False
    upper = node.target in (torch.triu, "triu")
    diagonal = arg(node, 1, "diagonal", 0)
    if not isinstance(diagonal, int):
        return False
    g = ctx.graph
    with g.inserting_before(node):
        pos = ctx.positions
        q = g.call_function(operator.getitem, (pos, (slice(None), None)))
        kv = g.call_function(operator.getitem, (pos, (None, slice(None))))
        dist = g.call_function(operator.sub, (kv, q))
        keep = g.call_function(operator.ge if upper else operator.le, (dist, diagonal))
        new = g.call_function(torch.where, (keep, node.args[0],
                                            g.call_function(torch.zeros_like,
                                                            (node.args[0],))))
    for n in (q, kv, dist, keep):
        set_example(n)
    new.meta["example_value"] = val
    ctx.record("positions", node, f"{new.name} (kept by distance in positions)",
               note="triu" if upper else "tril")
    node.replace_all_uses_with(new)
    ctx.graph.erase_node(node)
    return True


def _rewrite_cumsum_of_ones(ctx: GraphContext, node) -> bool:
    """``attention_mask.cumsum(-1)`` over the all-ones mask treefx gives the model (Bloom's
    and Falcon's ALiBi, Llama 4's left-padding count) is each token's position + 1 in its own
    sequence: on the tree, the tree positions + 1."""
    from ..mask_lift import is_all_ones_input

    src = node.args[0]
    val, sv = example(node), example(src)
    dim = arg(node, 1, "dim", None)
    if (not is_all_ones_input(src) or val is None or sv is None or sv.dim() != 2
            or not isinstance(dim, int) or dim % 2 != 1 or not same_size(sv.shape[1], ctx.seq_len)
            or not same_size(sv.shape[0], 1)):
        return False
    dtype = arg(node, 2, "dtype", None) or val.dtype
    g = ctx.graph
    with g.inserting_before(node):
        row = g.call_function(operator.getitem, (ctx.positions, (None, slice(None))))
        new = g.call_function(torch.add, (row, 1))
        if dtype != torch.int64:
            new = g.call_method("to", (new, dtype))
    set_example(row)
    new.meta["example_value"] = val
    if new.args[0] is not row:
        set_example(new.args[0])
    ctx.record("positions", node, f"{new.name} (tree positions + 1)",
               note="cumsum of the all-ones attention mask")
    node.replace_all_uses_with(new)
    g.erase_node(node)
    for user in list(new.users):
        # ``cumsum == 0`` (Llama 4 counts left padding with it) is False at every token, in
        # every sequence and on the tree: a position + 1 is at least 1. Folded to a constant,
        # so its sum over the tokens reads no token.
        if is_call(user, torch.eq, operator.eq, methods=("eq", "__eq__")) and len(
                user.args) == 2 and (
                new in user.args) and _is_zero(user.args[1] if user.args[0] is new
                                               else user.args[0]):
            with g.inserting_before(user):
                false = g.call_function(torch.zeros_like, (src,), {"dtype": torch.bool})
            false.meta["example_value"] = example(user)
            ctx.record("positions", user, f"{false.name} (all False)",
                       note="a position + 1 is never 0")
            user.replace_all_uses_with(false)
            g.erase_node(user)
    return True


def _is_zero(x) -> bool:
    """A constant 0: a number, or a tensor of zeros (through casts)."""
    while is_call(x, methods=("to", "bool", "long", "int", "float")):
        x = x.args[0]
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x == 0
    if is_call(x, torch.full, torch.full_like, methods=("new_full",)) and len(x.args) > 1:
        return _is_zero(x.args[1])
    return is_call(x, torch.zeros_like, torch.zeros, methods=("new_zeros", "zero_"))


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
    from ..patterns import POINTWISE, POINTWISE_METHODS

    for u in node.users:
        uv = example(u)
        if not is_call(u, *POINTWISE, methods=POINTWISE_METHODS) or not isinstance(
                uv, torch.Tensor) or uv.dim() < r:
            return False
        n = uv.shape[-1]
        if not (same_size(uv.shape[-2], n)):
            return False
    return True


def _rewrite_table_cut(ctx: GraphContext, node) -> bool:
    """A table cut to the token count (``bias[:, :, K - Q:K, :K]``, GPT-Neo's local-attention
    table; ``alibi[:, max(0, S - N):]``, MPT's ALiBi) reads, for a sequence of L tokens, the
    entries ``start(L) + i`` at the sequence's own offsets ``i``. On the tree each token's row
    is what its own prefix computes (a decoder's output at a token does not depend on the
    tokens after it), so the table is read at ``start(pos_q + 1) + pos``: a gather at path
    positions, which the attention pass then lifts like any mask or bias built from index
    grids. Cuts it cannot prove to be that form are left to the token-axis check (refused)."""
    import sympy  # lazily: 0.4 s of `import treefx` otherwise
    from ..mask_lift import TABLE
    from ..taint import DATA, Taint

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
    # Output dims cut to the token count: (output dim, slice start expression).
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
                return False
            if sym in size.free_symbols:
                if k.step not in (None, 1) or start.free_symbols - {sym}:
                    return False
                # The cut must hold exactly L entries for a sequence of L tokens.
                if any(size.subs(sym, v) != v for v in range(1, 65)):
                    return False
                cuts.append((d_out, start))
                full_key.append(slice(None))
            else:
                full_key.append(k)
            d_out += 1
        else:
            full_key.append(k)
    # (A checkpointed layer takes the table as an operand: its taint is its caller's.)
    if not cuts or DATA in Taint(ctx).of(ctx.resolve(table)):
        return False
    r = out.dim()
    pos = ctx.positions
    g = ctx.graph
    dims = [d for d, _ in cuts]
    depends = any(start.free_symbols for _, start in cuts)
    if dims == [r - 2, r - 1]:
        shape = "qk"  # [..., Q, K]: queries, keys
    elif dims == [r - 1] and r >= 2 and same_size(out.shape[r - 2], 1) and (
            _broadcasts_into_users(node, r)):
        shape = "1k"  # [..., 1, K]: keys, the same for every query; becomes [..., N, N]
    elif len(cuts) == 1 and not depends:
        shape = "token"  # read at each token's own position
    else:
        return False
    with g.inserting_before(node):
        base = g.call_function(operator.getitem, (table, tuple(full_key)))
        base.meta[TABLE] = True
        if shape == "token":
            (d, start), = cuts
            idx = pos if start == 0 else g.call_function(torch.add, (pos, int(start)))
            new = g.call_function(operator.getitem, (base, (*[slice(None)] * d, idx)))
        else:
            pq = g.call_function(operator.getitem, (pos, (slice(None), None)))  # [N, 1]
            pk = g.call_function(operator.getitem, (pos, (None, slice(None))))  # [1, N]
            prefix = g.call_function(torch.add, (pq, 1))  # each query's own sequence length

            # A key after its query (a pair the tree hides) is read at the query's own
            # offset instead, so it stays inside the table; the tree mask drops it anyway. A
            # query past the table's end fails in the gather, as the model fails on a sequence
            # longer than its table.
            pk = g.call_function(torch.minimum, (pk, pq))

            def at(start, p):
                if not start.free_symbols:
                    return p if start == 0 else g.call_function(torch.add, (p, int(start)))
                return g.call_function(torch.add, (g.call_function(SymFn(start, sym),
                                                                   (prefix,)), p))

            starts = dict(cuts)
            if shape == "qk":
                iq = at(starts[r - 2], pq)
            else:  # the table's one query row, read at every query
                iq = g.call_function(torch.mul, (pq, 0))
            ik = at(starts[r - 1], pk)
            # Every leading dim indexed by its own arange (broadcast), so the result is
            # [..., N, N] with the table's leading dims and every index a grid the attention
            # pass can lift (a head axis of the table becomes the head index).
            device = example(pos).device
            lead = []
            for j in range(r - 2):
                ar = g.call_function(torch.arange, (out.shape[j],), {"device": device})
                with example(pos).fake_mode:  # no tensor input to take a fake mode from
                    ar.meta["example_value"] = torch.arange(out.shape[j], device=device)
                view = [1] * r
                view[j] = -1
                lead.append(g.call_method("view", (ar, *view)))
            new = g.call_function(operator.getitem, (base, (*lead, iq, ik)))
    set_example(new)
    ctx.record("positions", node, f"{new.name} (the table read at path positions)",
               note="a table cut to the token count")
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return True


def positions_pass(ctx: GraphContext) -> int:
    """Replace every ``arange`` of the sequence length by the tree positions; returns how many."""
    count = 0
    for node in list(ctx.graph.nodes):
        if is_call(node, torch.triu, torch.tril, methods=("triu", "tril")):
            count += _rewrite_band(ctx, node)
            continue
        if is_call(node, torch.cumsum, methods=("cumsum",)):
            count += _rewrite_cumsum_of_ones(ctx, node)
            continue
        if is_call(node, operator.getitem):
            count += _rewrite_table_cut(ctx, node)
            continue
        if not is_call(node, torch.arange):
            continue
        val = example(node)
        if val is None or val.dim() != 1 or not same_size(val.shape[0], ctx.seq_len):
            continue
        start = node.args[0] if len(node.args) >= 2 else node.kwargs.get("start", 0)
        step = node.args[2] if len(node.args) >= 3 else node.kwargs.get("step", 1)
        if step != 1:
            continue  # a strided grid is not a position
        with ctx.graph.inserting_before(node):
            new = ctx.positions
            if val.dtype != torch.int64:
                new = ctx.graph.call_method("to", (new, val.dtype))
            if not (isinstance(start, int) and start == 0):
                new = ctx.graph.call_function(torch.add, (new, start))
        if new is not ctx.positions:
            new.meta["example_value"] = val
        ctx.record("positions", node, f"{new.name} (tree positions)")
        node.replace_all_uses_with(new)
        ctx.graph.erase_node(node)
        count += 1
    return count
