"""The lifted mask: a model-built mask (or a value the scores read) evaluated at path positions,
one (b, h, q, kv) at a time, as a FlexAttention ``mask_mod`` / ``score_mod`` reads it; and a
side tensor of the scores read where the model computed it (:class:`DenseSide`)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import GraphContext, describe, example, is_call

__all__ = ["DenseSide", "LiftedMask", "LiftedScore", "MaskLiftError", "SHAPE_FUNCS",
           "SHAPE_METHODS", "TABLE", "axis_role", "dense_side", "is_pure_view_key",
           "static_one"]

SHAPE_METHODS = ("expand", "expand_as", "view", "reshape", "unsqueeze", "contiguous",
                 "squeeze", "broadcast_to")
SHAPE_FUNCS = (torch.reshape, torch.unsqueeze, torch.squeeze, torch.broadcast_to)
_ROLES = ("b", "h", "q", "kv")


class MaskLiftError(Exception):
    """The mask subgraph is not an elementwise function of index grids."""


# Marks a node whose value is a table read at path positions by index grids (the positions
# pass's gather of a table cut to the token count): a buffer of the mask, even when the model
# computed it from an ``arange`` of the table's own length (MPT's ALiBi).
TABLE = "treefx_table"


class LiftedMask:
    """``(b, h, q_pos, kv_pos, *buffers) -> bool``: the model's mask at path positions.

    ``q_pos``/``kv_pos`` are the tree positions of the query and key (the caller indexes the
    position table); ``buffers`` are the runtime values of the subgraph's leaf tensors.
    ``dep``: the private graph's nodes that depend on an index source; ``vectors``: those
    still 1-D index vectors; ``uniform``: those with the same value at every index;
    ``fills``: the uniform constructors among them; ``reductions``: reductions of a filled
    tensor that keep its value. ``negate``: the subgraph computes where attention is blocked;
    ``boolean``: a mask (:func:`lift_mask`), or any value (:func:`lift_value`).
    """

    def __init__(self, positions: fx.Node | None, mask: fx.Node, leaves: list[fx.Node], *,
                 dep: set, vectors: set, uniform: set = frozenset(), fills: set = frozenset(),
                 reductions: set = frozenset(), negate: bool = False, boolean: bool = True):
        self.positions = positions
        self.mask = mask
        self.leaves = leaves
        self.dep = dep
        self.vectors = vectors
        self.uniform = uniform
        self.fills = fills
        self.reductions = reductions
        self.negate = negate
        self.boolean = boolean

    def __call__(self, b, h, q_pos, kv_pos, *buffers):
        return self.evaluate(b, h, q_pos, kv_pos, *buffers).reshape(())

    def evaluate(self, b, h, q_pos, kv_pos, *buffers):
        """The mask for (b, h, q_pos, kv_pos); these may be equal-length 1-D tensors of
        pairs (elementwise), which is how :func:`implied_by_tree` probes it."""
        out = _Evaluation(self, b, h, q_pos, kv_pos, buffers).grid(self.mask)
        if not self.boolean:
            return out
        if out.dtype != torch.bool:
            raise MaskLiftError("the mask is not boolean")
        return ~out if self.negate else out


class _Evaluation:
    """One evaluation of a :class:`LiftedMask`: each *vector* node at the index of the axis it
    is broadcast to (``vector``), each *grid* node as a scalar (``grid``), the buffers as
    given (``leaf``); values computed once."""

    def __init__(self, lifted: LiftedMask, b, h, q_pos, kv_pos, buffers):
        self.lifted = lifted
        self.q_pos = q_pos
        self.idx = {"b": b, "h": h}
        self.pos = {"q": q_pos, "kv": kv_pos}
        self.env = dict(zip(lifted.leaves, buffers))
        self.vec_env: dict = {}

    def depends(self, a) -> bool:
        return isinstance(a, fx.Node) and a in self.lifted.dep

    def leaf(self, a):
        if isinstance(a, fx.Node):
            if a in self.env:
                return self.env[a]
            raise MaskLiftError(f"`{describe(a)}` is not a tensor the mask can read")
        return a

    def vector(self, node, role):
        key = (node, role)
        if key in self.vec_env:
            return self.vec_env[key]
        pos = self.pos
        val = example(node)
        if val is not None and val.dim() == 1 and static_one(val.shape[0]):
            role_idx = torch.zeros_like(self.q_pos)  # a size-1 vector broadcasts its one entry
        else:
            role_idx = None
        if node is self.lifted.positions:
            if role not in pos:
                raise MaskLiftError("tree positions broadcast along a batch or head axis")
            out = pos[role]
        elif is_call(node, torch.arange) or node.op == "placeholder":
            if node.op == "placeholder":
                raise MaskLiftError(f"`{node.name}` is not an index the mask can evaluate")
            i = role_idx if role_idx is not None else (pos[role] if role in pos
                                                       else self.idx[role])
            if role in pos and role_idx is None:
                raise MaskLiftError("an arange over the sequence survived the positions pass")
            start, step = _arange_start_step(node)
            out = start + step * i
        elif node.op in ("call_function", "call_method"):
            def value(a):
                return self.vector(a, role) if self.depends(a) else self.leaf(a)
            out = _call(node, _map(node.args, value), _map(node.kwargs, value))
        else:
            raise MaskLiftError(f"cannot evaluate `{describe(node)}` per index")
        self.vec_env[key] = out
        return out

    def grid(self, node):
        if node in self.env:
            return self.env[node]
        if not self.depends(node):
            return self.leaf(node)
        val = example(node)
        out = self._grid_value(node)
        if val is not None and isinstance(out, torch.Tensor) and out.dtype != val.dtype:
            out = out.to(val.dtype)
        self.env[node] = out
        return out

    def _grid_value(self, node):
        lifted = self.lifted
        src = node.args[0] if node.args else None
        if node in lifted.fills:  # a filled tensor's one value, on the positions' device
            return self.q_pos.new_full((), node.args[1], dtype=node.kwargs["dtype"])
        if node in lifted.reductions:  # of a filled tensor, its value (cast by the caller)
            return self.grid(src)
        if _is_broadcast_of_vector(node, lifted.vectors):
            return self.vector(src, axis_role(node))
        if is_call(node, *SHAPE_FUNCS, methods=SHAPE_METHODS) or (
            is_call(node, operator.getitem) and is_pure_view_key(node.args[1])
        ):
            return self.grid(src)
        if is_call(node, operator.getitem) and src in lifted.uniform:
            return self.grid(src)  # any entry of a filled tensor is its one value
        if is_call(node, operator.getitem):
            base = self.grid(src) if self.depends(src) else self.leaf(src)
            key = node.args[1]
            key = tuple(self.grid(k) if self.depends(k) else k for k in key) if isinstance(
                key, tuple) else (self.grid(key) if self.depends(key) else key)
            return base[key]
        if node.op in ("call_function", "call_method"):
            def value(a):
                return self.grid(a) if self.depends(a) else self.leaf(a)
            return _call(node, _map(node.args, value), _map(node.kwargs, value))
        raise MaskLiftError(f"cannot evaluate `{describe(node)}` per index")


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
    ones = tuple(static_one(s) for s in shape)
    for i in (2, 3):
        if not ones[i] and not (isinstance(shape[i], torch.SymInt) and shape[i] == n):
            raise MaskLiftError(f"`{describe(node)}` (shape {tuple(val.shape)}) does not run "
                                "over the queries and keys of the row")
    return DenseSide(ones)


def static_one(n) -> bool:
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


def is_pure_view_key(key) -> bool:
    key = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or k == slice(None) for k in key)


def _is_broadcast_of_vector(node: fx.Node, vectors: set) -> bool:
    if not node.args or node.args[0] not in vectors or node in vectors:
        return False
    val = example(node)
    return val is not None and val.dim() >= 2


def axis_role(node: fx.Node) -> str:
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
        big = [i for i, s in enumerate(sizes) if not static_one(s)]
        if len(big) == 1:
            axis = big[0]
    if axis is None:
        # A size-1 vector: any role reads its only entry.
        return "b"
    from_end = rank - 1 - axis
    if from_end >= len(_ROLES):
        raise MaskLiftError(f"`{describe(node)}` broadcasts to more than 4 dims")
    return _ROLES[::-1][from_end]
