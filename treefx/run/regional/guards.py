"""Regional execution's shape guards: Dynamo's guards on the sizes that vary per call, read
off the capture's shape environment and re-evaluated on every call."""

from __future__ import annotations

import torch

from ...compiler import TreeCompileError

__all__ = ["dynamic_dims", "shape_guards"]


def dynamic_dims(token_args, call_args) -> list[tuple[int, int]]:
    """``token_args`` as (argument, dimension) pairs (``i`` alone: the last dimension)."""
    return [(a if isinstance(a, tuple) else (a, call_args[a].dim() - 1)) for a in token_args]


def _sources(shape_env, syms) -> str:
    """Where Dynamo read each symbol (``L['args'][5].size()[0]``), for error messages."""
    got = getattr(shape_env, "var_to_sources", {}) or {}
    def name(src) -> str:
        n = getattr(src, "name", "?")
        return n() if callable(n) else str(n)

    return ", ".join(f"{s} from {', '.join(name(x) for x in got.get(s, [])) or '?'}"
                     for s in sorted(syms, key=str)) or "none"


def shape_guards(fake_mode, call_fakes: dict, dims, size_exprs) -> tuple[dict, dict, list]:
    """Dynamo's guards on the sizes that vary per call: ``symbols`` (each size's symbol ->
    the (argument, dimension) it is read from), ``derived`` (other names of those sizes, as
    expressions in them: s87 -> s70) and the guards as ``("expr", e)`` (a sympy relation) or
    ``("range", symbol, value_range)``. A guard or a size input of the graph on anything else
    is an error."""
    symbols = {}
    for i, d in dims:
        f = call_fakes.get(i)
        size = f.shape[d] if isinstance(f, torch.Tensor) else None
        if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
            symbols.setdefault(size.node.expr, (i, d))
    shape_env = getattr(fake_mode, "shape_env", None)
    derived = {}
    if shape_env is not None:
        for k, v in shape_env.replacements.items():  # a size's other names (s87 -> s70)
            # (or a size specialized to a constant: s49 -> 64)
            if k not in symbols and hasattr(v, "free_symbols") and \
                    v.free_symbols <= set(symbols):
                derived[k] = v
    known = set(symbols) | set(derived)
    for e in size_exprs:
        if not e.free_symbols <= known:
            raise TreeCompileError(
                f"regional execution: a size the graph takes ({e}) is not one of the call's "
                f"dynamic sizes ({_sources(shape_env, e.free_symbols - known)}; the dynamic "
                f"sizes: {_sources(shape_env, symbols)})")
    if shape_env is None:
        return symbols, derived, []
    out = []
    for g in shape_env.guards:
        expr = g.expr  # not simplified by replacements: a specialization (s0 -> 10) stays
        free = expr.free_symbols
        if not free:
            continue
        if not free <= known:
            raise TreeCompileError(f"regional execution: a shape guard ({expr}) depends on "
                                   "sizes other than the call's dynamic sizes")
        out.append(("expr", expr))
    for s in known:
        r = shape_env.var_to_range.get(s)
        if r is not None:
            out.append(("range", s, r))
    return symbols, derived, out


