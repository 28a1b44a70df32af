"""Regional execution: the rewritten tree graph cut at the model's blocks (its decoder layers),
each block's piece compiled once per distinct layer and run through the block module's own
call.

Why. A sharded model (FSDP2's ``fully_shard`` per decoder layer) gathers a layer's parameters
in a forward pre-hook of that layer and frees them in its post-hook; DDP reduces gradients from
hooks its wrapper installs. Those hooks are eager Python around each module call (collectives,
storage resizing, streams); Dynamo cannot trace them into the one graph the passes need, and
the passes need the whole forward at once (the tree mask is built once and read by every
layer; positions are evaluated before the first layer). So treefx keeps the capture whole and
cuts *after* the passes:

1. **Capture** (:func:`capture_state`) on the model as it computes: every FSDP unit gathered
   (``unshard``), FSDP's own hooks hidden from Dynamo (replaced by the one thing they do to the
   values, the mixed-precision input and output casts), DDP's wrapper skipped. The passes then
   run on the whole graph exactly as without regions.
2. **Split** (:func:`build`): each node belongs to the outermost block module in its
   ``nn_module_stack`` (the FSDP units below the root; otherwise the layers Hugging Face names
   in ``_no_split_modules``; otherwise the children of a ``ModuleList``), treefx's own nodes
   between two nodes of one block to that block, everything else to the glue before, between
   and after the blocks. Each piece becomes a graph of its own: parameters and buffers are its
   first inputs, read from the module *when it runs*; the values other pieces made are the
   rest.
3. **Compile**: pieces are compiled one by one with the treefx backend (Inductor or eager),
   on fake inputs, as Dynamo's own DDP optimizer does. Pieces with the same code on inputs of
   the same kinds (the decoder layers of one type) share one compiled function: compile time
   is one layer per layer type, plus the glue, whatever the depth.
4. **Run** (:class:`RegionalGraph`): the glue and blocks run in program order; a block runs
   inside ``nn.Module.__call__`` of its module with the module's ``forward`` pointed at the
   compiled piece, so FSDP gathers, frees, casts and reduce-scatters around it exactly as in
   eager training, and the root's call (FSDP's root hooks, or the DDP wrapper's) wraps the
   whole. Activation checkpointing captured in a block stays inside its piece.

What keeps it exact: the pieces are the rewritten graph's own nodes, run in the graph's order;
every parameter a piece reads is checked when it runs (a plain tensor of the captured shape and
dtype, so a shard or a parameter of another FSDP unit is an error, not a silent misread); the
inputs' dtypes after the hooks are checked against the capture; Dynamo's shape guards on the
token count (and a part's other sizes) are re-evaluated on every call, and the call's other
arguments compared with the capture's (numbers are constants of the graph, other sizes
static): a call that differs is captured anew; a model
whose blocks or root carry forward hooks besides FSDP's is refused (they were traced into the
graph and would run twice).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.fx as fx

from . import backends
from ..compiler import TreeCompileError
# what the model is wrapped in (read here too by the model's and the engine's callers)
from .wrapping import distributed_kind, fsdp_module_type, fsdp_units, is_fsdp_hook, \
    is_fsdp_unit, unwrap_ddp

__all__ = ["RegionalGraph", "build", "capture_state", "distributed_kind", "find_blocks",
           "is_fsdp_unit", "unwrap_ddp"]

log = logging.getLogger("treefx")

_GLOBAL_STATE = {"_set_grad_enabled", "_enter_autocast", "_exit_autocast"}


# --------------------------------------------------------------------------------------------
# The blocks (what the model is wrapped in: treefx.run.wrapping)
# --------------------------------------------------------------------------------------------

def find_blocks(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The block modules, by qualified name: the FSDP units below the root; else the modules
    of the classes a Hugging Face model names in ``_no_split_modules`` (its decoder layers);
    else the children of the model's ``ModuleList``\\ s. Outermost only."""
    fsdp = fsdp_module_type()
    named = list(model.named_modules())
    if fsdp is not None and any(isinstance(m, fsdp) for _, m in named):
        picked = [(n, m) for n, m in named if n and isinstance(m, fsdp)]
    else:
        classes = set()
        for _, m in named:
            classes.update(getattr(m, "_no_split_modules", None) or ())
        picked = [(n, m) for n, m in named if n and type(m).__name__ in classes]
        if not picked:
            picked = [(f"{n}.{c}" if n else c, child) for n, m in named
                      if isinstance(m, torch.nn.ModuleList) and len(m) > 1
                      for c, child in m.named_children()]
    out: dict[str, torch.nn.Module] = {}
    for n, m in sorted(picked, key=lambda x: x[0].count(".")):
        if not any(n.startswith(p + ".") for p in out):
            out[n] = m
    return out


def _non_fsdp_hooks(module: torch.nn.Module) -> list:
    hooks = []
    for d in (module._forward_pre_hooks, module._forward_hooks):
        hooks += [h for h in d.values() if not (is_fsdp_hook(h) or _is_traced_output_hook(h))]
    return hooks


# Forward hooks known to act only on the module's output tensor, which the capture traced into
# the tree graph: regional execution leaves them out of the module's own call (the block's
# output there is the graph piece's tuple), so they act once, in the graph. Hugging Face's
# ``enable_input_require_grads`` hook on the input embeddings (``output.requires_grad_(True)``,
# registered with activation checkpointing by verl's and PEFT's set-ups).
_TRACED_OUTPUT_HOOKS = {("transformers.modeling_utils",
                         "PreTrainedModel.enable_input_require_grads.<locals>."
                         "make_inputs_require_grads")}


def _is_traced_output_hook(hook) -> bool:
    return (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)) in \
        _TRACED_OUTPUT_HOOKS


@contextlib.contextmanager
def _traced_output_hooks_hidden(module: torch.nn.Module):
    hidden = {k: h for k, h in module._forward_hooks.items() if _is_traced_output_hook(h)}
    for k in hidden:
        del module._forward_hooks[k]
    try:
        yield
    finally:
        module._forward_hooks.update(hidden)


# --------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def capture_state(model: torch.nn.Module):
    """The model as it computes, for Dynamo: every FSDP unit gathered, FSDP's hooks hidden
    (their mixed-precision input/output casts kept as traceable hooks); all restored after."""
    units = fsdp_units(model)
    if not units:
        yield
        return
    saved = []
    root_state = units[0]._get_fsdp_state()
    root_state._lazy_init()
    try:
        for m in units:
            m.unshard()
        for m in units:
            saved.append((m, m._forward_pre_hooks, m._forward_hooks))
            pre = type(m._forward_pre_hooks)(
                (k, h) for k, h in m._forward_pre_hooks.items() if not is_fsdp_hook(h))
            post = type(m._forward_hooks)(
                (k, h) for k, h in m._forward_hooks.items() if not is_fsdp_hook(h))
            policy = getattr(m._get_fsdp_state(), "_mp_policy", None)
            cast_in = getattr(policy, "param_dtype", None) if getattr(
                policy, "cast_forward_inputs", False) else None
            cast_out = getattr(policy, "output_dtype", None)
            m._forward_pre_hooks, m._forward_hooks = pre, post
            if cast_in is not None:
                h = m.register_forward_pre_hook(_casting(cast_in), prepend=True,
                                                with_kwargs=True)
                m._forward_pre_hooks_with_kwargs[h.id] = True
            if cast_out is not None:
                m.register_forward_hook(_casting_output(cast_out))
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post
        for m in units:
            m.reshard()


def _cast_floats(dtype, x):
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, x)


def _casting(dtype):
    def cast_inputs(module, args, kwargs):  # FSDP's MixedPrecisionPolicy.cast_forward_inputs
        return _cast_floats(dtype, args), _cast_floats(dtype, kwargs)
    return cast_inputs


def _casting_output(dtype):
    def cast_output(module, args, output):  # FSDP's MixedPrecisionPolicy.output_dtype
        return _cast_floats(dtype, output)
    return cast_output


# --------------------------------------------------------------------------------------------
# Split and compile
# --------------------------------------------------------------------------------------------

_ROOT_SOURCE = re.compile(r"^[A-Za-z_]\w*\['[^']*'\]\.?")


def _relative(path: str) -> str:
    return _ROOT_SOURCE.sub("", path, count=1)


@dataclass
class _Source:
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


def _structure_key(gm: fx.GraphModule, fakes) -> tuple:
    """Everything a compiled piece depends on: its nodes (ops, targets, constants, wiring,
    higher-order bodies, recursively) and its inputs' kinds. Equal keys: one compiled piece
    serves both."""
    index: dict[fx.Node, int] = {}
    rows = []

    def arg(a):
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", arg(a.start), arg(a.stop), arg(a.step))
        return _object_key(a)

    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        target = n.target
        if n.op == "get_attr":
            sub = getattr_path(gm, target)
            target = _structure_key(sub, ()) if isinstance(sub, fx.GraphModule) else \
                ("attr", id(sub))
        elif n.op == "placeholder":
            target = "placeholder"
        elif callable(target):
            target = _object_key(target)
        rows.append((n.op, target, arg(n.args), arg(n.kwargs)))
    kinds = []
    for f in fakes:
        if isinstance(f, torch.Tensor):
            kinds.append(("t", str(f.dtype), str(f.device), str(tuple(f.shape)),
                          str(f.stride()), bool(f.requires_grad)))
        else:
            kinds.append(("v", str(f)))
    return (tuple(rows), tuple(kinds))


# Per-site state of treefx's own call targets that does not change what they compute: the
# node name they were made for, and the layouts a site recorded while it was traced.
_NOT_CONFIG = frozenset({"__name__", "layouts"})


def _object_key(a, depth: int = 0):
    """A key equal for two objects that compute the same thing: values by value, treefx's own
    callables (an attention site, a recurrence site: one object per layer) by their
    configuration, recursively; anything else (functions, closures, tensors, modules) by
    identity."""
    if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device,
                      torch.layout, torch.memory_format)):
        return (type(a).__name__, repr(a))
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_object_key(x, depth + 1) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((repr(k), _object_key(v, depth + 1)) for k, v in a.items()))
    if isinstance(a, (set, frozenset)):
        return ("set", tuple(sorted(repr(_object_key(x, depth + 1)) for x in a)))
    if isinstance(a, fx.GraphModule):
        return ("graph", _structure_key(a, ()))
    cls = type(a)
    if depth < 6 and cls.__module__.startswith("treefx.") and hasattr(a, "__dict__") \
            and not isinstance(a, torch.nn.Module):
        return ("treefx", cls.__module__, cls.__qualname__, tuple(
            (k, _object_key(v, depth + 1)) for k, v in sorted(vars(a).items())
            if k not in _NOT_CONFIG))
    return ("id", id(a), cls.__qualname__)


def getattr_path(obj, target: str):
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _labels(gm: fx.GraphModule, blocks: dict) -> list[tuple[fx.Node, str | None]]:
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    labels = []
    for n in nodes:
        lab = None
        for path, _ in (n.meta.get("nn_module_stack") or {}).values():
            rel = _relative(path)
            if rel in blocks:
                lab = rel
                break
        labels.append(lab)
    # treefx's own nodes (no module stack) between two nodes of one block belong to it
    known = [i for i, lab in enumerate(labels) if lab is not None]
    for a, b in zip(known, known[1:]):
        if labels[a] == labels[b]:
            for i in range(a + 1, b):
                labels[i] = labels[a]
    return list(zip(nodes, labels))


def _global_state_balanced(nodes) -> bool:
    depth = 0
    grad = []
    for n in nodes:
        name = getattr(n.target, "__name__", "")
        if name == "_enter_autocast":
            depth += 1
        elif name == "_exit_autocast":
            depth -= 1
        elif name == "_set_grad_enabled":
            grad.append(n)
    return depth == 0 and (not grad or grad[-1].args[0] == torch.is_grad_enabled())


def build(gm: fx.GraphModule, example_inputs, *, backend: str, model: torch.nn.Module,
          call_args: tuple, token_args: tuple[int, ...], options=None) -> RegionalGraph:
    """Split the rewritten graph ``gm`` (Dynamo's, after the passes) at ``model``'s blocks
    and compile the pieces; called inside the Dynamo backend (its tracing context and fake
    mode). ``call_args``: the traced function's arguments; ``token_args``: the sizes that vary
    per call, as the engine marks them dynamic: ``i`` (the last dimension of ``call_args[i]``,
    the token count for the first) or ``(i, dim)`` (a part's other sizes: its context, labels,
    states). ``options``: the capture's :class:`~treefx.options.Options`."""
    t0 = time.perf_counter()
    blocks = find_blocks(model)
    if not blocks:
        raise TreeCompileError("regional execution: the model has no blocks (no FSDP units, "
                               "no _no_split_modules layers, no ModuleList) to cut it at")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise TreeCompileError("regional execution: the graph's inputs changed in the passes")
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), name)
    dims = _dynamic_dims(token_args, call_args)
    n_tokens = int(call_args[dims[0][0]].shape[dims[0][1]])
    sources: dict[fx.Node, _Source] = {}
    fakes: dict[fx.Node, object] = {}
    for ph, ex in zip(placeholders, example_inputs):
        fakes[ph] = ph.meta.get("example_value", ex)
        if isinstance(ex, torch.SymInt):  # never int(): that would specialize the symbol
            sources[ph] = _Source("size", ex.node.expr)
        elif isinstance(ex, int):
            if ex != n_tokens:
                raise TreeCompileError(f"regional execution: graph input {ph.name} is an "
                                       f"integer ({ex}) other than the token count")
            sources[ph] = _Source("n")
        elif any(ex is a for a in call_args):
            sources[ph] = _Source("arg", next(i for i, a in enumerate(call_args) if ex is a))
        elif id(ex) in names:
            sources[ph] = _Source("param", names[id(ex)])
        else:
            sources[ph] = _Source("const", ex)

    labelled = _labels(gm, blocks)
    runs: list[tuple[str | None, list[fx.Node]]] = []
    for n, lab in labelled:
        if runs and runs[-1][0] == lab:
            runs[-1][1].append(n)
        else:
            runs.append((lab, [n]))
    where: dict[fx.Node, int] = {}
    for i, (_, nodes) in enumerate(runs):
        for n in nodes:
            where[n] = i
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    last_use: dict[fx.Node, int] = {}
    pieces: list[Piece] = []
    for i, (lab, nodes) in enumerate(runs):
        if not _global_state_balanced(nodes):
            raise TreeCompileError(
                f"regional execution: the graph changes grad mode or autocast across the "
                f"boundary of {'block ' + lab if lab else 'the glue'} ({nodes[0].name} ..)")
        inside = set(nodes)
        params, inputs = [], []
        for n in nodes:
            for a in n.all_input_nodes:
                if a in inside or a in params or a in inputs:
                    continue
                (params if a in sources and sources[a].kind == "param" else inputs).append(a)
        for a in inputs:
            last_use[a] = i
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in params + inputs:
            env[a] = g.placeholder(a.name)
            env[a].meta = dict(a.meta)
        attrs = {}
        for n in nodes:
            env[n] = g.node_copy(n, lambda x: env[x])
            if n.op in ("get_attr", "call_module"):
                attrs[n.target] = getattr_path(gm, n.target)
        g.output(tuple(env[o] for o in outputs))
        piece_gm = fx.GraphModule(attrs, g)
        rel_params = []
        for p in params:
            name = sources[p].value
            if lab is not None and name.startswith(lab + "."):
                rel_params.append(name[len(lab) + 1:])
            else:
                rel_params.append(("root", name))
        pieces.append(Piece(lab, piece_gm, rel_params, [a.name for a in inputs],
                            [o.name for o in outputs]))
        pieces[-1]._in_nodes = params + inputs  # for compiling, dropped after
        pieces[-1]._out_nodes = outputs
    for n in out_node.all_input_nodes:
        last_use[n] = len(runs)

    fake_mode = torch._guards.detect_fake_mode(
        [f for f in fakes.values() if isinstance(f, torch.Tensor)])
    env_fake: dict[fx.Node, object] = dict(fakes)
    cache: dict[tuple, object] = {}
    tc = torch._guards.TracingContext.try_get()
    for piece in pieces:
        args = [env_fake[a] for a in piece._in_nodes]
        piece.param_meta = [(tuple(f.shape), f.dtype) for f in args[:len(piece.params)]]
        piece.input_dtypes = [getattr(f, "dtype", None) for f in args[len(piece.params):]]
        piece.key = _structure_key(piece.gm, args)
        compiled, first_outs = cache.get(piece.key, (None, None))
        aot = backend in ("inductor", "aot-eager")
        if aot:
            # which inputs the compiled piece differentiates: AOTAutograd gives none to an
            # input whose example did not require grad (checked on every call)
            piece.input_grads = [isinstance(f, torch.Tensor) and f.requires_grad
                                 for f in args[len(piece.params):]]
        if aot and tc is not None:
            tc.fakify_first_call = True
        try:
            # The compiled piece's outputs, with its strides and autograd flags (the next
            # pieces are compiled for them). A piece that shares another's compiled function
            # gets outputs like the first one's, not the capture's example values, which may
            # differ in both (an example made without requires_grad compiled the next piece
            # to drop that gradient). Same key, same inputs' kinds: same outputs. (Inductor's
            # function runs on fake inputs only on its first call.)
            if compiled is None:
                compiled = backends.compile_graph(backend, piece.gm, args, options)
                outs = _fake_run(compiled, args, fake_mode) if aot else None
                cache[piece.key] = (compiled, outs)
            else:
                outs = None if first_outs is None else _like(first_outs, fake_mode)
        finally:
            if tc is not None:
                tc.fakify_first_call = False
        if outs is None:
            # Eager pieces: the capture's own example values (an eager tree recurrence reads
            # the tree on the host, which a fake run cannot), else a fake run.
            metas = [o.meta.get("example_value") for o in piece._out_nodes]
            outs = metas if all(m is not None for m in metas) else \
                _fake_run(piece.gm, args, fake_mode)
        piece.compiled = compiled
        for o, v in zip(piece._out_nodes, outs):
            env_fake[o] = v
        del piece._in_nodes, piece._out_nodes
    frees = [[] for _ in range(len(runs) + 1)]
    for n, i in last_use.items():
        if n not in sources:
            frees[i].append(n.name)
    graph = RegionalGraph(
        pieces=pieces, sources={ph.name: sources[ph] for ph in placeholders},
        output=fx.map_arg(out_node.args[0], lambda n: n.name), frees=frees,
        token_args=token_args, fake_mode=fake_mode, call_fakes={
            sources[ph].value: fakes[ph] for ph in placeholders if sources[ph].kind == "arg"})
    graph.num_args = len(call_args)
    for a in call_args:
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            # the graph would read the capture's tensors on every call, not the call's
            raise TreeCompileError("regional execution: an argument is a list of tensors (a "
                                   "part's .grad buffers?); only tensors are passed per call")
    graph.call_consts = {i: a for i, a in enumerate(call_args)
                         if not isinstance(a, torch.Tensor)}
    graph.dims = dims
    graph.size_exprs = [sources[ph].value for ph in placeholders if sources[ph].kind == "size"]
    graph.read_guards()
    n_blocks = sum(p.block is not None for p in pieces)
    log.info("regional execution: %d piece(s), %d block call(s), %d distinct compiled "
             "(%.1f s)", len(pieces), n_blocks, len(cache), time.perf_counter() - t0)
    graph.num_compiled = len(cache)
    return graph


def _like(outs, fake_mode) -> list:
    """Fresh fake tensors of ``outs``' shapes, strides, dtypes, devices and autograd flags
    (other values as they are)."""
    with fake_mode:
        return [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device,
                                    requires_grad=o.requires_grad)
                if isinstance(o, torch.Tensor) else o for o in outs]


def _fake_run(fn, args, fake_mode):
    with fake_mode, mock.patch.object(fake_mode, "allow_non_fake_inputs", True):
        return fn(*args)


def _dynamic_dims(token_args, call_args) -> list[tuple[int, int]]:
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


def _shape_guards(fake_mode, call_fakes: dict, dims, size_exprs) -> tuple[dict, dict, list]:
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


# --------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------

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
        self.symbols, self.derived, self.guards = _shape_guards(
            self.fake_mode, self.call_fakes, self.dims, self.size_exprs)
        self._guards_read = self._num_guards()
        self._ok_sizes.clear()

    def _num_guards(self) -> int:
        env = getattr(self.fake_mode, "shape_env", None)
        return len(env.guards) if env is not None else 0

    def accepts(self, args) -> bool:
        """Whether these call arguments satisfy the capture's guards (dtypes, devices, ranks,
        and Dynamo's shape guards on the sizes that vary per call)."""
        if len(args) != self.num_args:
            return False
        for i, f in self.call_fakes.items():
            a = args[i]
            if not isinstance(a, torch.Tensor) or a.dtype != f.dtype or a.dim() != f.dim() \
                    or a.device.type != f.device.type or a.requires_grad != f.requires_grad:
                return False
            # sizes Dynamo kept static (all but the dynamic ones) are baked in
            if any(isinstance(d, int) and a.shape[k] != d for k, d in enumerate(f.shape)):
                return False
        for i, v in self.call_consts.items():  # other arguments are constants of the graph
            a = args[i]
            if isinstance(v, (int, float, str, bool, type(None))):
                if type(a) is not type(v) or a != v:
                    return False
            elif isinstance(v, (list, tuple)) and not v:  # an empty list (no .grad buffers)
                if type(a) is not type(v) or a:
                    return False
            elif a is not v:
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
        """Which of this capture's shape guards ``args`` fail, in words (None: none of them;
        the difference is elsewhere, in a dtype, a device or a constant)."""
        if len(args) != self.num_args:
            return f"{len(args)} arguments, captured with {self.num_args}"
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


@contextlib.contextmanager
def forward_replaced(module: torch.nn.Module, forward):
    """``forward`` in place of ``module``'s own forward, restored after."""
    had = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if had:
            module.forward = old
        else:
            del module.forward


def call_with_forward(module: torch.nn.Module, forward, *args):
    """``nn.Module.__call__(module, *args)`` (its hooks: FSDP's gather and free, DDP's)
    with ``forward`` in place of the module's own forward for this call."""
    with forward_replaced(module, forward), _traced_output_hooks_hidden(module):
        return torch.nn.Module.__call__(module, *args)


def check_hooks(model: torch.nn.Module, wrapper=None) -> None:
    """Refuse forward hooks (other than FSDP's) on the modules regional execution calls: the
    capture traced them into the graph, so calling the module would run them again."""
    mods = [("the model", model)] + [(f"block {n}", m) for n, m in find_blocks(model).items()]
    for what, m in mods:
        hooks = _non_fsdp_hooks(m)
        if hooks:
            raise TreeCompileError(
                f"regional execution: {what} ({type(m).__name__}) has forward hooks besides "
                f"FSDP's ({', '.join(getattr(h, '__qualname__', repr(h)) for h in hooks[:3])}); "
                "they were traced into the tree graph and would run twice. Remove them, or "
                "register them on a module inside the layer")
    glob = torch.nn.modules.module
    if getattr(glob, "_global_forward_hooks", None) or \
            getattr(glob, "_global_forward_pre_hooks", None):
        raise TreeCompileError("regional execution: global module forward hooks are "
                               "registered; they would run twice")
