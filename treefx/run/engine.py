"""The engine: capture a function around the model with Dynamo, rewrite the graph for trees,
compile it, and check that the rewritten graph is what ran.

The capture traces one function around the model: it calls the model on the DFS row and reads
each token's log-probability at its tree predecessor. The tree tensors enter as one real graph
input, ``tree_info`` [3, N] (positions, parent_token, subtree_end), so the passes can wire them
into the nodes they rewrite. N is dynamic: trees of any size reuse one compiled graph.
A compiled model (:mod:`treefx.run.model`) and a compiled training step (:mod:`treefx.run.step`)
share this engine.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import types
import weakref
from dataclasses import replace
from types import MappingProxyType

import torch
import torch.fx as fx

from . import backends, regional
from .. import families  # noqa: F401  (registers what treefx knows of model families)
from .capture import capture_environment, no_autocast_cache, no_cache, prepare_model
from ..compiler import GraphBreakError, GraphContext, TreeCompileError, run_passes
from ..compiler.graph import example, graph_code, module_path
from ..compiler.lower.parts import PartSites, part_outputs
from ..families.hf_hooks import checkpointing_flags
from ..layout import TreeBatch, known_host_row, remember_host_row
from ..ops.attention import check_interleave_heads, check_kernel_options, intervals
from ..plan import Compiled, Plan
from ..reference import output_vocab_size, vocab_size

__all__ = ["TreeEngine", "check_batch", "fresh_function", "tree_info", "unwrap_compiled"]

log = logging.getLogger("treefx")


_FRESH = itertools.count()

# The backends on which a compiled model (treefx.compile, regional=None) runs regionally
# without FSDP2 or DDP: where each layer type compiled once saves compile time (Inductor).
REGIONAL_BY_DEFAULT = ("inductor",)
# the modes that run regionally by default through those backends: a compiled model on whole
# batches and on parts of trees (treefx.backward: faster per step, BENCHMARKS.md "Real agent
# trajectories", and a first step that does not compile the whole stack)
REGIONAL_MODES = ("tree", "part")


def fresh_function(fn, tag: int):
    """A copy of ``fn`` (with its closure) under a code object of its own, named after ``tag``
    and a number no other copy in this process has.

    Its own code object gives it its own Dynamo cache, so many compiled models never share or
    exhaust one function's recompile limit (which would fall back to the untransformed model).
    Its own name keeps Dynamo's automatic dynamic shapes, which remember sizes by file, line
    and name, from carrying over from another model's capture: a second model of other widths
    (under FSDP2, whose parameters enter the graph as plain inputs) would otherwise be traced
    with its widths symbolic.
    """
    code = fn.__code__.replace(
        co_name=f"treefx_{fn.__name__.strip('_')}_{tag}_{next(_FRESH)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


def _regional_default_applies(plan: Plan, backend: str) -> bool:
    return plan.regional is None and backend in REGIONAL_BY_DEFAULT and \
        plan.mode in REGIONAL_MODES


def regional_by_default(plan: Plan, model: torch.nn.Module, backend: str) -> bool:
    """Whether ``regional=None`` runs ``model`` layer by layer: a compiled model's whole batches
    and parts (``REGIONAL_MODES``; not a step function) through Inductor, with two decoder
    layers or more."""
    return _regional_default_applies(plan, backend) and len(regional.find_blocks(model)) >= 2


class TreeEngine:
    """What a compiled model and a compiled training step share: the Dynamo capture with a
    treefx backend per device kind, the passes, the error translation, and the check that the
    rewritten graph (not a fallback to the untransformed code) ran.

    ``fn`` is the function captured (the front end's: it takes the model and the tree tensors;
    its graph inputs must include ``input_ids`` [1, N] and ``tree_info`` [3, N], and
    ``tree_weights`` [2, N] for a step); ``plan`` the :class:`~treefx.plan.Plan` every capture
    is compiled for. Each capture's :class:`~treefx.plan.Compiled` is kept in ``compiled``.
    """

    def __init__(self, fn, plan: Plan, *, no_grad_runs_training: bool = False):
        self.fn = fn
        # a no-grad call of a model that trains runs the training graph (one capture; see
        # captures_training): a compiled model's engine, with Options.share_no_grad
        self.no_grad_runs_training = no_grad_runs_training
        if plan.regional not in (None, True, False):
            raise TypeError(f"regional must be True, False or None, got {plan.regional!r}")
        given = plan.kernel_options
        kernel_options = check_kernel_options(dict(given) if isinstance(given, MappingProxyType)
                                              else given)
        self.plan = replace(
            plan, backend=backends.check(plan.backend),
            kernel_options=MappingProxyType(kernel_options),
            interleave_heads=check_interleave_heads(plan.interleave_heads, kernel_options))
        self._regional: dict[tuple, list] = {}  # guard key -> captured regional graphs
        self._regional_off: set[int] = set()  # models whose default regional capture failed
        self._layered: dict[int, bool] = {}  # model -> two decoder layers or more
        self.compiled: list[Compiled] = []
        self._runs = 0
        # seconds spent so far, by phase: "passes" (treefx's rewrite of each capture), "compile"
        # (the backend: AOTAutograd, Inductor, Triton), "check" (the first-call check); the
        # rest of a first call is Dynamo's trace and the run itself
        self.timings: dict[str, float] = {"passes": 0.0, "compile": 0.0, "check": 0.0}
        self._timing_stack: list[float] = []
        self._callables: dict[str, object] = {}
        self._prepared: weakref.WeakSet = weakref.WeakSet()  # models made ready for capture
        # another engine whose no-grad regional graphs this one's model may run (share_from)
        self._twin: dict | None = None

    def make_traced(self, tag: int):
        """A fresh copy of the captured function (its own Dynamo cache)."""
        return fresh_function(self.fn, tag)

    @property
    def backend(self) -> str:
        return self.plan.backend

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    @property
    def kernel_options(self):
        return self.plan.kernel_options

    @property
    def interleave_heads(self) -> bool | None:
        return self.plan.interleave_heads

    @property
    def regional(self) -> bool | None:
        return self.plan.regional

    @property
    def num_compilations(self) -> int:
        """Captures whose passes all ran (a capture that stopped with an error is not one)."""
        return sum(c.context.done for c in self.compiled)

    @property
    def contexts(self) -> list[GraphContext]:
        """The rewritten graphs, one per capture (a failed one's too), oldest first."""
        return [c.context for c in self.compiled]

    def resolve_backend(self, device: torch.device) -> str:
        return backends.resolve(self.backend, device, self.plan.options)

    def _capture(self, gm: fx.GraphModule, example_inputs, backend: str) -> Compiled:
        """The passes on a captured graph: its :class:`Compiled`, kept (before the passes run,
        so that a failed graph can be reported)."""
        # the parameters among the real inputs, by position (nothing else kept alive)
        real = [x if isinstance(x, torch.nn.Parameter) else None for x in example_inputs]
        ctx = _context(gm, backend, self.plan, real)
        compiled = Compiled(ctx, backend)
        self.compiled.append(compiled)
        with self.timed("passes"):
            compiled.part = run_passes(ctx)
        ctx.done = True
        return compiled

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Add the block's wall time to ``timings[phase]``, less that of the phases timed
        inside it (the first-call check compiles the graph on its probe: "compile", not
        "check")."""
        t0 = time.perf_counter()
        self._timing_stack.append(0.0)
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            inner = self._timing_stack.pop()
            self.timings[phase] = self.timings.get(phase, 0.0) + took - inner
            if self._timing_stack:
                self._timing_stack[-1] += took

    def _dynamo_backend(self, backend: str):
        def compile_graph(gm: fx.GraphModule, example_inputs):
            compiled = self._capture(gm, example_inputs, backend)
            log.info("compiled a tree graph (%s backend, %d so far)", backend,
                     self.num_compilations)
            if self.plan.find_layout:
                # found what the part needs; never run (its buffers have other widths)
                def run(*args):
                    self._runs += 1
                    return [torch.empty(0) for _ in _graph_outputs(compiled.context.gm)]

                return run
            with self.timed("compile"):
                fn = backends.compile_graph(backend, compiled.context.gm, example_inputs,
                                            self.plan.options)
            compiled.fn = fn

            def run(*args):
                self._runs += 1
                return fn(*args)

            return run

        return compile_graph

    def warm_start(self, device: torch.device, model: torch.nn.Module | None = None) -> None:
        """What a first compiling call needs in the background, started now where the backend
        compiles on ``device`` and nothing was compiled yet: Inductor's pool of compile workers
        and, for ``model``, cuDNN's interval-attention kernels in processes of their own
        (:func:`~treefx.ops.attention.intervals.warm_up_model`). Both are started once (a
        second call finds them running or done)."""
        if self.compiled or self.resolve_backend(device) != "inductor":
            return
        backends.warm_compile_workers()
        if model is not None:
            intervals.warm_up_model(model, device, self.plan.options)

    def __call__(self, device: torch.device, *args, dynamic: tuple[int, ...] = (),
                 discover_in: torch.nn.Module | None = None, root=None):
        """Run the compiled function on ``args`` (compiling on first use per backend);
        ``dynamic``: indices of the args whose last dim is the token count N; ``discover_in``:
        the model the function calls, made ready for capture once (:func:`prepare_model`);
        ``root``: what the user holds (the model, or its DDP wrapper), whose call wraps a
        regional run (:mod:`treefx.run.regional`)."""
        backend = self.resolve_backend(device)
        if backend == "inductor" and not self.compiled:
            self.warm_start(device, discover_in)  # before Dynamo's trace (before lowering)
        if discover_in is not None and discover_in not in self._prepared:
            prepare_model(discover_in)
            self._prepared.add(discover_in)
        with no_cache(discover_in) if self.plan.mode in ("step", "part-step") else \
                contextlib.nullcontext(), no_autocast_cache():
            return self._call(backend, args, dynamic, discover_in, root)

    def _call(self, backend, args, dynamic, discover_in, root):
        if discover_in is not None and self.uses_regions(discover_in, root, backend):
            try:
                return self._call_regional(backend, args, dynamic, discover_in, root)
            except (TreeCompileError, torch._dynamo.exc.BackendCompilerFailed) as e:
                # regional execution chosen by default (regional=None, no FSDP2 or DDP), not
                # asked for, that refuses the model or whose capture fails to compile (before
                # any of it ran): the whole graph instead, said once
                refused = isinstance(e, torch._dynamo.exc.BackendCompilerFailed) or \
                    str(e).startswith("regional execution")
                if self.plan.regional is not None or not refused or regional.distributed_kind(
                        discover_in, root if root is not discover_in else None) is not None:
                    raise
                self._regional_off.add(id(discover_in))
                log.warning("treefx: running the whole graph, not layer by layer: %s",
                            str(e).splitlines()[0])
        if backend not in self._callables:
            self._callables[backend] = torch.compile(
                self.make_traced(len(self._callables)), backend=self._dynamo_backend(backend),
                fullgraph=True,
            )
        _mark_dynamic(args, dynamic)
        runs = self._runs
        with self._errors(args, dynamic):
            # entered on every call, not only the first: Dynamo's guards read the same state
            with capture_environment(discover_in, self.plan):
                out = self._callables[backend](*args)
        if self._runs == runs:
            raise TreeCompileError(
                "the tree graph did not run: Dynamo fell back to the unmodified code (recompile "
                "limit?). Its output would be silently wrong, so treefx stops here."
            )
        return out

    def uses_regions(self, model: torch.nn.Module, root=None, backend: str | None = None
                     ) -> bool:
        """Whether calls run regionally: ``regional=True``, or (``None``) a model sharded with
        FSDP2 or wrapped in DDP, or a compiled model (``treefx.compile``) through Inductor whose
        decoder layers regional execution finds (each layer type compiled once: the same
        step time, a first step that does not grow with depth). ``regional=False`` with FSDP2
        or DDP is an error."""
        kind = regional.distributed_kind(model, root if root is not model else None)
        if self.plan.regional is False and kind is not None:
            raise TreeCompileError(
                f"regional=False, but the model is wrapped for {kind.upper()}, whose hooks run "
                "around each module call: treefx runs such a model regionally (leave "
                "regional=None)")
        if self.plan.regional is not None or kind is not None:
            return bool(self.plan.regional) or kind is not None
        if not _regional_default_applies(self.plan, backend) or id(model) in self._regional_off:
            return False
        if id(model) not in self._layered:  # read once: a walk over every module
            self._layered[id(model)] = len(regional.find_blocks(model)) >= 2
        return self._layered[id(model)]

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

    def _regional_key(self, backend, model, grad: bool | None = None) -> tuple:
        """What a regional graph was captured under: backend, model, grad mode, the modules'
        training modes, CUDA autocast, and, for a graph with gradients, which modules have
        Hugging Face's activation checkpointing on (a training call with checkpointing must
        not run a graph captured without it: values alike, memory not)."""
        grad = torch.is_grad_enabled() if grad is None else grad
        return (backend, id(model), grad,
                tuple(m.training for m in model.modules()),
                torch.is_autocast_enabled("cuda") if hasattr(torch, "is_autocast_enabled")
                else None,
                checkpointing_flags(model) if grad else None)

    def captures_training(self, model: torch.nn.Module, backend: str, root=None) -> bool:
        """Whether a call without gradients of ``model`` captures (and runs) the graph its
        training calls run, rather than a no-grad graph of its own: an engine made with
        ``no_grad_runs_training`` (a compiled model's, ``TREEFX_SHARE_NO_GRAD`` on), a model
        run regionally (:meth:`uses_regions`) in training mode with trainable parameters,
        outside inference mode.

        Why: a reinforcement-learning step computes the policy's old log-probs without
        gradients, in training mode, then trains on the same rows. One capture, compiled for
        training, serves both: Dynamo's trace and the passes run once, not twice, and the
        no-grad call runs the training graph's forward, so the old and new log-probs of the
        step's first update agree bit for bit, as they do in eager mode. The graph is keyed
        by the checkpointing the model has at the capture (:func:`checkpointing_flags`):
        TRL turns checkpointing off around its no-grad calls, and
        :class:`~treefx.integrations.trl.TreeGRPOTrainer` turns it back on for the tree
        call (no value changes without gradients). The model's first-call check then runs
        with gradients, on a probe padded to the first batch's length through Inductor: a
        first no-grad batch much longer than the training batches can need more memory for the
        check than for itself (``TREEFX_SHARE_NO_GRAD=0``, or ``verify=False``)."""
        return (self.no_grad_runs_training and not torch.is_grad_enabled()
                and not torch.is_inference_mode_enabled() and model.training
                and any(p.requires_grad for p in model.parameters())
                and self.uses_regions(model, root, backend))

    def _find_regional(self, backend, model, args):
        """The captured regional graph of ``model``'s state that accepts ``args``, and its key
        (None, None where there is none). A no-grad call takes a no-grad graph, else (with
        ``no_grad_runs_training``) a training graph of the same training modes and autocast,
        whatever its checkpointing (which changes no value without gradients)."""
        key = self._regional_key(backend, model)
        keys = [key]
        if not key[2] and self.no_grad_runs_training:
            keys += [k for k in self._regional if k[2] and k[:2] == key[:2]
                     and k[3:5] == key[3:5]]
        for k in keys:
            graph = next((g for g in self._regional.get(k, []) if g.accepts(args)), None)
            if graph is not None:
                return k, graph
        return None, None

    def needs_capture(self, device: torch.device, *args, discover_in: torch.nn.Module,
                      root=None) -> bool:
        """Whether a call with ``args`` would capture a regional graph first (a capture of an
        FSDP2 model gathers every unit: a collective the other ranks must match, see
        :func:`treefx.backward`). False for a call that does not run regionally."""
        if not self.uses_regions(discover_in, root, self.resolve_backend(device)):
            return False
        if self.plan.find_layout:
            return True
        return self._find_regional(self.resolve_backend(device), discover_in, args)[1] is None

    def _call_regional(self, backend, args, dynamic, model, root):
        if self.plan.find_layout:
            # a capture that only finds a part's layout is never run (its buffers have other
            # widths): the passes on the whole graph, nothing split or compiled
            regional.check_hooks(model, root)
            return self._find_layout_regional(backend, args, dynamic, model)
        _, graph = self._find_regional(backend, model, args)
        if graph is None:
            graph = self._twin_graph(backend, args, model, root)
        if graph is None:
            training = self.captures_training(model, backend, root)
            graphs = self._regional.setdefault(
                self._regional_key(backend, model, grad=True if training else None), [])
            if len(graphs) >= 8:
                raise TreeCompileError(
                    "regional execution: 8 captures for one model state and none accepts "
                    f"this batch ({args[dynamic[0]].shape[-1]} tokens); Dynamo's shape "
                    "guards on the token count keep failing")
            if graphs:
                # another capture for this model state: say which guard the earlier ones
                # failed (a shape guard on the token count, such as Inductor's 32-bit indexing
                # bound, recompiles every layer piece)
                log.info("regional execution: capturing again for %d tokens; the earlier "
                         "capture(s) failed: %s", args[dynamic[0]].shape[-1],
                         "; ".join(g.failed_guard(args) or "?" for g in graphs))
            regional.check_hooks(model, root)
            if training:
                log.info("regional execution: a call without gradients of a model that trains "
                         "captures its training graph, which its training calls run too")
            # (the capture runs nothing: the pieces are compiled on fake inputs)
            with torch.enable_grad() if training else contextlib.nullcontext():
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

    # ------------------------------------------------------------------ twins

    def share_from(self, engine: TreeEngine, model: torch.nn.Module) -> None:
        """Let this engine's model run the no-grad regional graphs that ``engine`` captured
        on ``model``, its twin (:func:`treefx.run.model.twin` decides who is one), while
        :meth:`twin_pending` or after :meth:`twin_verified`; :meth:`end_twin` stops it."""
        self._twin = {"engine": engine, "model": weakref.ref(model), "state": "pending",
                      "key": None, "given": []}

    def _twin_graph(self, backend, args, model, root):
        """A no-grad regional graph of the twin (:meth:`share_from`) that accepts ``args``,
        or None. Once one served the first-call check, only graphs of that key (the twin's
        model state it was checked in) are taken."""
        t = self._twin
        if t is None or t["state"] == "off" or torch.is_grad_enabled() or self.plan.find_layout:
            return None
        other = t["model"]()
        if other is None:
            return None
        try:  # hooks on this model's blocks would run around the twin's pieces
            regional.check_hooks(model, root if root is not model else None)
        except TreeCompileError:
            return None
        # the graph takes the model it was captured on as a constant argument; it reads the
        # parameters of the model it is called with
        theirs = tuple(other if a is model else a for a in args)
        if t["key"] is not None:
            key = t["key"]
            graph = next((g for g in t["engine"]._regional.get(key, []) if g.accepts(theirs)),
                         None)
        else:
            key, graph = t["engine"]._find_regional(backend, other, theirs)
        if graph is not None and not t["given"]:
            log.info("treefx: running the no-grad graph of a twin model (%s)",
                     type(other).__name__)
        if graph is not None:
            t["key"] = key
            t["given"] = [graph]
        return graph

    @property
    def twin_pending(self) -> bool:
        """Whether a twin's graph may serve this engine but none was checked yet."""
        return self._twin is not None and self._twin["state"] == "pending"

    @property
    def twin_used(self) -> bool:
        """Whether a twin's graph served a call of this engine."""
        return self._twin is not None and bool(self._twin["given"])

    def twin_verified(self) -> None:
        """The first-call check passed: a twin's graph that served it keeps serving (graphs of
        the same key); where none served it, none will."""
        if self._twin is not None:
            if self._twin["given"]:
                self._twin["state"] = "verified"
            else:
                self.end_twin()

    def end_twin(self) -> None:
        """No twin's graph serves this engine from now on."""
        self._twin = None

    def _find_layout_regional(self, backend, args, dynamic, model):
        fn = torch.compile(self.make_traced(1000 + len(self.compiled)),
                           backend=self._dynamo_backend(backend), fullgraph=True)
        _mark_dynamic(args, dynamic)
        with self._errors(args, dynamic), \
                capture_environment(model, self.plan, regional_capture=True):
            return fn(*args)

    def _capture_regional(self, backend, args, dynamic, model):
        holder = {}

        def compile_graph(gm: fx.GraphModule, example_inputs):
            compiled = self._capture(gm, example_inputs, backend)
            ctx = compiled.context
            # the Triton compiles of every piece are waited for once, after the last piece
            with self.timed("compile"), backends.kernel_waits_deferred(self.plan.options):
                holder["graph"] = regional.build(ctx.gm, example_inputs, backend=backend,
                                                 model=model, call_args=args,
                                                 token_args=dynamic,
                                                 options=self.plan.options)
            log.info("compiled a regional tree graph (%s backend, %d so far)", backend,
                     self.num_compilations)

            holder["sentinels"] = [torch.empty(0) for _ in _graph_outputs(ctx.gm)]

            def captured(*_):
                # Dynamo's own code builds the function's return value from these: which
                # graph output goes where (and the constants around them) is read from it.
                return list(holder["sentinels"])

            return captured

        fn = torch.compile(self.make_traced(1000 + len(self.compiled)),
                           backend=compile_graph, fullgraph=True)
        _mark_dynamic(args, dynamic)
        with self._errors(args, dynamic), \
                capture_environment(model, self.plan, regional_capture=True):
            returned = fn(*args)
        if "graph" not in holder:
            raise TreeCompileError("regional execution: the capture did not reach the backend")
        graph = holder["graph"]
        graph.set_return(returned, holder["sentinels"])
        return graph


def _mark_dynamic(args, dynamic) -> None:
    """Sizes that vary per call: ``i`` (the last dim of ``args[i]``, the token count for the
    first) or ``(i, dim)``. The other dims of those arguments are marked static: Dynamo's
    automatic dynamic shapes would otherwise make a dim that changed since an earlier capture
    of the same function (a part graph's context width, 0 when its layout was found) a size
    the call does not declare, which regional execution cannot bind."""
    marked: dict[int, set[int]] = {}
    for i in dynamic:
        i, dim = i if isinstance(i, tuple) else (i, args[i].dim() - 1)
        torch._dynamo.maybe_mark_dynamic(args[i], dim)
        marked.setdefault(i, set()).add(dim)
    for i, dims in marked.items():
        for d in range(args[i].dim()):
            if d not in dims:
                torch._dynamo.mark_static(args[i], d)


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
    """The tree tensors as one graph input: positions, parent_token, subtree_end [3, N]. Where
    the batch's row has a host copy (:meth:`TreeBatch.to` keeps it), the stacked row gets it
    too: the ops that read the structure on the host take it, not a copy back."""
    info = torch.stack([batch.position_ids[0], batch.parent_token, batch.subtree_end])
    host = known_host_row(batch.parent_token)
    if host is not None:
        remember_host_row(info[1], host)
    return info


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


def _graph_outputs(gm: fx.GraphModule) -> list:
    return list(next(n for n in gm.graph.nodes if n.op == "output").args[0])


def _context(gm: fx.GraphModule, backend: str, plan: Plan, real_inputs) -> GraphContext:
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
        se = g.call_function(torch.ops.aten.select.int, (info, 0, 2))
    with g.inserting_after(placeholders[-1]):
        pos = g.call_function(torch.ops.aten.select.int, (info, 0, 0))
    with fake.fake_mode if hasattr(fake, "fake_mode") else contextlib.nullcontext():
        pos.meta["example_value"] = fake[0]
        se.meta["example_value"] = fake[2]
    marker = next((n for n in g.nodes if n.op == "call_function" and n.target is part_outputs),
                  None)  # a part of a tree (treefx.backward)
    if (marker is not None) != plan.is_part:
        raise TreeCompileError(f"internal: a {plan.mode} plan for a graph "
                               f"{'with' if marker is not None else 'without'} a part marker")
    ctx = GraphContext(
        gm, backends.lowering(backend),
        input_ids=ids, tree_info=info, positions=pos, subtree_end=se,
        seq_len=example(ids).shape[1], prelude=se, code_before=code_before,
        modules_before=modules_before,
        tree_weights=by_name.get("tree_weights"),
        part_labels=by_name.get("labels") if marker is not None else None,
        plan=plan, real_inputs=real_inputs,
        part_sites=PartSites(marker) if marker is not None else None)
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
