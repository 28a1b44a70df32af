"""The backends a tree graph is compiled with, and the Dynamo settings of the capture.

``"eager"`` runs the rewritten graph as it is (SDPA with the dense tree mask; any device, the
reference); ``"inductor"`` lowers tree attention to FlexAttention with the block mask and
compiles forward and backward with Inductor (CUDA); ``"auto"`` picks per batch: inductor on
CUDA, eager elsewhere. ``"flex-eager"`` and ``"aot-eager"`` are for tests on the CPU: the
inductor backend's graph (tree FlexAttention, traced recurrences) run eagerly, or traced by
AOTAutograd and run eagerly.

``"inductor"`` without CUDA, or for a batch on the CPU, is refused (a ``ValueError``, one
sentence): torch's CPU FlexAttention has no backward, and its template does not compile tree
graphs (torch 2.13). The environment variable ``TREEFX_INDUCTOR_ON_CPU=1`` lets it through, for
treefx's own tests of that path (``tests/test_compile.py``, ``tests/test_parts.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from unittest import mock

import torch
import torch.fx as fx

from ..options import Options, current

__all__ = ["BACKENDS", "capture_config", "check", "check_available", "compile_graph", "lowering",
           "resolve"]

log = logging.getLogger("treefx")

BACKENDS = ("auto", "inductor", "eager", "flex-eager", "aot-eager")
PUBLIC = BACKENDS[:3]


def check(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {PUBLIC}, got {backend!r}")
    return backend


def inductor_on_cpu(options: Options | None = None) -> bool:
    """Whether ``TREEFX_INDUCTOR_ON_CPU=1`` lets the inductor backend run on the CPU (for
    treefx's tests of that path; not a way to train)."""
    return current(options).inductor_on_cpu


def check_available(backend: str, options: Options | None = None) -> str:
    """``backend``, or a ``ValueError`` when it cannot run on this machine: ``"inductor"``
    needs CUDA (``"auto"`` picks eager without it)."""
    if backend == "inductor" and not torch.cuda.is_available() and not inductor_on_cpu(options):
        raise ValueError("backend='inductor' needs CUDA, which is not available here "
                         "(torch.cuda.is_available() is False); use backend='auto' (inductor on "
                         "CUDA, eager elsewhere) or backend='eager'")
    return backend


def resolve(backend: str, device: torch.device, options: Options | None = None) -> str:
    """The backend a batch on ``device`` runs with; ``"inductor"`` for a batch on the CPU is a
    ``ValueError``."""
    if backend != "auto":
        if backend == "inductor" and device.type == "cpu":
            if not inductor_on_cpu(options):
                check_available(backend, options)  # without CUDA: say that first
                raise ValueError("backend='inductor' runs on CUDA, but the batch is on the "
                                 "CPU; move the model and the batch to the GPU "
                                 "(batch.to('cuda')), or use backend='auto' or 'eager'")
            log.warning("inductor backend on the CPU (%s=1): FlexAttention has no CPU backward",
                        Options.env_name("inductor_on_cpu"))
        return backend
    return "inductor" if device.type == "cuda" else "eager"


def lowering(backend: str) -> str:
    """What the passes lower tree attention to for ``backend``: ``"inductor"`` (FlexAttention,
    compiled), ``"flex"`` (FlexAttention, run eagerly) or ``"eager"`` (SDPA, dense mask)."""
    return {"inductor": "inductor", "flex-eager": "flex", "aot-eager": "inductor"}.get(
        backend, "eager")


def compile_graph(backend: str, gm: fx.GraphModule, example_inputs,
                  options: Options | None = None):
    """The rewritten graph, compiled for ``backend``: a callable. Its backward is compiled
    now, with the forward (:func:`backward_compiled_now`). ``options``: the capture's
    (:class:`~treefx.options.Options`; Inductor's settings and waits)."""
    options = current(options)
    if backend not in ("inductor", "aot-eager"):
        return gm.forward
    sizes = size_inputs(example_inputs)
    patches = {}
    if sizes is None:  # a size no input's dimension is: no cached code for this graph
        log.info("treefx: a graph whose input sizes are not all given as sizes is compiled "
                 "without Inductor's caches")
        patches = {"fx_graph_cache": False}
    elif sizes:
        gm = with_size_inputs(gm, example_inputs, sizes)
        example_inputs = [*example_inputs, *(example_inputs[j].shape[d] for j, d in sizes)]
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        with backward_compiled_now(), _autograd_cache(sizes is not None), \
                kernel_waits_deferred(options), wide_indexing_near_bound(options):
            fn = compile_fx(gm, example_inputs, config_patches={
                **inductor_patches(options), **cacheable_patch(gm), **patches})
    else:
        from torch._functorch.aot_autograd import aot_module_simplified

        with backward_compiled_now():
            fn = aot_module_simplified(gm, example_inputs, fw_compiler=_as_is,
                                       bw_compiler=_as_is)
    if not sizes:
        return fn

    def call(*args):
        return fn(*args, *(args[j].shape[d] for j, d in sizes))

    return call


# ------------------------------------------------------------ sizes as inputs
#
# Inductor's and AOTAutograd's caches keep a compiled graph with the shape guards its
# compilation took (Inductor indexes a kernel in 32 bits only under a guard such as
# ``32000*s70 <= 2**31-1``), and check them against a later graph's sizes before handing it
# out. They read those sizes from the graph's integer inputs only: a graph Dynamo makes takes
# every symbolic size of its tensors as one, but a piece of a regional graph takes tensors
# alone. Its cache entry then had no guards at all, and a later graph of the same code hit
# it at any size: a longer row then ran the 32-bit output layer compiled for a shorter tree
# and stopped with an illegal memory access (benchmarks/HISTORY.md, 2026-11-27). So a graph whose tensors' sizes use a symbol that no integer
# input carries is compiled with one more input per such symbol, filled from its tensors'
# sizes on every call.


def size_inputs(example_inputs) -> list[tuple[int, int]] | None:
    """For each backed size symbol the tensor inputs' sizes, strides or offsets use and no
    integer input is, in order of first use: the (input, dimension) whose size it is; None
    where one is no input's dimension (then the sizes cannot be passed)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    given = {x.node.expr for x in example_inputs
             if isinstance(x, torch.SymInt) and x.node.expr.is_Symbol}
    dims: dict = {}
    missing: list = []
    for j, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            continue
        for d, n in enumerate(x.shape):
            if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
                dims.setdefault(n.node.expr, (j, d))
        for e in (*x.shape, *x.stride(), x.storage_offset()):
            if not isinstance(e, torch.SymInt):
                continue
            unbacked = free_unbacked_symbols(e)
            for s in sorted(e.node.expr.free_symbols, key=str):
                if s not in given and s not in unbacked and s not in missing:
                    missing.append(s)
    if any(s not in dims for s in missing):
        return None
    return [dims[s] for s in missing]


def with_size_inputs(gm: fx.GraphModule, example_inputs, sizes) -> fx.GraphModule:
    """A copy of ``gm`` taking ``sizes`` (:func:`size_inputs`) as further integer inputs after
    its own (read by nothing: there for the caches' guards)."""
    g = fx.Graph()
    value = g.graph_copy(gm.graph, {})
    first = next((n for n in g.nodes if n.op != "placeholder"), None)
    for k, (j, d) in enumerate(sizes):
        with g.inserting_before(first):  # None: at the end, where the output follows
            ph = g.placeholder(f"treefx_size_{k}")
        ph.meta["example_value"] = ph.meta["val"] = example_inputs[j].shape[d]
    g.output(value)
    return fx.GraphModule(gm, g)


@contextlib.contextmanager
def backward_compiled_now():
    """AOTAutograd compiles the backward with the forward, not at its first backward call.

    Why: compiling adds shape guards. Inductor's Triton code indexes in 32 bits only under a
    guard such as ``151936*s0 <= 2**31-1``, taken where the capture's sizes fit. AOTAutograd
    compiles a backward lazily when the forward saves no sizes for it (often so for a piece of
    a regional graph), and then its guards arrive after the capture's guards were read, and its
    compiled form can reach Inductor's caches under the forward's guards alone: a later call
    past 2**31 elements would pass the guards and run the 32-bit backward. Compiled now, every
    guard is known when the capture is checked against the next call. Where this torch lacks
    the switch, regional graphs still read guards that arrive later
    (:meth:`treefx.run.regional.RegionalGraph.accepts`)."""
    from torch._functorch import config as functorch_config

    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        yield
        return
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        yield


@contextlib.contextmanager
def _autograd_cache(on: bool):
    """AOTAutograd's cache as set, or off (``on`` False) for one compilation."""
    from torch._functorch import config as functorch_config

    if on or not hasattr(functorch_config, "enable_autograd_cache"):
        yield
        return
    with functorch_config.patch(enable_autograd_cache=False):
        yield


def _as_is(gm, example_inputs):
    return gm


def inductor_patches(options: Options | None = None) -> dict:
    """Inductor settings for tree graphs:

    - mix-order reductions off (:func:`mix_order_reduction`), and their heuristic's size
      checks off where they are switched on: those checks guard the token count (a minimum
      size that depends on the hidden size), so every tree below the threshold compiled a
      second graph;
    - ``emulate_precision_casts``: a low-precision intermediate rounds where eager rounds it.
      Inductor otherwise computes a fused ``bf16 * int`` in float32 and rounds once: Falcon's
      ALiBi (``slopes.bfloat16() * positions``, in a float32 model) then differs from the
      per-sequence model at positions past 256 (on the GPU; BENCHMARKS.md, "Model families"),
      which the first-call check refused;
    - pointwise kernels not autotuned (:func:`autotune_pointwise`)."""
    from torch._inductor import config

    options = current(options)
    patches = {}
    if hasattr(config.triton, "autotune_pointwise"):
        patches["triton.autotune_pointwise"] = autotune_pointwise(options)
    if hasattr(config.triton, "mix_order_reduction"):
        patches["triton.mix_order_reduction"] = mix_order_reduction(options)
    if hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        patches["triton.mix_order_reduction_non_strict_mode"] = True
    if hasattr(config, "emulate_precision_casts"):
        patches["emulate_precision_casts"] = True
    return patches


# ------------------------------------------------------------ 64-bit indexing near 2**31
#
# Inductor indexes a kernel in 32 bits where its sizes at the capture fit, and then guards
# them (``151936*s0 <= 2**31-1``: "only install guards for 32-bit indexing as there is no
# correctness issue with using 64-bit for everything"). A later call past the bound fails
# the guard, and a regional graph is captured again, every piece with it (Dynamo's trace,
# the passes, the compile). A tree's token count is anything: TRL's GRPO micro-batches of
# Qwen3-1.7B at 13,550-15,235 tokens straddle the output layer's bound of 14,135 tokens
# (151,936 × 14,135 > 2**31). So a size that varies per call (a symbolic one) whose value at
# the capture is within a factor INDEX_MARGIN of 2**31 takes 64-bit indexing at once, with no
# guard; static sizes, and sizes well below the bound, keep Inductor's choice.

#: A kernel whose symbolic sizes reach 1 / INDEX_MARGIN of 2**31 at the capture is indexed in
#: 64 bits (no guard): a later call with up to INDEX_MARGIN times the tokens reuses it.
INDEX_MARGIN = 2


def near_int32_bound(exprs, hint, margin: int = INDEX_MARGIN) -> bool:
    """Whether one of ``exprs`` (sympy expressions or ints) has a free symbol and a value
    (``hint(expr)``, the capture's) below 2**31 but above 2**31 / ``margin``."""
    import sympy

    int_max = torch.iinfo(torch.int32).max
    for e in exprs:
        e = sympy.sympify(e)
        if not e.free_symbols:
            continue
        try:
            value = int(hint(e))
        except Exception:  # no hint (an unbacked size): Inductor's own choice
            continue
        if value <= int_max < value * margin:
            return True
    return False


def _size_hint():
    from torch._inductor.virtualized import V

    sizevars = V.graph.sizevars
    for name in ("optimization_hint", "size_hint"):  # torch 2.13 / earlier
        fn = getattr(sizevars, name, None)
        if fn is not None:
            return fn
    raise AttributeError("no size hint")


@contextlib.contextmanager
def wide_indexing_near_bound(options: Options | None = None):
    """Inductor's choice of 32-bit indexing refused for kernels whose symbolic sizes are near
    2**31 (:func:`near_int32_bound`), for the compilations inside the block. Where this
    torch's Inductor has no ``SIMDScheduling.can_use_32bit_indexing`` to wrap, or with
    ``TREEFX_WIDE_INDEXING=0``, nothing changes (a later call past the bound captures
    again)."""
    if not current(options).wide_indexing:
        yield
        return
    try:
        from torch._inductor.codegen.simd import SIMDScheduling
    except ImportError:  # pragma: no cover - a torch without it
        yield
        return
    original = SIMDScheduling.__dict__.get("can_use_32bit_indexing")
    if not isinstance(original, staticmethod):
        yield
        return
    inner = original.__func__

    def can_use_32bit_indexing(numel, buffers):
        buffers = list(buffers)
        sizes = [numel]
        for buf in buffers:
            try:
                if not hasattr(buf, "has_tensor_output") or buf.has_tensor_output():
                    sizes.append(buf.get_layout().storage_size())
            except Exception:  # a buffer without a layout: Inductor's own check sees it
                continue
        try:
            near = near_int32_bound(sizes, _size_hint())
        except Exception:
            near = False
        return False if near else inner(numel, buffers)

    SIMDScheduling.can_use_32bit_indexing = staticmethod(can_use_32bit_indexing)
    try:
        yield
    finally:
        SIMDScheduling.can_use_32bit_indexing = original


def mix_order_reduction(options: Options | None = None) -> bool:
    """Whether Inductor may fuse a norm's two backward reductions (over the features for the
    input's gradient, over the tokens for the weight's) into one mix-order kernel: not by
    default, ``TREEFX_MIX_ORDER_REDUCTION=1`` for Inductor's own default.

    That kernel sums the weight's gradient over blocks of token rows without masking the rows
    past the last token (pytorch/pytorch#195845; torch 2.11 and 2.13 generate it so). Where the
    fused arithmetic turns a masked row's zero into something else, the sum takes it in:
    Gemma 4's RMSNorm recomputes ``pow(mean_squared, -0.5)`` in the backward, so a masked row
    gave ``0 · inf`` and every norm weight's gradient came out NaN on the GPU (the eager
    backend and the CPU exact; ``benchmarks/nan_check.sh z52a``). A tree's token count is
    anything, so whether rows are masked changes from batch to batch, and the first-call check
    sees only its own. Switch it on only with a torch whose Inductor masks those rows."""
    return current(options).mix_order_reduction


def autotune_pointwise(options: Options | None = None) -> bool:
    """Whether Inductor autotunes the pointwise kernels of tree graphs: not by default,
    ``TREEFX_AUTOTUNE_POINTWISE=1`` for Inductor's own default.

    Autotuned, a pointwise kernel is compiled in two or more configurations and each is
    timed on its first run: a large share of the first step, for the same step time within
    run-to-run noise with one configuration each (BENCHMARKS.md, "First step and compile
    time")."""
    return current(options).autotune_pointwise


def warm_compile_workers() -> None:
    """Start Inductor's pool of compile workers now (as ``torch.compile``'s own backend does
    when Dynamo hands it a graph, and where ``TORCH_WARM_POOL`` allows it), so that the
    workers start while Dynamo traces the model rather than when the first kernel is
    compiled."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # pragma: no cover - a torch without it
        return
    maybe_warm_pool()


# ------------------------------------------------------------ Triton compiles, waited for once
#
# Inductor hands each Triton kernel of a graph to its pool of compile workers while it
# generates the graph's code, and waits for all of them when it loads that code
# (``async_compile.wait(globals())`` at the end of the generated module), before it turns to
# the next graph. A graph's backward, and the next piece of a regional graph, therefore
# started only once the previous graph's slowest kernel (FlexAttention's backward template,
# say) was compiled, and the main process sat idle meanwhile (BENCHMARKS.md, "First step and
# compile time"). Deferred, the workers compile one
# graph's kernels while the main process traces, partitions and lowers the next graphs, and
# the waits happen once, when every graph of the capture has been generated. Nothing runs a
# compiled graph in between: a regional piece's first call is made on fake inputs, which
# AOTAutograd answers from the traced graph's metadata (``fakify_first_call``), without its
# kernels; and code that does run a kernel meanwhile (Inductor's compile-time autotuning,
# where it is on) finds a stand-in that waits for that kernel. What changes: the kernels miss
# the Triton bundle Inductor files with each graph in its cache (they are compiled after the
# graph's entry is written), so a restart finds them in Triton's own cache instead.


_deferred_waits: list | None = None


def defer_kernel_waits(options: Options | None = None) -> bool:
    """Whether Inductor's waits for its Triton compiles are deferred to the end of a capture's
    compilation (:func:`kernel_waits_deferred`): by default; ``TREEFX_DEFER_KERNEL_WAITS=0``
    waits graph by graph, as Inductor does."""
    return current(options).defer_kernel_waits


def _future_types() -> tuple:
    """What Inductor's wait waits for in a generated module's globals."""
    from concurrent.futures import Future

    try:
        from torch._inductor.codecache import CodeCacheFuture
    except ImportError:  # pragma: no cover - a torch without it
        return (Future,)
    return (Future, CodeCacheFuture)


class _PendingKernel:
    """A kernel still compiling in Inductor's workers, standing in its generated module's
    globals while the module's wait is deferred: code that uses the kernel before the deferred
    wait (Inductor's own compile-time autotuning block, say) waits for this kernel alone, and
    the kernel takes its place in the module."""

    __slots__ = ("future", "scope", "key")

    def __init__(self, future, scope: dict, key: str):
        self.future, self.scope, self.key = future, scope, key

    def resolve(self):
        kernel = self.future.result()
        if self.scope.get(self.key) is self:
            self.scope[self.key] = kernel
        return kernel

    def __getattr__(self, name):
        return getattr(self.resolve(), name)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)


@contextlib.contextmanager
def kernel_waits_deferred(options: Options | None = None):
    """Inside, a generated module's wait for its compiled kernels is recorded, not made: each
    kernel still compiling stands in the module as a :class:`_PendingKernel` (its first use
    waits for it). On leaving the outermost such block without an error, every recorded wait
    is made, in order, by Inductor's own wait. Nested blocks join the outermost one."""
    global _deferred_waits
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:  # pragma: no cover - a torch without Inductor
        yield
        return
    if _deferred_waits is not None or not defer_kernel_waits(options):
        yield
        return
    pending: list = []
    real_wait = AsyncCompile.wait
    futures = _future_types()

    def wait(self, scope):
        keys = [k for k, v in scope.items() if isinstance(v, futures)]
        for k in keys:
            scope[k] = _PendingKernel(scope[k], scope, k)
        pending.append((self, scope, keys))

    _deferred_waits = pending
    ok = False
    try:
        with mock.patch.object(AsyncCompile, "wait", wait):
            yield
        ok = True
    finally:
        _deferred_waits = None
        if ok:
            t0 = time.perf_counter()
            for compiler, scope, keys in pending:
                for k in keys:  # Inductor's wait takes the futures (those not used yet)
                    if isinstance(scope.get(k), _PendingKernel):
                        scope[k] = scope[k].future
                real_wait(compiler, scope)
            if pending:
                log.info("treefx: waited %.1f s for the Triton compiles of %d graph(s)",
                         time.perf_counter() - t0, len(pending))


# ------------------------------------------------------------ AOTAutograd's on-disk cache
#
# AOTAutograd keeps a compiled graph on disk (a restarted job skips tracing, partitioning and
# Inductor), keyed by the graph's code, which names what each node calls. It refuses a graph
# that calls a Python callable it does not know to be pure (a treefx function, a site object),
# as it cannot tell what its behaviour depends on. treefx's in-graph functions depend on
# treefx's source alone; a site object (an attention site with its scale, block size, kernel
# options, ...) on its attributes as well. So: a function is marked cacheable under a key of
# treefx's source and the versions of the packages its graphs call into; a site object whose
# attributes are plain data (numbers, strings, dtypes, and containers of them) is given a name
# made from a hash of its class and attributes, bound under that name in its module (the
# cache's pickler names it by import path) and marked the same way. A site holding anything
# else (a model's mask or score function, a recurrence's kernel) is left alone: that graph is
# not cached, as before.


def _plain(x) -> bool:
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype)):
        return True
    if isinstance(x, (tuple, list, set, frozenset)):
        return all(_plain(v) for v in x)
    if isinstance(x, dict):
        return all(_plain(k) and _plain(v) for k, v in x.items())
    return False


def _state_repr(x) -> str:
    if isinstance(x, dict):
        return "{" + ",".join(f"{_state_repr(k)}:{_state_repr(v)}" for k, v in
                              sorted(x.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(x, (set, frozenset)):
        return "set(" + ",".join(sorted(_state_repr(v) for v in x)) + ")"
    if isinstance(x, (tuple, list)):
        return type(x).__name__ + "(" + ",".join(_state_repr(v) for v in x) + ")"
    return repr(x)


def _state_digest(target) -> str | None:
    """A hash of a site object's class and attributes, None where an attribute is not plain
    data."""
    import hashlib

    state = {k: v for k, v in vars(target).items() if k not in ("__name__", "__reduce__")}
    if not all(_plain(v) for v in state.values()):
        return None
    text = f"{type(target).__module__}.{type(target).__qualname__}|{_state_repr(state)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cacheable_patch(gm: fx.GraphModule) -> dict:
    """Inductor's ``unsafe_marked_cacheable_functions`` for the treefx callables ``gm`` calls,
    keyed by :func:`source_key` (nothing if any of them cannot be named, or where this torch
    lacks the setting): see the comment above. A site object is bound in its module as
    ``<name>_site_<hash of its state>_<k>`` (the k-th of that state in ``gm``), the name its
    ``__reduce__`` gives the cache's pickler; its ``__name__`` is left as it is."""
    import sys

    from torch._inductor import config

    if not isinstance(getattr(config, "unsafe_marked_cacheable_functions", None), dict):
        return {}
    names, seen = set(), {}
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        for n in mod.graph.nodes:
            t = n.target
            if n.op != "call_function" or isinstance(t, (
                    torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                    torch._ops.HigherOrderOperator)):
                continue
            module = getattr(t, "__module__", None) or ""
            if not (module == "treefx" or module.startswith("treefx.")):
                continue
            owner, name = sys.modules.get(module), getattr(t, "__name__", None)
            if owner is None or not isinstance(name, str):
                return {}
            if getattr(t, "__code__", None) is not None:  # a plain function of treefx
                if getattr(owner, name, None) is not t:
                    return {}
            elif not isinstance(t, type) and hasattr(t, "__dict__"):  # a site object
                if id(t) not in seen:
                    digest = _state_digest(t)
                    if digest is None:
                        return {}
                    k = sum(1 for d in seen.values() if d[0] == digest)
                    bound = f"{name}_site_{digest}_{k}"
                    seen[id(t)] = (digest, bound)
                    setattr(owner, bound, t)
                    t.__reduce__ = (lambda b=bound: b)
            else:
                return {}
            names.add(f"{module}.{name}")
    if not names:
        return {}
    key = source_key()
    return {"unsafe_marked_cacheable_functions": {
        **config.unsafe_marked_cacheable_functions, **{n: key for n in sorted(names)}}}


_SOURCE_KEY: list[str] = []


def source_key() -> str:
    """A hash of treefx's source files and of the versions of torch, fla and transformers:
    what a cached trace of treefx's callables depends on besides their own state."""
    if not _SOURCE_KEY:
        import hashlib
        import importlib.metadata as md
        import pathlib

        h = hashlib.sha256()
        root = pathlib.Path(__file__).resolve().parents[1]
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        h.update(torch.__version__.encode())
        for dist in ("flash-linear-attention", "fla-core", "transformers"):
            try:
                h.update(f"{dist}={md.version(dist)}".encode())
            except md.PackageNotFoundError:
                pass
        _SOURCE_KEY.append(h.hexdigest()[:32])
    return _SOURCE_KEY[0]


def capture_config():
    """Dynamo settings for capturing a model for trees. Floats stay constants: a module's
    attention scale must not become a traced symbol after models with different scales ran
    (the passes read it). Logging calls are skipped (:func:`_logger_methods`)."""
    return torch._dynamo.config.patch(specialize_float=True,
                                      ignore_logger_methods=_logger_methods())


class _LoggerMethod(str):
    """A logging method as an entry of Dynamo's ignore set: equal to (and hashed as) the
    function itself, so Dynamo's membership test finds it, and a string otherwise, because
    torch 2.11 sorts the set and writes it as JSON when it logs its configuration."""

    def __new__(cls, fn):
        self = super().__new__(cls, f"logging.Logger.{fn.__name__}")
        self.fn = fn
        return self

    def __hash__(self):
        return hash(self.fn)

    def __eq__(self, other):
        return other is self.fn or (isinstance(other, _LoggerMethod) and other.fn is self.fn)

    def __ne__(self, other):
        return not self == other

    def __reduce__(self):  # copies and pickles of the config rebuild it from the function
        return _LoggerMethod, (self.fn,)

    def __deepcopy__(self, memo):
        return self


def _logger_methods() -> set:
    """Logging calls inside a model's forward (Hugging Face warns there, e.g. that
    ``use_cache`` is off under gradient checkpointing, through ``warning_once``) have no
    effect on its values; Dynamo would break the graph at them, so the capture skips them."""
    names = ("debug", "info", "warning", "warn", "warning_once", "warning_advice", "info_once")
    return {_LoggerMethod(getattr(logging.Logger, n)) for n in names
            if callable(getattr(logging.Logger, n, None))}
