"""``treefx.compile(model)``: capture a decoder with Dynamo, rewrite it for trees, compile it.

The capture traces one function around the model: it calls the model on the DFS row and reads
each token's log-probability at its tree predecessor. The tree tensors enter as one real graph
input, ``tree_info`` [3, N] (positions, parent_token, subtree_end), so the passes can wire them
into the nodes they rewrite. N is dynamic: trees of any size reuse one compiled graph.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import types
from dataclasses import dataclass

import torch
import torch.fx as fx

from .layout import TreeBatch
from .ops.attention import check_interleave_heads, check_kernel_options
from .passes import GraphBreakError, GraphContext, TreeCompileError, run_passes
from .passes.common import example, graph_code, module_path
from .passes.loss import tree_token_logprobs
from .recurrence import capture_patches
from .reference import logits_of

__all__ = ["compile", "TreeModel", "TreeOutput", "tree_loss"]

log = logging.getLogger("treefx")

# "flex-eager" and "aot-eager" are for tests on the CPU: the inductor backend's graph (tree
# FlexAttention, traced recurrences) run eagerly, or traced by AOTAutograd and run eagerly.
_BACKENDS = ("auto", "inductor", "eager", "flex-eager", "aot-eager")


@dataclass
class TreeOutput:
    """``logits`` [1, N, V] in DFS order; ``token_logprobs`` [N] (float32, float64 for a
    float64 model), entry t is log p(token t | its own sequence's prefix), 0 where t has no
    predecessor."""

    logits: torch.Tensor
    token_logprobs: torch.Tensor


def tree_loss(out: TreeOutput, batch: TreeBatch) -> torch.Tensor:
    """Σ_t loss_weights[t] · (−token_logprobs[t]): the per-sequence loss of the batch's
    reduction, averaged with the sequence weights."""
    w = batch.loss_weights.to(device=out.token_logprobs.device, dtype=out.token_logprobs.dtype)
    return -(w * out.token_logprobs).sum()


def _tree_forward_template(input_ids, tree_info):
    # Copied per TreeModel by _make_traced, with `model` and `opts` in its globals.
    torch._check(tree_info.shape[1] == input_ids.shape[1])
    kwargs = {}
    if opts["position_ids"]:  # noqa: F821
        kwargs["position_ids"] = tree_info[0:1]
    if opts["attention_mask"]:  # noqa: F821
        # An explicit all-ones mask: Hugging Face then builds its causal (+ window) mask from
        # index grids, which the positions pass turns into path positions, instead of
        # inferring packed documents from the jumping position_ids.
        kwargs["attention_mask"] = torch.ones_like(input_ids)
    if opts["use_cache"]:  # noqa: F821
        kwargs["use_cache"] = False
    logits = logits_of(model(input_ids, **kwargs))  # noqa: F821
    return logits, tree_token_logprobs(logits, input_ids, tree_info[1])


def _make_traced(template, tag: int, **cells):
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
                 interleave_heads: bool | None = None):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS[:3]}, got {backend!r}")
        self.make_traced = make_traced
        self.backend = backend
        self.block_size = block_size
        self.kernel_options = check_kernel_options(kernel_options)
        self.interleave_heads = check_interleave_heads(interleave_heads, self.kernel_options)
        self.num_compilations = 0
        self.contexts: list[GraphContext] = []
        self._runs = 0
        self._compiled: dict[str, object] = {}

    def resolve_backend(self, device: torch.device) -> str:
        if self.backend != "auto":
            if self.backend == "inductor" and device.type == "cpu":
                log.warning("inductor backend on the CPU: FlexAttention has no CPU backward")
            return self.backend
        return "inductor" if device.type == "cuda" else "eager"

    def _dynamo_backend(self, backend: str):
        def compile_graph(gm: fx.GraphModule, example_inputs):
            ctx = _context(gm, backend, self.block_size, self.kernel_options,
                           self.interleave_heads)
            self.contexts.append(ctx)  # before the passes: a failed graph can be reported
            run_passes(ctx)
            ctx.done = True
            self.num_compilations += 1
            log.info("compiled a tree graph (%s backend, %d so far)", backend,
                     self.num_compilations)
            if backend == "inductor":
                from torch._inductor.compile_fx import compile_fx

                compiled = compile_fx(ctx.gm, example_inputs, config_patches=inductor_patches())
            elif backend == "aot-eager":
                from torch._functorch.aot_autograd import aot_module_simplified

                compiled = aot_module_simplified(ctx.gm, example_inputs,
                                                 fw_compiler=_as_is, bw_compiler=_as_is)
            else:
                compiled = ctx.gm.forward

            def run(*args):
                self._runs += 1
                return compiled(*args)

            return run

        return compile_graph

    def __call__(self, device: torch.device, *args, dynamic: tuple[int, ...] = ()):
        """Run the compiled function on ``args`` (compiling on first use per backend);
        ``dynamic``: indices of the args whose last dim is the token count N."""
        backend = self.resolve_backend(device)
        if backend not in self._compiled:
            self._compiled[backend] = torch.compile(
                self.make_traced(len(self._compiled)), backend=self._dynamo_backend(backend),
                fullgraph=True,
            )
        for i in dynamic:
            torch._dynamo.maybe_mark_dynamic(args[i], args[i].dim() - 1)  # N varies per tree
        runs = self._runs
        try:
            # Registered recurrent kernels appear as single marker nodes (treefx.recurrence);
            # the swap is in place on every call so that Dynamo's guards always see it.
            # Floats stay constants: a module's attention scale must not become a traced
            # symbol after models with different scales ran (the passes read it).
            with capture_patches(), torch._dynamo.config.patch(
                    specialize_float=True, ignore_logger_methods=_logger_methods()):
                out = self._compiled[backend](*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None) or e.__cause__
            if isinstance(inner, TreeCompileError):
                raise inner from None
            raise
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            raise _graph_break_error(self.make_traced(-1), args, e) from None
        if self._runs == runs:
            raise TreeCompileError(
                "the tree graph did not run: Dynamo fell back to the unmodified code (recompile "
                "limit?). Its output would be silently wrong, so treefx stops here."
            )
        return out


class TreeModel(torch.nn.Module):
    """A model compiled for trees: ``out = tm(batch)`` for a :class:`TreeBatch`.

    Holds the user's model as ``.model`` (same parameters: an optimizer built on the model keeps
    working, and the model itself keeps working on ordinary batches).
    """

    def __init__(self, model: torch.nn.Module, backend: str = "auto", *, block_size: int = 128,
                 pass_position_ids: bool | None = None, kernel_options: dict | None = None,
                 interleave_heads: bool | None = None, verify: bool | None = None):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"treefx.compile expects a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        params = inspect.signature(model.forward).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())

        def accepts(name):
            return name in params or takes_kwargs and name in ("use_cache",)

        def requires(name):
            p = params.get(name)
            return p is not None and p.default is p.empty and p.kind in (
                p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)

        opts = {
            # By default the model computes its own positions with its own code, which the
            # passes evaluate per path: giving it 0-based positions would be wrong for a model
            # whose positions start elsewhere (RoBERTa's start after the padding index).
            "position_ids": requires("position_ids") if pass_position_ids is None
            else bool(pass_position_ids),
            "attention_mask": accepts("attention_mask"),
            "use_cache": accepts("use_cache"),
        }
        if opts["position_ids"] and not accepts("position_ids") and not takes_kwargs:
            raise ValueError("pass_position_ids=True but the model's forward has no position_ids")
        self.opts = opts
        self.engine = TreeEngine(
            lambda tag: _make_traced(_tree_forward_template, tag, model=model, opts=opts),
            backend, block_size, kernel_options, interleave_heads,
        )
        self._verify_pending = verify_default() if verify is None else verify
        if not isinstance(self._verify_pending, bool):
            raise TypeError(f"verify must be True, False or None, got {verify!r}")
        self.verification = None  # the first call's VerificationReport (or why it was skipped)

    @property
    def backend(self) -> str:
        return self.engine.backend

    @property
    def num_compilations(self) -> int:
        return self.engine.num_compilations

    @property
    def contexts(self) -> list[GraphContext]:
        return self.engine.contexts

    def forward(self, batch: TreeBatch) -> TreeOutput:
        if not isinstance(batch, TreeBatch):
            raise TypeError(f"expected a treefx.TreeBatch (see treefx.pack), got "
                            f"{type(batch).__name__}")
        check_batch(self.model, batch)
        if self._verify_pending:
            self._verify_pending = False
            self._verify_first_call()
        logits, token_logprobs = self.engine(batch.device, batch.input_ids, tree_info(batch),
                                             dynamic=(0, 1))
        return TreeOutput(logits, token_logprobs)

    def _verify_first_call(self) -> None:
        """The probe check (:mod:`treefx.verification`) through this model's own compiled graph,
        with gradients when the call computes them, before the user's first batch."""
        from .verification import VerificationUnavailable, verify

        try:
            self.verification = verify(self, grads=torch.is_grad_enabled())
        except VerificationUnavailable as e:
            self.verification = str(e)
            log.warning("treefx: %s", e)


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


def verify_default() -> bool:
    """Whether compiled models verify themselves on their first call when ``verify`` is
    not given: yes, unless the environment variable ``TREEFX_VERIFY`` is ``0``."""
    value = os.environ.get("TREEFX_VERIFY", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"TREEFX_VERIFY must be 0 or 1, got {value!r}")
    return value in ("1", "true", "yes", "on")


def inductor_patches() -> dict:
    """Inductor settings for tree graphs: the mix-order reduction heuristic's size checks off
    (where this torch has the switch). Those checks guard the token count (``5120 <= N`` at
    hidden 1024 on an H200, ``benchmarks/results/e2e_step_h200.log``), so every tree below
    the threshold compiled a second graph."""
    from torch._inductor import config

    if hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    return {}


def tree_info(batch: TreeBatch) -> torch.Tensor:
    """The tree tensors as one graph input: positions, parent_token, subtree_end [3, N]."""
    return torch.stack([batch.position_ids[0], batch.parent_token, batch.subtree_end])


def check_batch(model: torch.nn.Module, batch: TreeBatch) -> None:
    """Clear errors for a batch the model cannot take: wrong device, tokens out of range."""
    dev = next(model.parameters(), torch.empty(0)).device
    if batch.device != dev:
        raise ValueError(f"the batch is on {batch.device} but the model is on {dev}; "
                         f"use batch.to({str(dev)!r})")
    vocab = _vocab_size(model)
    if vocab is not None:
        top = batch.max_token_id if batch.max_token_id >= 0 else int(batch.input_ids.max())
        if top >= vocab:
            t = int((batch.input_ids[0] == top).nonzero()[0, 0])
            raise ValueError(f"token id {top} at DFS position {t} is out of range for the "
                             f"model's vocabulary of {vocab}")


def _vocab_size(model: torch.nn.Module) -> int | None:
    """The token embedding's size: Hugging Face's get_input_embeddings, else the first
    nn.Embedding of the model (None if it has none)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is None:
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return getattr(emb, "num_embeddings", None)


def compile(model: torch.nn.Module, *, backend: str = "auto", block_size: int = 128,
            pass_position_ids: bool | None = None,
            kernel_options: dict | None = None, interleave_heads: bool | None = None,
            verify: bool | None = None) -> TreeModel:
    """Compile ``model`` to run exactly on DFS-packed trees.

    ``backend``: ``"inductor"`` (CUDA: FlexAttention with the tree block mask and Inductor's
    fused kernels, forward and backward), ``"eager"`` (any device: SDPA with the dense tree
    mask; the reference), or ``"auto"`` (inductor on CUDA, eager otherwise, chosen per batch).
    ``pass_position_ids``: give the model the tree positions (0-based offsets in each sequence)
    as ``position_ids``. Default: only when its forward requires them; otherwise the model
    computes its own positions with its own code and the passes evaluate that code per path
    (an ``arange`` over the tokens becomes the tree positions, a ``cumsum`` along them a sum
    along each path), which is exact whatever the model's convention.
    ``kernel_options``: FlexAttention kernel options for every tree attention site (tile sizes,
    ``num_warps``, ``USE_TMA``, ...; BENCHMARKS.md has measured ones), added to treefx's own.
    ``interleave_heads``: lay the KV heads out along the row, block by block, at every tree
    attention site: same values, a better schedule for FlexAttention's backward (otherwise the
    long shared-prefix key columns of the last heads run last). ``None`` (default): in graphs
    that compute gradients, not in no-grad forwards (the forward alone does not gain);
    ``True``/``False``: always/never. BENCHMARKS.md has the measurements.
    ``verify``: on the first call, run the compiled graph and the unmodified model on each
    sequence of a small probe forest and compare log-probabilities (and gradients when the
    call computes them); a difference raises :class:`treefx.TreeVerificationError` naming the
    worst token and parameter (see :func:`treefx.verify`). The model's ``.grad``, buffers and
    random state are left as they were; skipped with a warning when the graph draws random
    numbers (dropout in training mode). ``None`` (default): on, unless the environment sets
    ``TREEFX_VERIFY=0``.
    """
    return TreeModel(model, backend, block_size=block_size, pass_position_ids=pass_position_ids,
                     kernel_options=kernel_options, interleave_heads=interleave_heads,
                     verify=verify)


def _context(gm: fx.GraphModule, backend: str, block_size: int,
             kernel_options: dict | None = None,
             interleave_heads: bool | None = None) -> GraphContext:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {}
    for n in placeholders:
        for key in ("input_ids", "tree_info", "tree_weights"):
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
    return GraphContext(
        gm, {"inductor": "inductor", "flex-eager": "flex", "aot-eager": "inductor"}.get(
            backend, "eager"),
        input_ids=ids, tree_info=info, positions=pos, subtree_end=se,
        seq_len=example(ids).shape[1], prelude=se, block_size=block_size,
        kernel_options=kernel_options, interleave_heads=interleave_heads,
        code_before=code_before, modules_before=modules_before,
        tree_weights=by_name.get("tree_weights"))


def _as_is(gm, example_inputs):
    return gm


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
        f"it. Graph breaks:\n{listing}"
    )
