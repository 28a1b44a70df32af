"""Regional execution's run: the split graph's pieces (:class:`Piece`) and
:class:`RegionalGraph`, the glue and the blocks run in program order, each block inside its
module's own call."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ...compiler import TreeCompileError
from .blocks import call_with_forward
from .guards import shape_guards

__all__ = ["Piece", "RegionalGraph", "Source"]

log = logging.getLogger("treefx")


@dataclass
class Source:
    # "arg" (index into the call's args), "n" (the token count), "size" (a size of the call's
    # arguments: ``value`` its expression in their symbols), "param", "const"
    kind: str
    value: object = None


@dataclass
class Piece:
    """One piece of the split graph: the glue (``block`` None) or one call of a block."""

    block: str | None
    gm: fx.GraphModule
    params: list[str]  # names relative to the block module (or the root, for glue)
    inputs: list[str]  # env keys of the values other pieces (or the call) provide
    outputs: list[str]
    param_meta: list[tuple] = field(default_factory=list)  # (shape, dtype) per parameter
    input_dtypes: list = field(default_factory=list)
    input_grads: list | None = None  # compiled to differentiate each input (AOT backends)
    compiled: object = None
    key: tuple | None = None



@dataclass
class RegionalGraph:
    """The split, compiled tree graph of one capture; ``graph(model, args, root_call)``."""

    pieces: list[Piece]
    sources: dict
    output: object
    frees: list
    token_args: tuple
    fake_mode: object
    call_fakes: dict
    num_args: int = 0
    call_consts: dict = field(default_factory=dict)
    dims: list = field(default_factory=list)  # the (argument, dimension) sizes that vary
    symbols: dict = field(default_factory=dict)  # their symbols -> (argument, dimension)
    derived: dict = field(default_factory=dict)  # other names of those sizes -> expressions
    guards: list = field(default_factory=list)
    num_compiled: int = 0
    return_spec: object = None
    return_leaves: list = field(default_factory=list)
    size_exprs: list = field(default_factory=list)  # sizes the graph takes as inputs
    _ok_sizes: set = field(default_factory=set)
    _guards_read: int = -1  # how many guards the shape environment held when they were read

    def read_guards(self) -> None:
        """(Re)read Dynamo's shape guards from the capture's shape environment."""
        self.symbols, self.derived, self.guards = shape_guards(
            self.fake_mode, self.call_fakes, self.dims, self.size_exprs)
        self._guards_read = self._num_guards()
        self._ok_sizes.clear()

    def _num_guards(self) -> int:
        env = getattr(self.fake_mode, "shape_env", None)
        return len(env.guards) if env is not None else 0

    def accepts(self, args) -> bool:
        """Whether these call arguments satisfy the capture's guards (dtypes, devices, ranks,
        and Dynamo's shape guards on the sizes that vary per call)."""
        if len(args) != self.num_args or self._argument_difference(args) is not None:
            return False
        if self._num_guards() != self._guards_read:
            # a compilation after the capture (a lazily compiled backward) added guards
            log.info("regional execution: %d shape guard(s) added since the capture; read "
                     "again", self._num_guards() - self._guards_read)
            self.read_guards()
        sizes = tuple(int(args[i].shape[d]) for i, d in self.dims)
        if sizes in self._ok_sizes:
            return True
        values = self._values(args)
        for g in self.guards:
            if g[0] == "expr":
                if not bool(g[1].xreplace(values)):
                    return False
            else:
                lo, hi = g[2].lower, g[2].upper
                value = values[g[1]]
                if (lo.is_finite and value < lo) or (hi.is_finite and value > hi):
                    return False
        self._ok_sizes.add(sizes)
        return True

    def failed_guard(self, args) -> str | None:
        """What in ``args`` this capture does not accept, in words, the first difference
        :meth:`accepts` checks: an argument's requires_grad, dtype, rank, device or a size kept
        static ("argument 4 requires_grad True, captured False"), a constant argument, or a
        shape guard (None: none of them)."""
        if len(args) != self.num_args:
            return f"{len(args)} arguments, captured with {self.num_args}"
        differs = self._argument_difference(args)
        if differs is not None:
            return differs
        try:
            values = self._values(args)
        except Exception:
            return None
        for g in self.guards:
            if g[0] == "expr" and not bool(g[1].xreplace(values)):
                return f"guard {g[1]}"
            if g[0] == "range":
                lo, hi = g[2].lower, g[2].upper
                value = values[g[1]]
                if (lo.is_finite and value < lo) or (hi.is_finite and value > hi):
                    return f"{g[1]} = {value} outside [{lo}, {hi}]"
        return None

    def _argument_difference(self, args) -> str | None:
        """The first argument ``args`` differ in from the capture's, outside the shape guards
        (what :meth:`accepts` compares first), in words; None: none. Tensors: requires_grad,
        dtype, rank, device, and the sizes Dynamo kept static (all but the dynamic ones are
        baked in); the other arguments are constants of the graph (an empty list: no .grad
        buffers)."""
        for i, f in self.call_fakes.items():
            a = args[i]
            if not isinstance(a, torch.Tensor):
                return f"argument {i} a {type(a).__name__}, captured a tensor"
            for what, got, want in (("requires_grad", a.requires_grad, f.requires_grad),
                                    ("dtype", a.dtype, f.dtype), ("rank", a.dim(), f.dim()),
                                    ("device", a.device.type, f.device.type)):
                if got != want:
                    return f"argument {i} {what} {got}, captured {want}"
            for k, d in enumerate(f.shape):
                if isinstance(d, int) and a.shape[k] != d:
                    return f"argument {i} size {a.shape[k]} in dim {k}, captured {d} (static)"
        for i, v in self.call_consts.items():
            a = args[i]
            if isinstance(v, (int, float, str, bool, type(None))):
                if type(a) is not type(v) or a != v:
                    return f"argument {i} {_brief(a)}, captured the constant {_brief(v)}"
            elif isinstance(v, (list, tuple)) and not v:
                if type(a) is not type(v) or a:
                    return f"argument {i} {_brief(a)}, captured an empty {type(v).__name__}"
            elif a is not v:
                return f"argument {i} another {type(a).__name__} than the capture's"
        return None

    def _values(self, args) -> dict:
        """Each size symbol's value in this call (sympy integers)."""
        import sympy

        values = {s: sympy.Integer(int(args[i].shape[d])) for s, (i, d) in self.symbols.items()}
        for k, v in self.derived.items():
            values[k] = v.xreplace(values)
        return values

    def __call__(self, model: torch.nn.Module, args: tuple, root_call):
        i, d = self.dims[0]
        n = int(args[i].shape[d])
        values = None
        env: dict[str, object] = {}
        for name, src in self.sources.items():
            if src.kind == "arg":
                env[name] = args[src.value]
            elif src.kind == "n":
                env[name] = n
            elif src.kind == "size":
                if values is None:
                    values = self._values(args)
                env[name] = int(src.value.xreplace(values))
            elif src.kind == "const":
                env[name] = src.value

        def run(*_):
            blocks = None
            for i, piece in enumerate(self.pieces):
                ins = [env[k] for k in piece.inputs]
                if piece.block is None:
                    params = _fetch(model, None, piece)
                    _check_grads(piece, ins)
                    outs = piece.compiled(*params, *ins)
                else:
                    if blocks is None:
                        blocks = dict(model.named_modules())
                    outs = _call_block(model, blocks[piece.block], piece, ins)
                for k, v in zip(piece.outputs, outs):
                    env[k] = v
                for k in self.frees[i]:
                    env.pop(k, None)
            outs = fx.node.map_aggregate(self.output, lambda k: env[k]
                                         if isinstance(k, str) else k)
            leaves = [outs[i] if kind == "out" else i for kind, i in self.return_leaves]
            return torch.utils._pytree.tree_unflatten(leaves, self.return_spec)

        return root_call(run)

    def set_return(self, returned, sentinels) -> None:
        """How the traced function builds its return value from the graph's outputs (read off
        the capture's own return value, built by Dynamo from ``sentinels``)."""
        leaves, self.return_spec = torch.utils._pytree.tree_flatten(returned)
        where = {id(t): i for i, t in enumerate(sentinels)}
        self.return_leaves = []
        for leaf in leaves:
            if id(leaf) in where:
                self.return_leaves.append(("out", where[id(leaf)]))
            elif isinstance(leaf, torch.Tensor):
                raise TreeCompileError(
                    "regional execution: the step returns a tensor that is not one of the "
                    "graph's outputs as they are (a view or an op applied after the graph); "
                    "return the values the model computes")
            else:
                self.return_leaves.append(("const", leaf))


def _fetch(model, block, piece: Piece) -> list:
    params = []
    for name, (shape, dtype) in zip(piece.params, piece.param_meta):
        if isinstance(name, tuple):
            owner, name = model, name[1]
        else:
            owner = block if block is not None else model
        p = _get(owner, name)
        if type(p) not in (torch.Tensor, torch.nn.Parameter) or tuple(p.shape) != shape \
                or p.dtype != dtype:
            where = f"block {piece.block}" if piece.block else "the glue between blocks"
            raise TreeCompileError(
                f"regional execution: {where} reads {name} as a {type(p).__name__} of shape "
                f"{tuple(p.shape)} and dtype {p.dtype}, but it was captured as a tensor of "
                f"shape {shape} and dtype {dtype}. A parameter that another FSDP unit owns "
                "(shared between layers, or sharded separately inside a layer) is not "
                "gathered when this block runs: shard whole decoder layers with fully_shard")
        params.append(p)
    return params


def _get(owner, name: str):
    mod, _, leaf = name.rpartition(".")
    m = owner.get_submodule(mod) if mod else owner
    if leaf in m._parameters:
        return m._parameters[leaf]
    if leaf in m._buffers:
        return m._buffers[leaf]
    return getattr(m, leaf)


def _check_grads(piece: Piece, xs) -> None:
    """Refuse an input that requires grad where the piece was compiled for one that does not
    (AOTAutograd would drop its gradient without a word)."""
    if piece.input_grads is None or not torch.is_grad_enabled():
        return
    for x, want, name in zip(xs, piece.input_grads, piece.inputs):
        if not want and isinstance(x, torch.Tensor) and x.requires_grad:
            where = f"block {piece.block}" if piece.block else "the glue between blocks"
            raise TreeCompileError(
                f"regional execution: input {name} of {where} requires grad, but the piece "
                "was compiled for an input that does not, so its gradient would be dropped; "
                "please report this (a capture's example value without requires_grad)")


def _call_block(model, block: torch.nn.Module, piece: Piece, ins: list):
    def forward(*xs):
        for x, want, i in zip(xs, piece.input_dtypes, range(len(xs))):
            if isinstance(x, torch.Tensor) and want is not None and x.dtype != want:
                raise TreeCompileError(
                    f"regional execution: input {piece.inputs[i]} of block {piece.block} "
                    f"reaches it as {x.dtype}, captured as {want}; something around the "
                    "block's call (a hook) changed it")
        _check_grads(piece, xs)
        return tuple(piece.compiled(*_fetch(model, block, piece), *xs))

    return call_with_forward(block, forward, *ins)


def _brief(value, limit: int = 60) -> str:
    """``value``'s repr, cut to ``limit`` characters (a list of tensors stays one line)."""
    text = repr(value)
    if isinstance(value, (list, tuple)) and len(text) > limit:
        return f"a {type(value).__name__} of {len(value)}"
    return text if len(text) <= limit else text[:limit - 3] + "..."
