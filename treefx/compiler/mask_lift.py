"""Lift a model-built attention mask out of the graph into a FlexAttention ``mask_mod``.

A model builds its mask from index grids: ``arange`` vectors broadcast to [B, H, Q, KV]
(``q_idx[None, None, :, None]``, ``kv_idx[None, None, None, :]``), combined elementwise
(causal ``kv <= q``, sliding window ``kv > q - W``, a padding lookup ``attention_mask[b, kv]``).
After the positions pass its q/kv grids are path positions. This module re-evaluates that
subgraph for one (b, h, q, kv) at a time, which is what a ``mask_mod`` is:

- a *vector* node (1-D, from an index source) is evaluated at the index of the axis it is
  broadcast to: tree positions at ``q_idx`` / ``kv_idx``, a batch or head ``arange`` at
  ``b`` / ``h``;
- a *grid* node (broadcast) is a scalar: shape ops (``expand``, ``view``, ``None``-indexing)
  are identities, elementwise ops apply, indexing a buffer by grid scalars is a lookup;
- tensors that do not depend on an index source are buffers, passed to the ``mask_mod`` at
  run time (e.g. the padding mask).

Anything else raises :class:`MaskLiftError`; the attention pass turns it into an error naming
the attention site.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph import KEY_SELECTION, GraphContext, describe, example, is_call
from .taint import DATA, Taint

__all__ = ["MaskLiftError", "LiftedMask", "LiftedScore", "DenseSide", "dense_side", "lift_mask",
           "lift_value", "sees_later_keys", "window_of"]

_SHAPE_METHODS = ("expand", "expand_as", "view", "reshape", "unsqueeze", "contiguous",
                  "squeeze", "broadcast_to")
_SHAPE_FUNCS = (torch.reshape, torch.unsqueeze, torch.squeeze, torch.broadcast_to)
_ROLES = ("b", "h", "q", "kv")


class MaskLiftError(Exception):
    """The mask subgraph is not an elementwise function of index grids."""


# Marks a node whose value is a table read at path positions by index grids (the positions
# pass's gather of a table cut to the token count): a buffer of the mask, even when the model
# computed it from an ``arange`` of the table's own length (MPT's ALiBi).
TABLE = "treefx_table"


def _is_index_source(ctx: GraphContext, node) -> bool:
    if node.meta.get(TABLE):
        return False
    return ctx.is_tree_input(node, "positions") or is_call(node, torch.arange)



class LiftedMask:
    """``(b, h, q_pos, kv_pos, *buffers) -> bool``: the model's mask at path positions.

    ``q_pos``/``kv_pos`` are the tree positions of the query and key (the caller indexes the
    position table); ``buffers`` are the runtime values of the subgraph's leaf tensors.
    """

    def __init__(self, positions: fx.Node | None, mask: fx.Node, leaves: list[fx.Node]):
        self.positions = positions
        self.mask = mask
        self.leaves = leaves

    def __call__(self, b, h, q_pos, kv_pos, *buffers):
        return self.evaluate(b, h, q_pos, kv_pos, *buffers).reshape(())

    def evaluate(self, b, h, q_pos, kv_pos, *buffers):
        """The mask for (b, h, q_pos, kv_pos); these may be equal-length 1-D tensors of
        pairs (elementwise), which is how :func:`implied_by_tree` probes it."""
        idx = {"b": b, "h": h}
        pos = {"q": q_pos, "kv": kv_pos}
        env = dict(zip(self.leaves, buffers))
        vec_env: dict = {}

        def vector(node, role):
            key = (node, role)
            if key in vec_env:
                return vec_env[key]
            val = example(node)
            if val is not None and val.dim() == 1 and _static_one(val.shape[0]):
                role_idx = torch.zeros_like(q_pos)  # a size-1 vector broadcasts its one entry
            else:
                role_idx = None
            if node is self.positions:
                if role not in pos:
                    raise MaskLiftError("tree positions broadcast along a batch or head axis")
                out = pos[role]
            elif is_call(node, torch.arange) or node.op == "placeholder":
                if node.op == "placeholder":
                    raise MaskLiftError(f"`{node.name}` is not an index the mask can evaluate")
                i = role_idx if role_idx is not None else (pos[role] if role in pos else idx[role])
                if role in pos and role_idx is None:
                    raise MaskLiftError("an arange over the sequence survived the positions pass")
                start, step = _arange_start_step(node)
                out = start + step * i
            elif node.op in ("call_function", "call_method"):
                args = _map(node.args, lambda a: vector(a, role) if _depends(a) else leaf(a))
                kwargs = _map(node.kwargs, lambda a: vector(a, role) if _depends(a) else leaf(a))
                out = _call(node, args, kwargs)
            else:
                raise MaskLiftError(f"cannot evaluate `{describe(node)}` per index")
            vec_env[key] = out
            return out

        def leaf(a):
            if isinstance(a, fx.Node):
                if a in env:
                    return env[a]
                raise MaskLiftError(f"`{describe(a)}` is not a tensor the mask can read")
            return a

        def _depends(a):
            return isinstance(a, fx.Node) and a in self._dep

        def grid(node):
            if node in env:
                return env[node]
            if not _depends(node):
                return leaf(node)
            val = example(node)
            src = node.args[0] if node.args else None
            if node in self._fills:  # a filled tensor's one value, on the positions' device
                out = q_pos.new_full((), node.args[1], dtype=node.kwargs["dtype"])
            elif node in self._reductions:  # of a filled tensor, its value (cast below)
                out = grid(src)
            elif _is_broadcast_of_vector(node, self._vectors):
                out = vector(src, _axis_role(node))
            elif is_call(node, *_SHAPE_FUNCS, methods=_SHAPE_METHODS) or (
                is_call(node, operator.getitem) and _is_pure_view_key(node.args[1])
            ):
                out = grid(src)
            elif is_call(node, operator.getitem) and src in self._uniform:
                out = grid(src)  # any entry of a filled tensor is its one value
            elif is_call(node, operator.getitem):
                base = grid(src) if _depends(src) else leaf(src)
                key = node.args[1]
                key = tuple(grid(k) if _depends(k) else k for k in key) if isinstance(
                    key, tuple) else (grid(key) if _depends(key) else key)
                out = base[key]
            elif node.op in ("call_function", "call_method"):
                args = _map(node.args, lambda a: grid(a) if _depends(a) else leaf(a))
                kwargs = _map(node.kwargs, lambda a: grid(a) if _depends(a) else leaf(a))
                out = _call(node, args, kwargs)
            else:
                raise MaskLiftError(f"cannot evaluate `{describe(node)}` per index")
            if val is not None and isinstance(out, torch.Tensor) and out.dtype != val.dtype:
                out = out.to(val.dtype)
            env[node] = out
            return out

        out = grid(self.mask)
        if not self.boolean:
            return out
        if out.dtype != torch.bool:
            raise MaskLiftError("the mask is not boolean")
        return ~out if self.negate else out

    # Filled by lift_mask / lift_value.
    negate: bool = False  # the subgraph computes where attention is blocked
    boolean: bool = True  # a mask (lift_mask), or any value (lift_value)
    _dep: set
    _vectors: set
    _uniform: set = frozenset()
    _fills: set = frozenset()
    _reductions: set = frozenset()


class LiftedScore:
    """``(score, b, h, q_pos, kv_pos, *buffers) -> score``: a model's own score ops (``fn``,
    reading the score and its side tensors) with each side tensor evaluated at path positions
    (``sides``: a :class:`LiftedMask` of :func:`lift_value` and how many buffers it reads)."""

    def __init__(self, fn, sides: list[tuple[LiftedMask, int]]):
        self.fn = fn
        self.sides = sides

    def __call__(self, score, b, h, q_pos, kv_pos, *buffers, q_idx=None, kv_idx=None):
        values, i = [], 0
        for side, n in self.sides:
            if isinstance(side, DenseSide):
                values.append(side.read(b, h, q_idx, kv_idx, *buffers[i:i + n]))
            else:
                values.append(side.evaluate(b, h, q_pos, kv_pos, *buffers[i:i + n]).reshape(()))
            i += n
        return self.fn(score, *values)


class DenseSide:
    """A side tensor of the scores read where the model computed it: its entry at the query's
    and key's rows of the DFS row (a size-1 dim broadcasts). For a value the lifter cannot
    evaluate per index (Falcon's ALiBi goes through a [B * H, 1, N] reshape), which the
    positions pass has already computed at path positions and the token-axis check has
    cleared, as the eager backend reads it."""

    def __init__(self, shape: tuple[bool, ...]):
        self.broadcast = shape  # per dim of [B, H, Q, KV] (left-padded to 4): size 1?
        self.__name__ = "dense_side"

    def read(self, b, h, q_idx, kv_idx, buf):
        # The buffer is padded along its token axes (treefx::pad_rows_to_block), so a row
        # of the last block past N reads a zero, masked out after the score_mod.
        dims = list(zip(self.broadcast, (b, h, q_idx, kv_idx)))[4 - buf.dim():]
        return buf[tuple(0 if one else x for one, x in dims)]


def dense_side(ctx: GraphContext, node: fx.Node) -> DenseSide:
    """The :class:`DenseSide` of ``node``: a tensor of at most 4 dims broadcastable to
    [B, H, N, N], or MaskLiftError."""
    val = example(node)
    n = ctx.seq_len
    if not isinstance(val, torch.Tensor) or val.dim() > 4:
        raise MaskLiftError(f"`{describe(node)}` is not a tensor of at most 4 dims")
    shape = (1,) * (4 - val.dim()) + tuple(val.shape)
    ones = tuple(_static_one(s) for s in shape)
    for i in (2, 3):
        if not ones[i] and not (isinstance(shape[i], torch.SymInt) and shape[i] == n):
            raise MaskLiftError(f"`{describe(node)}` (shape {tuple(val.shape)}) does not run "
                                "over the queries and keys of the row")
    return DenseSide(ones)


def _static_one(n) -> bool:
    return isinstance(n, int) and n == 1


def _arange_start_step(node: fx.Node):
    args = node.args
    if len(args) >= 2:
        return args[0], (args[2] if len(args) >= 3 else node.kwargs.get("step", 1))
    return node.kwargs.get("start", 0), node.kwargs.get("step", 1)


def _map(x, fn):
    if isinstance(x, tuple):
        return tuple(_map(a, fn) for a in x)
    if isinstance(x, list):
        return [_map(a, fn) for a in x]
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return fn(x)


def _call(node: fx.Node, args, kwargs):
    if node.op == "call_method":
        self_, *rest = args
        if node.target == "to":
            # Device moves and casts of a scalar: keep dtype casts only.
            rest = [a for a in rest if isinstance(a, torch.dtype)]
            kwargs = {k: v for k, v in kwargs.items() if k == "dtype"}
            return self_.to(*rest, **kwargs) if rest or kwargs else self_
        return getattr(self_, node.target)(*rest, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "device"} if node.target in (
        torch.ones, torch.zeros, torch.full) else kwargs
    return node.target(*args, **kwargs)


def _is_pure_view_key(key) -> bool:
    key = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or k == slice(None) for k in key)


def _is_broadcast_of_vector(node: fx.Node, vectors: set) -> bool:
    if not node.args or node.args[0] not in vectors or node in vectors:
        return False
    val = example(node)
    return val is not None and val.dim() >= 2


def _axis_role(node: fx.Node) -> str:
    """Which of b, h, q, kv the vector's axis lands on in a broadcast node's output."""
    val = example(node)
    rank = val.dim()
    axis = None
    if is_call(node, operator.getitem):
        key = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        out_axis = 0
        for k in key:
            if k is None:
                out_axis += 1
            elif k == slice(None):
                axis = out_axis
                out_axis += 1
            elif k is Ellipsis:
                if slice(None) not in [x for x in key if x is not Ellipsis]:
                    axis = out_axis
                out_axis += rank - (len(key) - 1)
            else:
                raise MaskLiftError(f"unexpected index in `{describe(node)}`")
    else:
        sizes = [s for s in val.shape]
        big = [i for i, s in enumerate(sizes) if not _static_one(s)]
        if len(big) == 1:
            axis = big[0]
    if axis is None:
        # A size-1 vector: any role reads its only entry.
        return "b"
    from_end = rank - 1 - axis
    if from_end >= len(_ROLES):
        raise MaskLiftError(f"`{describe(node)}` broadcasts to more than 4 dims")
    return _ROLES[::-1][from_end]


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
        if _is_zero(ctx, a) and _very_negative(ctx, b):
            mask = cond
        elif _very_negative(ctx, a) and _is_zero(ctx, b):
            mask, negate = cond, True
        else:
            raise MaskLiftError(f"it is an additive float mask made by `{describe(mask)}` whose "
                                "values are not only 0 and -inf: it may carry a bias")
        if example(mask) is None or example(mask).dtype != torch.bool:
            raise MaskLiftError("the additive mask's condition is not boolean")
    lifted, leaves = _snapshot(ctx, mask)
    lifted.negate = negate
    return lifted, leaves


def lift_value(ctx: GraphContext, node: fx.Node) -> tuple[LiftedMask, tuple[fx.Node, ...]]:
    """Like :func:`lift_mask` for a tensor of any dtype that a model combines elementwise with
    its attention scores (an additive mask, a bias): ``(b, h, q_pos, kv_pos, *buffers)`` -> its
    value there. A tensor that depends on no index (a 0-d constant) is read whole, so it must
    hold one element."""
    node = ctx.resolve(node)
    val = example(node)
    if not isinstance(val, torch.Tensor):
        raise MaskLiftError(f"`{describe(node)}` has no recorded value")
    lifted, leaves = _snapshot(ctx, node)
    if lifted.mask in lifted.leaves and val.numel() != 1:
        raise MaskLiftError(f"`{describe(node)}` (shape {tuple(val.shape)}) is read by the "
                            "scores but is not a function of the query and key positions")
    lifted.boolean = False
    return lifted, leaves


def _snapshot(ctx: GraphContext, mask: fx.Node) -> tuple[LiftedMask, tuple[fx.Node, ...]]:
    """The subgraph computing ``mask`` from index sources, copied into a private graph."""
    # Nodes that depend on an index source, and which of them are still 1-D vectors.
    dep: set = set()
    vectors: set = set()
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
        if not n.meta.get(TABLE) and _uniform_fill(n) is None:
            for a in n.all_input_nodes:
                visit(ctx.resolve(a))
        order.append(n)

    visit(mask)
    uniform: set = set()  # the same value at every index: a uniform constructor's, elementwise
    reductions: set = set()  # reductions of a filled tensor that keep its value
    for n in order:
        ins = [ctx.resolve(a) for a in n.all_input_nodes]
        if _uniform_fill(n) is not None:
            dep.add(n)
            uniform.add(n)
        elif _is_index_source(ctx, n):
            dep.add(n)
            vectors.add(n)
        elif any(a in uniform for a in ins) and _reduces_uniform(n, ctx):
            dep.add(n)  # its value is its filled input's (Llama 4's zeros_like(..).sum(-1))
            uniform.add(n)
            reductions.add(n)
        elif any(a in uniform for a in ins) and not _keeps_uniform(n):
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
    # Snapshot the subgraph into a private graph: the attention pass removes the original
    # nodes once the attention no longer reads the mask.
    private = fx.Graph()
    copies: dict = {}
    leaves = []
    positions = ctx.root_node("positions")

    def outer(a: fx.Node) -> fx.Node:
        # A value from outside the subgraph: a placeholder of the private graph.
        if a not in copies:
            ph = private.placeholder(a.name)
            ph.meta = dict(a.meta)
            copies[a] = ph
            if a is not positions and isinstance(example(a), torch.Tensor):
                leaves.append(a)
        return copies[a]

    def arg(a: fx.Node) -> fx.Node:
        a = ctx.resolve(a)
        return copies[a] if a in copies else outer(a)

    taint = Taint(ctx)
    for a in leaves_of(order, dep):
        v = example(a)
        if DATA in taint.of(a) and isinstance(v, torch.Tensor) and v.numel() != 1:
            # Its index grids are path positions (the positions pass), so it would look a
            # value per token up at a position instead of the token's own row.
            raise MaskLiftError(f"it reads `{describe(a)}`, computed from the tokens' data (a "
                                "flag per token, such as `input_ids != pad_token_id`?), at "
                                "query or key indices, which are path positions on a tree")
    for n in order:
        fill = _uniform_fill(n)
        if fill is not None:  # its one value, as a 0-d tensor of its dtype
            copies[n] = private.call_function(torch.full, ((), fill),
                                              {"dtype": example(n).dtype})
            copies[n].meta = dict(n.meta)
        elif n in dep and n is not positions:
            copies[n] = private.node_copy(n, arg)
        elif n is positions:
            outer(n)
    if mask not in copies:  # depends on no index: one buffer, read whole
        outer(mask)
    lifted = LiftedMask(copies[positions] if positions in copies else None,
                        copies[mask], [copies[n] for n in leaves])
    lifted._dep = {copies[n] for n in dep}
    lifted._vectors = {copies[n] for n in vectors}
    lifted._uniform = {copies[n] for n in uniform}
    lifted._fills = {copies[n] for n in order if _uniform_fill(n) is not None}
    lifted._reductions = {copies[n] for n in reductions}
    return lifted, tuple(leaves)


def leaves_of(order, dep) -> list:
    """The nodes outside ``dep`` that nodes of ``dep`` read (the lifted mask's buffers)."""
    out = []
    for n in order:
        if n in dep and _uniform_fill(n) is None:
            out.extend(a for a in n.all_input_nodes if a not in dep and a not in out)
    return out


def _uniform_fill(node) -> int | float | bool | None:
    """The value a constructor fills a tensor with (``zeros``, ``ones``, ``full``, their
    ``_like`` forms and the ``new_*`` methods; of more or less than one dim) when nothing writes
    into it afterwards, None for anything else. Its inputs give it a shape only, so the lifted
    mask reads its one value at every index instead of evaluating them or reading it per row
    (Git's mask builds token types as ``zeros_like(embeddings)[..., 0]``; Gemma 4's groups are
    ``full((1, N), -1)``, which a part's positions would index past its own N)."""
    val = example(node)
    if not isinstance(val, torch.Tensor) or val.dim() == 1:
        return None  # (a 1-d one may be a vector of an index: read as such)
    if is_call(node, torch.zeros, torch.zeros_like, methods=("new_zeros",)):
        v = 0
    elif is_call(node, torch.ones, torch.ones_like, methods=("new_ones",)):
        v = 1
    elif is_call(node, torch.full, torch.full_like, methods=("new_full",)):
        v = node.args[1] if len(node.args) > 1 else node.kwargs.get("fill_value")
    else:
        return None
    if not isinstance(v, (int, float, bool)) or _written(node):
        return None
    return v


_VIEWS = ("view", "reshape", "expand", "expand_as", "unsqueeze", "squeeze", "transpose",
          "permute", "t", "narrow", "select", "as_strided", "flatten", "unflatten", "movedim",
          "contiguous", "view_as", "reshape_as", "swapaxes", "diagonal", "split", "chunk",
          "unbind")
_INPLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift)


def _written(node: fx.Node) -> bool:
    """Whether anything may write into ``node``'s tensor: an in-place op or ``out=`` on it or
    on a view of it (views followed through ``getitem`` and the usual view ops)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            name = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")
            schema = getattr(u.target, "_schema", None)  # an aten op: its own word on it
            if u.target in _INPLACE_OPERATORS or "out" in u.kwargs or u.kwargs.get("inplace") \
                    or (name.endswith("_") and not name.endswith("__")) \
                    or (schema is not None and schema.is_mutable):
                return True
            if is_call(u, operator.getitem, *_SHAPE_FUNCS, torch.transpose, torch.permute,
                       torch.narrow, torch.select, torch.flatten, torch.movedim,
                       torch.split, torch.chunk, torch.unbind, methods=_VIEWS) or (
                    u.op not in ("call_function", "call_method")):
                stack.append(u)  # a view (or a body's use): its writes are the tensor's
    return False


_ELEMENTWISE = {operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
                operator.and_, operator.or_, operator.xor, operator.invert, operator.not_,
                operator.add, operator.sub, operator.mul, operator.neg, torch.where, torch.eq,
                torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.logical_and,
                torch.logical_or, torch.logical_not, torch.add, torch.sub, torch.mul,
                operator.getitem, *_SHAPE_FUNCS}
_ELEMENTWISE_METHODS = ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
                        "logical_not", "add", "sub", "mul", "to", "bool", "long", "int", "float",
                        "type_as", "__and__", "__or__", "__invert__", *_SHAPE_METHODS)


_KEEPING_REDUCTIONS = (torch.amax, torch.amin, torch.mean, torch.any, torch.all)
_KEEPING_REDUCTION_METHODS = ("amax", "amin", "mean", "any", "all")


def _reduces_uniform(node, ctx: GraphContext) -> bool:
    """Whether ``node`` reduces a filled tensor to that same value: a max, min, mean, any or
    all of it, or a sum of zeros (Llama 4 counts left padding as ``zeros_like(..).sum(-1)``)."""
    if is_call(node, *_KEEPING_REDUCTIONS, methods=_KEEPING_REDUCTION_METHODS):
        return True
    if is_call(node, torch.sum, methods=("sum",)) and node.args:
        return _uniform_fill(ctx.resolve(node.args[0])) == 0
    return False


def _keeps_uniform(node) -> bool:
    """Whether ``node`` maps a value that is the same at every index to one that is too:
    elementwise ops, indexing and shape ops (a reduction over a filled tensor is not its one
    value)."""
    return is_call(node, *_ELEMENTWISE, methods=_ELEMENTWISE_METHODS)


_CAST_METHODS = ("to", "type", "type_as", "float", "half", "bfloat16")


def _constant(ctx: GraphContext, x):
    """The number a node holds everywhere, through casts: ``c``, ``torch.zeros(...)``,
    ``torch.full(..., c)``, ``torch.tensor(c)`` (transformers 5.17's eager mask writes its 0
    this way); None when it is not a constant."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x
    if is_call(x, torch.zeros_like, torch.zeros, methods=("new_zeros",)):
        return 0
    if is_call(x, torch.full, torch.full_like, methods=("new_full",)) and len(x.args) > 1:
        return _constant(ctx, x.args[1])
    if is_call(x, torch.full) and "fill_value" in x.kwargs:
        return _constant(ctx, x.kwargs["fill_value"])
    if is_call(x, torch.tensor, torch.scalar_tensor) and x.args:
        return _constant(ctx, x.args[0])
    if is_call(x, methods=_CAST_METHODS):
        return _constant(ctx, ctx.resolve(x.args[0]))
    return None


def _is_zero(ctx: GraphContext, x) -> bool:
    """A constant zero (see :func:`_constant`)."""
    return _constant(ctx, x) == 0


def _very_negative(ctx: GraphContext, x) -> bool:
    """A constant at or below -1e4 (-inf, the dtype's min): adding it masks a score out."""
    c = _constant(ctx, x)
    return c is not None and c <= -1e4


def mask_applications(ctx: GraphContext, node) -> list[tuple[fx.Node, str, fx.Node]]:
    """The ways ``node`` may apply a mask to a score tensor, as ``(scores, how, mask)``:
    ``masked_fill(s, blocked, -big)`` ("blocked"), ``where(allowed, s, -big)`` ("allowed"),
    ``s + m`` ("additive", either operand may be the scores); [] for anything else. The caller
    knows which operand is its scores."""
    if not isinstance(node, fx.Node):
        return []

    def negative(v):
        return _very_negative(ctx, ctx.resolve(v) if isinstance(v, fx.Node) else v)

    if is_call(node, torch.masked_fill, methods=("masked_fill",)) and len(node.args) >= 2:
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
        return [(node.args[0], "blocked", node.args[1])] if negative(value) else []
    if is_call(node, torch.where) and len(node.args) == 3:
        return [(node.args[1], "allowed", node.args[0])] if negative(node.args[2]) else []
    if is_call(node, torch.add, operator.add, methods=("add",)) and len(node.args) >= 2:
        a, b = node.args[:2]
        return [(a, "additive", b), (b, "additive", a)]
    return []


def _probe_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """(q_pos, kv_pos) pairs with kv_pos <= q_pos: every small position and distance, and
    positions and distances around each power of two up to 2^22 (4M tokens)."""
    marks = sorted({v for k in range(6, 23) for v in (2**k - 1, 2**k, 2**k + 1, 3 * 2**k)})
    qs = list(range(65)) + marks
    ds = list(range(65)) + marks
    pairs = [(q, q - d) for q in qs for d in ds if d <= q]
    t = torch.tensor(pairs, dtype=torch.int64)
    return t[:, 0], t[:, 1]


def is_all_ones_input(node) -> bool:
    """``torch.ones_like(<graph input>)`` (the attention_mask treefx gives the model), through
    casts and copies."""
    while is_call(node, methods=("to", "bool", "long", "int", "float", "contiguous", "clone",
                                 "view", "reshape")):  # a view of all ones is all ones
        node = node.args[0]
    return is_call(node, torch.ones_like) and isinstance(node.args[0], fx.Node) and \
        node.args[0].op == "placeholder"


def implied_by_tree(lifted: LiftedMask, leaves: tuple[fx.Node, ...]) -> bool:
    """Whether the model's mask is True for every key that the tree lets a query see.

    On a tree a visible key is an ancestor (or the token itself), so its position is at most
    the query's. A mask that is True on every probed pair with kv_pos <= q_pos, reading no data
    but our own all-ones padding mask, is the plain causal mask in positions: the tree mask
    implies it and it can go, keeping the tree's full blocks. A sliding window, chunked
    attention or anything else position-dependent shows up as a False pair and is kept.
    """
    out = _probe(lifted, leaves, *_probe_pairs())
    return out is not None and bool(out.all())


def _probe(lifted: LiftedMask, leaves, q: torch.Tensor, kv: torch.Tensor):
    """The mask at each (q[i], kv[i]) pair, [len(q)] bool; None where it reads data other than
    treefx's all-ones padding mask or cannot be evaluated so."""
    bufs = []
    for leaf in leaves:
        val = example(leaf)
        if not is_all_ones_input(leaf) or val is None or val.dim() != 2 or val.shape[0] != 1:
            return None
        bufs.append(torch.ones(1, int(max(q.max(), kv.max())) + 1, dtype=val.dtype))
    zero = torch.zeros((), dtype=torch.int64)
    try:
        with torch.no_grad():
            out = lifted.evaluate(zero, zero, q, kv, *bufs)
    except Exception:  # noqa: BLE001 - a mask the probe cannot evaluate is not judged here
        return None
    return out.reshape(-1).expand(q.shape[0]) if out.numel() == 1 else out.reshape(-1)


def sees_later_keys(lifted: LiftedMask, leaves: tuple[fx.Node, ...]) -> tuple[int, int] | None:
    """A (q_pos, kv_pos) pair with kv_pos > q_pos that the model's mask lets the query see
    (a bidirectional span: Gemma 3's image tokens, a prefix-LM prefix), or None. A tree gives
    each sequence its own later tokens, so such a mask has no tree form. Probed where the
    mask reads no data but treefx's all-ones padding mask (else None: the first-call check's
    causality probe is left to find it)."""
    kv, q = _probe_pairs()  # swapped: every pair has kv_pos >= q_pos
    later = kv > q
    q, kv = q[later], kv[later]
    out = _probe(lifted, leaves, q, kv)
    if out is None:
        return None
    hit = out.nonzero()
    return None if hit.numel() == 0 else (int(q[hit[0, 0]]), int(kv[hit[0, 0]]))


# ---------------------------------------------------------------------------- windows

_COMPARISONS = {operator.gt: ">", operator.ge: ">=", operator.lt: "<", operator.le: "<=",
                torch.gt: ">", torch.ge: ">=", torch.lt: "<", torch.le: "<=",
                "gt": ">", "ge": ">=", "lt": "<", "le": "<=", "__gt__": ">", "__ge__": ">=",
                "__lt__": "<", "__le__": "<="}
_ANDS = (operator.and_, torch.logical_and, torch.bitwise_and)
_AND_METHODS = ("logical_and", "bitwise_and", "__and__")
_SAME_VALUE_METHODS = ("expand", "expand_as", "view", "reshape", "contiguous", "unsqueeze",
                       "broadcast_to")


def _target_key(node: fx.Node):
    return node.target if node.op in ("call_function", "call_method") else None


def _dtypes(node: fx.Node) -> list:
    """The dtypes a ``to`` names (none: a device move)."""
    return [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)]


def _same_value(node: fx.Node, dtype=None) -> bool:
    """A shape op, or a ``to`` that moves a tensor without casting it (to ``dtype`` at most)."""
    if is_call(node, methods=_SAME_VALUE_METHODS) or is_call(node, *_SHAPE_FUNCS):
        return True
    return is_call(node, methods=("to",)) and all(d is dtype for d in _dtypes(node))


def _same_bool(node: fx.Node) -> bool:
    """A shape op, or a ``to`` that moves a tensor without changing its dtype from bool."""
    return _same_value(node, torch.bool)


def _conjuncts(mask: fx.Node) -> list[fx.Node]:
    """The terms of the AND that ``mask`` is (itself when it is no AND)."""
    out, stack = [], [mask]
    while stack:
        n = stack.pop()
        if isinstance(n, fx.Node) and (is_call(n, *_ANDS, methods=_AND_METHODS)):
            stack.extend(n.args[:2])
        elif isinstance(n, fx.Node) and _same_bool(n) and isinstance(n.args[0], fx.Node):
            stack.append(n.args[0])
        else:
            out.append(n)
    return out


def _affine(node, lifted: LiftedMask):
    """``node`` as ``(a_q, a_kv, c)``: ``a_q * q_pos + a_kv * kv_pos + c`` with integers, or
    None."""
    if isinstance(node, bool) or node is None:
        return None
    if isinstance(node, int):
        return (0, 0, node)
    if not isinstance(node, fx.Node):
        return None
    if node is lifted.positions:
        return None  # a position without a broadcast: its role is not known
    if is_call(node, operator.getitem) and node.args[0] in lifted._vectors \
            and node not in lifted._vectors and _is_pure_view_key(node.args[1]):
        coef = _vector_affine(node.args[0], lifted)
        role = _axis_role(node)
        if coef is None or role not in ("q", "kv"):
            return None
        a, c = coef
        return (a, 0, c) if role == "q" else (0, a, c)
    if _same_value(node):
        return _affine(node.args[0], lifted)
    if is_call(node, operator.add, torch.add, operator.sub, torch.sub, methods=("add", "sub")):
        x, y = _affine(node.args[0], lifted), _affine(node.args[1], lifted)
        if x is None or y is None:
            return None
        sign = -1 if node.target in (operator.sub, torch.sub, "sub") else 1
        return tuple(a + sign * b for a, b in zip(x, y))
    if is_call(node, operator.neg, torch.neg, methods=("neg",)):
        x = _affine(node.args[0], lifted)
        return None if x is None else tuple(-a for a in x)
    if is_call(node, operator.mul, torch.mul, methods=("mul",)):
        x, y = _affine(node.args[0], lifted), _affine(node.args[1], lifted)
        if x is None or y is None:
            return None
        if x[:2] == (0, 0):
            return tuple(x[2] * b for b in y)
        if y[:2] == (0, 0):
            return tuple(a * y[2] for a in x)
    return None


def _vector_affine(node, lifted: LiftedMask):
    """A 1-D index vector as ``(a, c)``: ``a * position + c``, or None."""
    if node is lifted.positions:
        return (1, 0)
    if not isinstance(node, fx.Node):
        return None
    if is_call(node, operator.add, torch.add, operator.sub, torch.sub, methods=("add", "sub")):
        x, y = node.args[:2]
        sign = -1 if node.target in (operator.sub, torch.sub, "sub") else 1
        if isinstance(y, int) and not isinstance(y, bool):
            inner = _vector_affine(x, lifted)
            return None if inner is None else (inner[0], inner[1] + sign * y)
        if isinstance(x, int) and not isinstance(x, bool) and sign == 1:
            return _vector_affine(y, lifted)
    if _same_value(node):
        return _vector_affine(node.args[0], lifted)
    return None


def window_of(lifted: LiftedMask | None) -> int | None:
    """The largest ``q_pos - kv_pos`` the lifted mask admits, when one of its conjuncts bounds
    it (a sliding window: ``kv > q - W`` and its rearrangements), else None.

    Read from the mask's structure, not probed: the mask is an AND of its conjuncts, so a
    conjunct that is False at every distance beyond D makes the mask False there, whatever the
    other conjuncts and buffers are. The tree's block mask may then drop every key block whose
    tokens are all farther than D from the query block's (:func:`treefx.mask.tree_block_tensors`).
    """
    if lifted is None or lifted.negate or not lifted.boolean:
        return None
    best = None
    for term in _conjuncts(lifted.mask):
        op = _COMPARISONS.get(_target_key(term)) if isinstance(term, fx.Node) else None
        if op is None or len(term.args) < 2:
            continue
        left, right = _affine(term.args[0], lifted), _affine(term.args[1], lifted)
        if left is None or right is None:
            continue
        a_q, a_kv, c = (x - y for x, y in zip(left, right))
        if op in ("<", "<="):  # e < 0  <=>  -e > 0
            a_q, a_kv, c, op = -a_q, -a_kv, -c, ">" if op == "<" else ">="
        # a_kv * (kv - q) + c (op) 0 with a_kv > 0:  q - kv (<, <=) c / a_kv
        if a_kv <= 0 or a_q != -a_kv:
            continue
        d = -((-c) // a_kv) - 1 if op == ">" else c // a_kv  # ceil(c/a) - 1, floor(c/a)
        best = d if best is None else min(best, d)
    return best
