"""The engine: capture a function around the model with Dynamo, rewrite the graph for trees,
compile it, and check that the rewritten graph is what ran.

The capture traces one function around the model: it calls the model on the DFS row and reads
each token's log-probability at its tree predecessor. The tree tensors enter as one real graph
input, ``tree_info`` [3, N] (positions, parent_token, subtree_end), so the passes can wire them
into the nodes they rewrite. N is dynamic: trees of any size reuse one compiled graph.
A compiled model (:mod:`treefx.tree_model`) and a compiled training step (:mod:`treefx.step`)
share this engine.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
import weakref

import torch
import torch.fx as fx

from . import backends, regional
from .attn_impl import eager_attention
from .hf_packing import one_sequence_per_path
from . import families  # noqa: F401  (registers what treefx knows of model families)
from .compiler.recurrences import UnsupportedLayerError, capture_patches, discover
from .layout import TreeBatch
from .ops.attention import check_interleave_heads, check_kernel_options
from .compiler import GraphBreakError, GraphContext, TreeCompileError, run_passes
from .compiler.graph import example, graph_code, module_path
from .compiler.lower.parts import PartSites, part_outputs
from .reference import output_vocab_size, vocab_size

__all__ = ["TreeEngine", "check_batch", "make_traced", "tree_info", "unwrap_compiled"]

log = logging.getLogger("treefx")


def make_traced(template, tag: int, **cells):
    """A fresh copy of ``template`` whose globals also hold ``cells`` (model, options, the
    user's step function).

    Its own code object gives it its own Dynamo cache, so many compiled models never share or
    exhaust one function's recompile limit (which would fall back to the untransformed model).
    """
    code = template.__code__.replace(co_name=f"treefx_{template.__name__.strip('_')}_{tag}")
    glb = dict(template.__globals__)
    glb.update(cells)
    return types.FunctionType(code, glb, code.co_name)


class TreeEngine:
    """What a compiled model and a compiled training step share: the Dynamo capture with a
    treefx backend per device kind, the passes, the error translation, and the check that the
    rewritten graph (not a fallback to the untransformed code) ran.

    ``make_traced(tag)`` returns a fresh traced function; its graph inputs must include
    ``input_ids`` [1, N] and ``tree_info`` [3, N] (and ``tree_weights`` [2, N] for a step).
    """

    def __init__(self, make_traced, backend: str, block_size: int, kernel_options=None,
                 interleave_heads: bool | None = None, regional: bool | None = None):
        self.make_traced = make_traced
        if regional not in (None, True, False):
            raise TypeError(f"regional must be True, False or None, got {regional!r}")
        self.regional = regional
        self._regional: dict[tuple, list] = {}  # guard key -> captured regional graphs
        self.backend = backends.check(backend)
        self.block_size = block_size
        self.kernel_options = check_kernel_options(kernel_options)
        self.interleave_heads = check_interleave_heads(interleave_heads, self.kernel_options)
        self.num_compilations = 0
        self.contexts: list[GraphContext] = []
        # the parameters whose .grad a part's graph is given, in the order of its `grads`
        # input (set by treefx.backward's runner; see treefx.passes.parts.route_gradients)
        self.grad_params: tuple = ()
        self._runs = 0
        self._compiled: dict[str, object] = {}
        self._prepared: weakref.WeakSet = weakref.WeakSet()  # models made ready for capture

    def resolve_backend(self, device: torch.device) -> str:
        return backends.resolve(self.backend, device)

    def _dynamo_backend(self, backend: str):
        def compile_graph(gm: fx.GraphModule, example_inputs):
            ctx = _context(gm, backend, self.block_size, self.kernel_options,
                           self.interleave_heads)
            self.contexts.append(ctx)  # before the passes: a failed graph can be reported
            # the parameters among the real inputs, by position (nothing else kept alive)
            ctx.example_inputs = [x if isinstance(x, torch.nn.Parameter) else None
                                  for x in example_inputs]
            ctx.grad_params = self.grad_params
            run_passes(ctx)
            ctx.done = True
            self.num_compilations += 1
            log.info("compiled a tree graph (%s backend, %d so far)", backend,
                     self.num_compilations)
            compiled = backends.compile_graph(backend, ctx.gm, example_inputs)

            def run(*args):
                self._runs += 1
                return compiled(*args)

            return run

        return compile_graph

    def __call__(self, device: torch.device, *args, dynamic: tuple[int, ...] = (),
                 discover_in: torch.nn.Module | None = None, root=None):
        """Run the compiled function on ``args`` (compiling on first use per backend);
        ``dynamic``: indices of the args whose last dim is the token count N; ``discover_in``:
        the model the function calls, made ready for capture once (:func:`prepare_model`);
        ``root``: what the user holds (the model, or its DDP wrapper), whose call wraps a
        regional run (:mod:`treefx.regional`)."""
        backend = self.resolve_backend(device)
        if discover_in is not None and discover_in not in self._prepared:
            prepare_model(discover_in)
            self._prepared.add(discover_in)
        if discover_in is not None and self.uses_regions(discover_in, root):
            return self._call_regional(backend, args, dynamic, discover_in, root)
        if backend not in self._compiled:
            self._compiled[backend] = torch.compile(
                self.make_traced(len(self._compiled)), backend=self._dynamo_backend(backend),
                fullgraph=True,
            )
        _mark_dynamic(args, dynamic)
        runs = self._runs
        with self._errors(args, dynamic):
            # Registered recurrent kernels appear as single marker nodes (treefx.kernels);
            # the swap is in place on every call so that Dynamo's guards always see it.
            with capture_environment(discover_in), self._shapes():
                out = self._compiled[backend](*args)
        if self._runs == runs:
            raise TreeCompileError(
                "the tree graph did not run: Dynamo fell back to the unmodified code (recompile "
                "limit?). Its output would be silently wrong, so treefx stops here."
            )
        return out

    # Duck shaping (one symbol for equal sizes at capture) stays on for whole batches; a
    # part's graph turns it off (see treefx.part_run): its sizes (tokens, context, labels,
    # states) are unrelated and often equal on the first call.
    duck_shape = True

    def _shapes(self):
        if self.duck_shape:
            return contextlib.nullcontext()
        import torch.fx.experimental._config as fx_config

        return fx_config.patch(use_duck_shape=False)

    def uses_regions(self, model: torch.nn.Module, root=None) -> bool:
        """Whether calls run regionally: ``regional=True``, or (``None``) a model sharded with
        FSDP2 or wrapped in DDP. ``regional=False`` with either is an error."""
        kind = regional.distributed_kind(model, root if root is not model else None)
        if self.regional is False and kind is not None:
            raise TreeCompileError(
                f"regional=False, but the model is wrapped for {kind.upper()}, whose hooks run "
                "around each module call: treefx runs such a model regionally (leave "
                "regional=None)")
        return bool(self.regional) or kind is not None

    @contextlib.contextmanager
    def _errors(self, args, dynamic):
        """Dynamo's and the backend's errors as treefx's."""
        try:
            yield
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None) or e.__cause__
            if isinstance(inner, TreeCompileError):
                raise inner from None
            from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

            if isinstance(inner, GuardOnDataDependentSymNode):
                raise TreeCompileError(
                    f"compiling the tree graph failed: code it runs branches on a value "
                    f"computed from the data ({_user_frame(inner)}), which torch.compile "
                    "cannot trace, in the forward or in a custom op's backward. Hugging Face's "
                    "grouped-matmul fallback for MoE experts (float32 on the GPU) does this: "
                    "model.set_experts_implementation('batched_mm'), or train in bf16, or "
                    "use backend='eager'") from e
            raise
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            raise _graph_break_error(self.make_traced(-1), args, e) from None
        except torch._dynamo.exc.TorchRuntimeError as e:
            n = args[dynamic[0]].shape[-1] if dynamic else None
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            # Dynamo's message names the failing call, then the error: "... got RuntimeError(...)"
            why = next((ln[ln.index("got ") + 4:] for ln in lines if "got " in ln), lines[0])
            raise TreeCompileError(
                f"the model failed while Dynamo traced it on the tree's row of {n} tokens: "
                f"{why[:400]}. A model that cuts a fixed-length table to the token count "
                "(an ALiBi or local-attention table, learned positions) takes at most the "
                "table's length in tokens in one tree batch; pack fewer trees per batch or "
                "split them (treefx.partition)."
            ) from e

    # ------------------------------------------------------------------ regional

    def _call_regional(self, backend, args, dynamic, model, root):
        key = (backend, id(model), torch.is_grad_enabled(),
               tuple(m.training for m in model.modules()),
               torch.is_autocast_enabled("cuda") if hasattr(torch, "is_autocast_enabled")
               else None)
        graphs = self._regional.setdefault(key, [])
        graph = next((g for g in graphs if g.accepts(args)), None)
        if graph is None:
            if len(graphs) >= 8:
                raise TreeCompileError(
                    "regional execution: 8 captures for one model state and none accepts "
                    f"this batch ({args[dynamic[0]].shape[-1]} tokens); Dynamo's shape "
                    "guards on the token count keep failing")
            regional.check_hooks(model, root)
            graph = self._capture_regional(backend, args, dynamic, model)
            graphs.append(graph)
        wrapper = root if root is not None and root is not model else None
        ids = args[dynamic[0]]
        if wrapper is not None:  # DDP: its forward calls the inner module, which runs ours
            def root_call(run):
                with regional.forward_replaced(wrapper.module, run):
                    return wrapper(ids)
        elif regional.is_fsdp_unit(model):  # FSDP's root hooks wrap the run
            def root_call(run):
                return regional.call_with_forward(model, run, ids)
        else:
            def root_call(run):
                return run()
        self._runs += 1
        return graph(model, args, root_call)

    def _capture_regional(self, backend, args, dynamic, model):
        holder = {}

        def compile_graph(gm: fx.GraphModule, example_inputs):
            ctx = _context(gm, backend, self.block_size, self.kernel_options,
                           self.interleave_heads)
            self.contexts.append(ctx)
            run_passes(ctx)
            ctx.done = True
            self.num_compilations += 1
            holder["graph"] = regional.build(ctx.gm, example_inputs, backend=backend,
                                             model=model, call_args=args, token_args=dynamic)
            log.info("compiled a regional tree graph (%s backend, %d so far)", backend,
                     self.num_compilations)

            out = next(n for n in ctx.gm.graph.nodes if n.op == "output").args[0]
            holder["sentinels"] = [torch.empty(0) for _ in out]

            def captured(*_):
                # Dynamo's own code builds the function's return value from these: which
                # graph output goes where (and the constants around them) is read from it.
                return list(holder["sentinels"])

            return captured

        fn = torch.compile(self.make_traced(1000 + len(self.contexts)),
                           backend=compile_graph, fullgraph=True)
        _mark_dynamic(args, dynamic)
        with self._errors(args, dynamic), regional.capture_state(model), \
                capture_environment(model), torch._dynamo.config.patch(optimize_ddp=False):
            returned = fn(*args)
        if "graph" not in holder:
            raise TreeCompileError("regional execution: the capture did not reach the backend")
        graph = holder["graph"]
        graph.set_return(returned, holder["sentinels"])
        return graph


@contextlib.contextmanager
def capture_environment(model: torch.nn.Module | None):
    """What every capture (and every call of a captured graph: Dynamo's guards read it) runs
    under: registered recurrent kernels swapped for their markers, treefx's compile config,
    ``model``'s flex-attention configs on eager, Hugging Face's packed-sequence inference
    finding one sequence per path."""
    with capture_patches(), backends.capture_config(), eager_attention(model), \
            one_sequence_per_path():
        yield


def _mark_dynamic(args, dynamic) -> None:
    """Sizes that vary per call: ``i`` (the last dim of ``args[i]``, the token count for the
    first) or ``(i, dim)``."""
    for i in dynamic:
        i, dim = i if isinstance(i, tuple) else (i, args[i].dim() - 1)
        torch._dynamo.maybe_mark_dynamic(args[i], dim)


def prepare_model(model: torch.nn.Module) -> None:
    """What a model needs before its first capture, done once per model (not per step): its
    recurrent kernels recognised (:func:`treefx.kernels.discover`) and Hugging Face's
    output-capturing hooks installed (:func:`_install_output_hooks`)."""
    try:
        discover(model)
    except UnsupportedLayerError as e:
        raise TreeCompileError(str(e)) from None
    _install_output_hooks(model)


def _install_output_hooks(model: torch.nn.Module) -> None:
    """Hugging Face installs its output-capturing hooks (router logits, hidden states, ...)
    lazily, on the first forward that asks for such an output, under a threading lock that
    Dynamo cannot trace. Install them before the capture, for the modules whose config asks
    for a captured output, as that forward would."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    install = getattr(capturing, "maybe_install_capturing_hooks", None)
    if registry is None or install is None:
        return
    for module in model.modules():
        flags = None
        # keyed by the module (transformers >= 5.2x) or by str(its class) (5.17)
        for key in (module, str(type(module))):
            try:
                flags = registry.get(key)
            except TypeError:
                flags = None
            if flags:
                break
        config = getattr(module, "config", None)
        if flags and config is not None and any(getattr(config, f"output_{k}", False)
                                                for k in flags):
            install(module)


def unwrap_compiled(model):
    """A model already wrapped in ``torch.compile`` (an ``OptimizedModule``): its original
    module, ``model._orig_mod`` (same parameters), which treefx captures and compiles itself.
    The wrapper's own compiled code would run the model untransformed, and its options (mode,
    backend) do not apply to the tree graph. Anything else is returned as it is."""
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        log.info("the model is wrapped in torch.compile: treefx compiles its original module "
                 "(model._orig_mod, the same parameters) itself; the wrapper's options are not "
                 "used")
        model = model._orig_mod
    return model


def tree_info(batch: TreeBatch) -> torch.Tensor:
    """The tree tensors as one graph input: positions, parent_token, subtree_end [3, N]."""
    return torch.stack([batch.position_ids[0], batch.parent_token, batch.subtree_end])


def check_batch(model: torch.nn.Module, batch: TreeBatch) -> None:
    """Clear errors for a batch the model cannot take: wrong device, tokens out of range."""
    dev = next(model.parameters(), torch.empty(0)).device
    if batch.device != dev:
        raise ValueError(f"the batch is on {batch.device} but the model is on {dev}; "
                         f"use batch.to({str(dev)!r})")
    top = batch.max_token_id if batch.max_token_id >= 0 else int(batch.input_ids.max())
    for vocab, what in ((vocab_size(model), "input vocabulary"),
                        (output_vocab_size(model), "output vocabulary (its logits)")):
        if vocab is not None and top >= vocab:
            t = int((batch.input_ids[0] == top).nonzero()[0, 0])
            raise ValueError(f"token id {top} at DFS position {t} is out of range for the "
                             f"model's {what} of {vocab}: the tree loss reads each token's "
                             "log-probability from the logits")


def _context(gm: fx.GraphModule, backend: str, block_size: int,
             kernel_options: dict | None = None,
             interleave_heads: bool | None = None) -> GraphContext:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {}
    for n in placeholders:
        for key in ("input_ids", "tree_info", "tree_weights", "labels"):
            if n.name == f"l_{key}_":
                by_name[key] = n
    if not {"input_ids", "tree_info"} <= set(by_name):
        raise TreeCompileError(f"captured graph lacks the tree inputs (placeholders: "
                               f"{[n.name for n in placeholders]})")
    ids, info = by_name["input_ids"], by_name["tree_info"]
    code_before = graph_code(gm)
    modules_before = {n.name: module_path(n) if n.meta.get("nn_module_stack") else "<treefx>"
                      for n in gm.graph.nodes}
    g = gm.graph
    fake = example(info)
    with g.inserting_after(placeholders[-1]):
        se = g.call_function(_row, (info, 2))
    with g.inserting_after(placeholders[-1]):
        pos = g.call_function(_row, (info, 0))
    with fake.fake_mode if hasattr(fake, "fake_mode") else contextlib.nullcontext():
        pos.meta["example_value"] = fake[0]
        se.meta["example_value"] = fake[2]
    marker = next((n for n in g.nodes if n.op == "call_function" and n.target is part_outputs),
                  None)  # a part of a tree (treefx.backward)
    ctx = GraphContext(
        gm, backends.lowering(backend),
        input_ids=ids, tree_info=info, positions=pos, subtree_end=se,
        seq_len=example(ids).shape[1], prelude=se, block_size=block_size,
        kernel_options=kernel_options, interleave_heads=interleave_heads,
        code_before=code_before, modules_before=modules_before,
        tree_weights=by_name.get("tree_weights"),
        part_labels=by_name.get("labels") if marker is not None else None)
    if marker is not None:
        ctx._part = PartSites(marker)
    return ctx


def _user_frame(err: BaseException) -> str:
    """``file:line`` of the innermost frame of ``err`` outside torch (the model's code)."""
    import traceback

    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "/torch/" not in f.filename]
    if not frames:
        return "no frame outside torch"
    f = frames[-1]
    return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}  {(f.line or '').strip()}"


def _row(tree_info: torch.Tensor, i: int) -> torch.Tensor:
    return tree_info[i]


def _graph_break_error(fn, args, err) -> GraphBreakError:
    reasons = []
    try:
        explained = torch._dynamo.explain(fn)(*args)
        for r in explained.break_reasons:
            where = ""
            if getattr(r, "user_stack", None):
                fr = r.user_stack[-1]
                where = f" ({fr.filename.rsplit('/', 1)[-1]}:{fr.lineno})"
            reasons.append(f"{r.reason.strip().splitlines()[0]}{where}")
    except Exception as e:  # explain itself failed: report the original error
        reasons.append(f"{type(e).__name__}: {e}")
    if not reasons:
        reasons.append(str(err).strip().splitlines()[0])
    listing = "\n".join(f"  {i + 1}. {r}" for i, r in enumerate(reasons))
    return GraphBreakError(
        f"the model cannot be captured as one graph; treefx needs the whole forward to rewrite "
        f"it. Graph breaks:\n{listing}", breaks=reasons)
