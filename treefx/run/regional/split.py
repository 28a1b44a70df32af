"""Regional execution's split: the rewritten graph cut at the model's blocks into pieces (the
glue and one call of each block), each compiled on fake inputs, pieces of one structure once."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from unittest import mock

import torch
import torch.fx as fx

from .. import backends
from ...compiler import TreeCompileError
from .blocks import find_blocks
from .graph import Piece, RegionalGraph, Source
from .guards import dynamic_dims
from .keys import getattr_path, structure_key

__all__ = ["build"]

log = logging.getLogger("treefx")

_ROOT_SOURCE = re.compile(r"^[A-Za-z_]\w*\['[^']*'\]\.?")


def _relative(path: str) -> str:
    return _ROOT_SOURCE.sub("", path, count=1)



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


def _autocast(n: fx.Node) -> str | None:
    """``"enter"`` or ``"exit"`` for Dynamo's autocast nodes, else None."""
    if n.op != "call_function":
        return None
    return {"_enter_autocast": "enter", "_exit_autocast": "exit"}.get(
        getattr(n.target, "__name__", ""))


def _autocast_open(runs) -> list[list[fx.Node]]:
    """The autocast regions open at the start of each run (their enter nodes, outermost
    first): a region the glue opens around the blocks (accelerate's mixed precision wraps the
    model's forward in ``torch.autocast``) is carried into each piece it spans."""
    stack: list[fx.Node] = []
    out = []
    for lab, nodes in runs:
        out.append(list(stack))
        for n in nodes:
            kind = _autocast(n)
            if kind == "enter":
                if n.all_input_nodes:
                    raise TreeCompileError(f"regional execution: autocast entered with "
                                           f"computed arguments ({n.name})")
                stack.append(n)
            elif kind == "exit":
                if not stack or n.args[0] is not stack[-1]:
                    raise TreeCompileError(f"regional execution: autocast regions that do "
                                           f"not nest ({n.name})")
                stack.pop()
    if stack:
        raise TreeCompileError("regional execution: an autocast region is left open at the "
                               "graph's end")
    return out


def _grad_mode_kept(nodes) -> bool:
    grad = [n for n in nodes if getattr(n.target, "__name__", "") == "_set_grad_enabled"]
    return not grad or grad[-1].args[0] == torch.is_grad_enabled()


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
    dims = dynamic_dims(token_args, call_args)
    n_tokens = int(call_args[dims[0][0]].shape[dims[0][1]])
    sources, fakes = _input_sources(placeholders, example_inputs, call_args,
                                    _tensor_names(model), n_tokens)
    runs = _runs(_labels(gm, blocks))
    cuts = [_cut(gm, lab, nodes, sources, opened)
            for (lab, nodes), opened in zip(runs, _autocast_open(runs))]
    compiling = _Compiling(backend, options, fakes)
    pieces = [compiling.compile(c) for c in cuts]
    for a in call_args:
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            # the graph would read the capture's tensors on every call, not the call's
            raise TreeCompileError("regional execution: an argument is a list of tensors (a "
                                   "part's .grad buffers?); only tensors are passed per call")
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    graph = RegionalGraph(
        pieces=pieces, sources={ph.name: sources[ph] for ph in placeholders},
        output=fx.map_arg(out_node.args[0], lambda n: n.name),
        frees=_frees(cuts, out_node, sources), token_args=token_args,
        fake_mode=compiling.fake_mode, call_fakes={
            sources[ph].value: fakes[ph] for ph in placeholders if sources[ph].kind == "arg"},
        num_args=len(call_args),
        call_consts={i: a for i, a in enumerate(call_args) if not isinstance(a, torch.Tensor)},
        dims=dims,
        size_exprs=[sources[ph].value for ph in placeholders if sources[ph].kind == "size"],
        num_compiled=len(compiling.cache))
    graph.read_guards()
    n_blocks = sum(p.block is not None for p in pieces)
    log.info("regional execution: %d piece(s), %d block call(s), %d distinct compiled "
             "(%.1f s)", len(pieces), n_blocks, len(compiling.cache), time.perf_counter() - t0)
    return graph


def _tensor_names(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's and buffer's qualified name in ``model``, by ``id``."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), name)
    return names


def _input_sources(placeholders, example_inputs, call_args, names: dict[int, str],
                   n_tokens: int) -> tuple[dict[fx.Node, Source], dict[fx.Node, object]]:
    """Where each graph input comes from on a call (an argument, the token count, a size, a
    parameter or buffer, a constant), and its example value."""
    sources: dict[fx.Node, Source] = {}
    fakes: dict[fx.Node, object] = {}
    for ph, ex in zip(placeholders, example_inputs):
        fakes[ph] = ph.meta.get("example_value", ex)
        if isinstance(ex, torch.SymInt):  # never int(): that would specialize the symbol
            sources[ph] = Source("size", ex.node.expr)
        elif isinstance(ex, int):
            if ex != n_tokens:
                raise TreeCompileError(f"regional execution: graph input {ph.name} is an "
                                       f"integer ({ex}) other than the token count")
            sources[ph] = Source("n")
        elif any(ex is a for a in call_args):
            sources[ph] = Source("arg", next(i for i, a in enumerate(call_args) if ex is a))
        elif id(ex) in names:
            sources[ph] = Source("param", names[id(ex)])
        else:
            sources[ph] = Source("const", ex)
    return sources, fakes


def _runs(labelled) -> list[tuple[str | None, list[fx.Node]]]:
    """The labelled nodes grouped into runs of one label, in program order."""
    runs: list[tuple[str | None, list[fx.Node]]] = []
    for n, lab in labelled:
        if runs and runs[-1][0] == lab:
            runs[-1][1].append(n)
        else:
            runs.append((lab, [n]))
    return runs


@dataclass
class _Cut:
    """One piece as cut from the whole graph: its block (None: the glue), its graph, its
    parameters' names (relative to the block, or ``("root", name)``), and the whole graph's
    nodes it reads (its parameters, then its inputs) and makes."""

    block: str | None
    gm: fx.GraphModule
    params: list
    in_nodes: list[fx.Node]
    inputs: list[fx.Node]
    out_nodes: list[fx.Node]


def _cut(gm: fx.GraphModule, lab: str | None, nodes: list[fx.Node], sources,
         opened: list[fx.Node] = ()) -> _Cut:
    """The run ``nodes`` (of block ``lab``, or the glue) as a graph of its own: parameters
    and buffers first, then the values other pieces make. ``opened``: the autocast regions
    open where the run starts (:func:`_autocast_open`); the piece enters them itself and
    leaves, at its end, those still open, so each piece computes under the autocast state
    its nodes had in the whole graph (AOTAutograd traces each piece inside its regions)."""
    if not _grad_mode_kept(nodes):
        raise TreeCompileError(
            f"regional execution: the graph changes grad mode across the boundary of "
            f"{'block ' + lab if lab else 'the glue'} ({nodes[0].name} ..)")
    inside = set(nodes) | set(opened)
    params, inputs = [], []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside or a in params or a in inputs:
                continue
            (params if a in sources and sources[a].kind == "param" else inputs).append(a)
    # an enter node is never a value passed between pieces: each piece enters its own
    outputs = [n for n in nodes if _autocast(n) is None and any(u not in inside for u in n.users)]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in params + inputs:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    stack = list(opened)
    for e in opened:
        env[e] = g.node_copy(e, lambda x: env[x])
    attrs = {}
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
        if n.op in ("get_attr", "call_module"):
            attrs[n.target] = getattr_path(gm, n.target)
        kind = _autocast(n)
        if kind == "enter":
            stack.append(n)
        elif kind == "exit":
            stack.pop()
    for e in reversed(stack):
        g.call_function(torch.amp.autocast_mode._exit_autocast, (env[e],))
    g.output(tuple(env[o] for o in outputs))
    rel_params = []
    for p in params:
        name = sources[p].value
        if lab is not None and name.startswith(lab + "."):
            rel_params.append(name[len(lab) + 1:])
        else:
            rel_params.append(("root", name))
    return _Cut(lab, fx.GraphModule(attrs, g), rel_params, params + inputs, inputs, outputs)


def _frees(cuts: list[_Cut], out_node: fx.Node, sources) -> list[list[str]]:
    """After each piece, the values no later piece reads (the last entry: after the output)."""
    last_use: dict[fx.Node, int] = {}
    for i, c in enumerate(cuts):
        for a in c.inputs:
            last_use[a] = i
    for n in out_node.all_input_nodes:
        last_use[n] = len(cuts)
    frees = [[] for _ in range(len(cuts) + 1)]
    for n, i in last_use.items():
        if n not in sources:
            frees[i].append(n.name)
    return frees


class _Compiling:
    """The pieces compiled one by one on fake inputs, each on the outputs of those before it;
    pieces of one structure key share one compiled function (``cache``)."""

    def __init__(self, backend: str, options, fakes: dict):
        self.backend = backend
        self.options = options
        self.fake_mode = torch._guards.detect_fake_mode(
            [f for f in fakes.values() if isinstance(f, torch.Tensor)])
        self.env_fake: dict[fx.Node, object] = dict(fakes)
        self.cache: dict[tuple, object] = {}
        self.tc = torch._guards.TracingContext.try_get()
        self.aot = backend in ("inductor", "aot-eager")

    def compile(self, cut: _Cut) -> Piece:
        """The piece ``cut`` compiled, its outputs' fake values kept for the pieces after."""
        args = [self.env_fake[a] for a in cut.in_nodes]
        n_params = len(cut.params)
        key = structure_key(cut.gm, args)
        # which inputs the compiled piece differentiates: AOTAutograd gives none to an input
        # whose example did not require grad (checked on every call)
        input_grads = [isinstance(f, torch.Tensor) and f.requires_grad
                       for f in args[n_params:]] if self.aot else None
        compiled, outs = self._compiled(key, cut.gm, args)
        if outs is None:
            # Eager pieces: the capture's own example values (an eager tree recurrence reads
            # the tree on the host, which a fake run cannot), else a fake run.
            metas = [o.meta.get("example_value") for o in cut.out_nodes]
            outs = metas if all(m is not None for m in metas) else \
                _fake_run(cut.gm, args, self.fake_mode)
        for o, v in zip(cut.out_nodes, outs):
            self.env_fake[o] = v
        return Piece(cut.block, cut.gm, cut.params, [a.name for a in cut.inputs],
                     [o.name for o in cut.out_nodes],
                     param_meta=[(tuple(f.shape), f.dtype) for f in args[:n_params]],
                     input_dtypes=[getattr(f, "dtype", None) for f in args[n_params:]],
                     input_grads=input_grads, compiled=compiled, key=key)

    def _compiled(self, key: tuple, gm: fx.GraphModule,
                  args: list) -> tuple[object, list | None]:
        """The piece's compiled function and its outputs on fake inputs (None: an eager
        piece's, found by the caller)."""
        compiled, first_outs = self.cache.get(key, (None, None))
        if self.aot and self.tc is not None:
            self.tc.fakify_first_call = True
        try:
            # The compiled piece's outputs, with its strides and autograd flags (the next
            # pieces are compiled for them). A piece that shares another's compiled function
            # gets outputs like the first one's, not the capture's example values, which may
            # differ in both (an example made without requires_grad compiled the next piece
            # to drop that gradient). Same key, same inputs' kinds: same outputs. (Inductor's
            # function runs on fake inputs only on its first call.)
            if compiled is None:
                compiled = backends.compile_graph(self.backend, gm, args, self.options)
                outs = _fake_run(compiled, args, self.fake_mode) if self.aot else None
                self.cache[key] = (compiled, outs)
            else:
                outs = None if first_outs is None else _like(first_outs, self.fake_mode)
        finally:
            if self.tc is not None:
                self.tc.fakify_first_call = False
        return compiled, outs


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

