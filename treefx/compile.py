"""``treefx.compile(model)``: capture a decoder with Dynamo, rewrite it for trees, compile it.

The capture traces one function around the model: it calls the model on the DFS row and reads
each token's log-probability at its tree predecessor. The tree tensors enter as one real graph
input, ``tree_info`` [3, N] (positions, parent_token, subtree_end), so the passes can wire them
into the nodes they rewrite. N is dynamic: trees of any size reuse one compiled graph.
"""

from __future__ import annotations

import inspect
import logging
import types
from dataclasses import dataclass

import torch
import torch.fx as fx

from .layout import TreeBatch
from .passes import GraphBreakError, GraphContext, TreeCompileError, run_passes
from .passes.common import example
from .reference import logits_of

__all__ = ["compile", "TreeModel", "TreeOutput", "tree_loss"]

log = logging.getLogger("treefx")

_BACKENDS = ("auto", "inductor", "eager", "flex-eager")


@dataclass
class TreeOutput:
    """``logits`` [1, N, V] in DFS order; ``token_logprobs`` [N] float32, entry t is
    log p(token t | its own sequence's prefix), 0 where t has no predecessor."""

    logits: torch.Tensor
    token_logprobs: torch.Tensor


def tree_loss(out: TreeOutput, batch: TreeBatch) -> torch.Tensor:
    """Σ_t loss_weights[t] · (−token_logprobs[t]): the per-sequence loss of the batch's
    reduction, averaged with the sequence weights."""
    w = batch.loss_weights.to(device=out.token_logprobs.device, dtype=out.token_logprobs.dtype)
    return -(w * out.token_logprobs).sum()


def _tree_forward_template(input_ids, tree_info):
    # Filled per TreeModel (see _make_tree_forward); `model` and `opts` are closure cells.
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
    parent = tree_info[1]
    row = parent.clamp(min=0)
    lg = logits[0]
    acc = torch.promote_types(lg.dtype, torch.float32)  # float32, or float64 for float64 models
    lse = torch.logsumexp(lg.to(acc), dim=-1)
    picked = lg[row, input_ids[0]].to(acc) - lse[row]
    token_logprobs = torch.where(parent >= 0, picked, torch.zeros_like(picked))
    return logits, token_logprobs


def _make_tree_forward(model: torch.nn.Module, opts: dict, tag: int):
    """A fresh copy of the traced function for one TreeModel.

    Its own code object gives it its own Dynamo cache, so many compiled models never share or
    exhaust one function's recompile limit (which would fall back to the untransformed model).
    """
    src = _tree_forward_template
    code = src.__code__.replace(co_name=f"treefx_forward_{tag}")
    glb = dict(src.__globals__)
    glb.update(model=model, opts=dict(opts))
    return types.FunctionType(code, glb, code.co_name)


class TreeModel(torch.nn.Module):
    """A model compiled for trees: ``out = tm(batch)`` for a :class:`TreeBatch`.

    Holds the user's model as ``.model`` (same parameters: an optimizer built on the model keeps
    working, and the model itself keeps working on ordinary batches).
    """

    def __init__(self, model: torch.nn.Module, backend: str = "auto", *, block_size: int = 128,
                 pass_position_ids: bool | None = None):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"treefx.compile expects a torch.nn.Module, got {type(model).__name__}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS[:3]}, got {backend!r}")
        self.model = model
        self.backend = backend
        self.block_size = block_size
        params = inspect.signature(model.forward).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())

        def accepts(name):
            return name in params or takes_kwargs and name in ("use_cache",)

        opts = {
            "position_ids": accepts("position_ids") if pass_position_ids is None
            else bool(pass_position_ids),
            "attention_mask": accepts("attention_mask"),
            "use_cache": accepts("use_cache"),
        }
        if opts["position_ids"] and not accepts("position_ids") and not takes_kwargs:
            raise ValueError("pass_position_ids=True but the model's forward has no position_ids")
        self.opts = opts
        self.num_compilations = 0
        self.contexts: list[GraphContext] = []
        self._runs = 0
        self._compiled: dict[str, object] = {}

    # ------------------------------------------------------------------ compile

    def _resolve_backend(self, device: torch.device) -> str:
        if self.backend != "auto":
            if self.backend == "inductor" and device.type == "cpu":
                log.warning("inductor backend on the CPU: FlexAttention has no CPU backward")
            return self.backend
        return "inductor" if device.type == "cuda" else "eager"

    def _dynamo_backend(self, backend: str):
        def compile_graph(gm: fx.GraphModule, example_inputs):
            ctx = _context(gm, backend, self.block_size)
            run_passes(ctx)
            self.contexts.append(ctx)
            self.num_compilations += 1
            log.info("compiled a tree graph (%s backend, %d so far)", backend,
                     self.num_compilations)
            if backend == "inductor":
                from torch._inductor.compile_fx import compile_fx

                compiled = compile_fx(ctx.gm, example_inputs)
            else:
                compiled = ctx.gm.forward

            def run(*args):
                self._runs += 1
                return compiled(*args)

            return run

        return compile_graph

    def _function(self, backend: str):
        if backend not in self._compiled:
            fn = _make_tree_forward(self.model, self.opts, id(self))
            self._compiled[backend] = torch.compile(
                fn, backend=self._dynamo_backend(backend), fullgraph=True
            )
        return self._compiled[backend]

    # ------------------------------------------------------------------ run

    def forward(self, batch: TreeBatch) -> TreeOutput:
        if not isinstance(batch, TreeBatch):
            raise TypeError(f"expected a treefx.TreeBatch (see treefx.pack), got "
                            f"{type(batch).__name__}")
        self._check_batch(batch)
        backend = self._resolve_backend(batch.device)
        fn = self._function(backend)
        input_ids = batch.input_ids
        tree_info = torch.stack([batch.position_ids[0], batch.parent_token, batch.subtree_end])
        torch._dynamo.maybe_mark_dynamic(input_ids, 1)
        torch._dynamo.maybe_mark_dynamic(tree_info, 1)
        runs = self._runs
        try:
            logits, token_logprobs = fn(input_ids, tree_info)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None) or e.__cause__
            if isinstance(inner, TreeCompileError):
                raise inner from None
            raise
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            raise _graph_break_error(self.model, self.opts, input_ids, tree_info, e) from None
        if self._runs == runs:
            raise TreeCompileError(
                "the tree graph did not run: Dynamo fell back to the unmodified model (recompile "
                "limit?). Its output would be silently wrong, so treefx stops here."
            )
        return TreeOutput(logits, token_logprobs)

    def _check_batch(self, batch: TreeBatch) -> None:
        dev = next(self.model.parameters(), torch.empty(0)).device
        if batch.device != dev:
            raise ValueError(f"the batch is on {batch.device} but the model is on {dev}; "
                             f"use batch.to({str(dev)!r})")
        vocab = _vocab_size(self.model)
        if vocab is not None:
            top = int(batch.input_ids.max())
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
            pass_position_ids: bool | None = None) -> TreeModel:
    """Compile ``model`` to run exactly on DFS-packed trees.

    ``backend``: ``"inductor"`` (CUDA: FlexAttention with the tree block mask and Inductor's
    fused kernels, forward and backward), ``"eager"`` (any device: SDPA with the dense tree
    mask; the reference), or ``"auto"`` (inductor on CUDA, eager otherwise, chosen per batch).
    ``pass_position_ids``: give the model the tree positions as ``position_ids`` (default: when
    its forward takes them); otherwise the positions pass replaces the ``arange`` it builds.
    """
    return TreeModel(model, backend, block_size=block_size, pass_position_ids=pass_position_ids)


def _context(gm: fx.GraphModule, backend: str, block_size: int) -> GraphContext:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {}
    for n in placeholders:
        for key in ("input_ids", "tree_info"):
            if key in n.name:
                by_name[key] = n
    if set(by_name) != {"input_ids", "tree_info"}:
        raise TreeCompileError(f"captured graph lacks the tree inputs (placeholders: "
                               f"{[n.name for n in placeholders]})")
    ids, info = by_name["input_ids"], by_name["tree_info"]
    code_before = gm.code
    g = gm.graph
    fake = example(info)
    with g.inserting_after(placeholders[-1]):
        se = g.call_function(_row, (info, 2))
    with g.inserting_after(placeholders[-1]):
        pos = g.call_function(_row, (info, 0))
    with fake.fake_mode if hasattr(fake, "fake_mode") else _null():
        pos.meta["example_value"] = fake[0]
        se.meta["example_value"] = fake[2]
    return GraphContext(gm=gm, backend="inductor" if backend == "inductor" else (
        "flex" if backend == "flex-eager" else "eager"),
        input_ids=ids, tree_info=info, positions=pos, subtree_end=se,
        seq_len=example(ids).shape[1], entry=se.next, block_size=block_size,
        code_before=code_before)


def _row(tree_info: torch.Tensor, i: int) -> torch.Tensor:
    return tree_info[i]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _graph_break_error(model, opts, input_ids, tree_info, err) -> GraphBreakError:
    fn = _make_tree_forward(model, opts, -1)
    reasons = []
    try:
        explained = torch._dynamo.explain(fn)(input_ids, tree_info)
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
