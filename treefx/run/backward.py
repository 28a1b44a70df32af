"""``treefx.backward``: train on trees larger than one step's memory, in parts, computing every
token once.

The trees are packed as one row and cut into parts of at most ``max_tokens`` tokens
(:mod:`treefx.parts`). Each part runs through the model's tree graph in *part mode*: its
queries attend over the keys and values of its context (the path from the root to its first
token, computed by earlier parts) and its own, its convolutions read their left inputs there,
its recurrences start from the states earlier parts handed on; it returns its own keys, values
and conv inputs (and its exit states) for the parts after it.

Those come in as detached leaves that require grad, so after a part's backward their gradients
sit in the leaves' ``.grad``; a part's own backward runs once every later part that reads it
has run its own, with those gradients as the ``grad_tensors`` of its outputs. A part's
backward therefore runs exactly once, and as early as possible: right after its forward when
its subtrees end inside it, else once the row has passed the end of its last subtree.

A token is forwarded twice only in a *recompute* part (:mod:`treefx.parts`: the open tokens
past what the budget can hold, on a comb-shaped tree or a sequence longer than the budget):
its forward runs under ``no_grad``, keeping its own keys, values, conv inputs and exit states
as the leaves later parts read (and its inputs), and at its backward its forward runs again
with a graph, reading the same context leaves, and is differentiated with the gradients later
parts left in its leaves (part-level activation checkpointing). The first forward built no
graph, so the context's gradients arrive once, through the second. A plan with recompute
parts refuses a part graph that draws random numbers (dropout in training mode): the second
forward would draw others.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch

from .. import parts as parts_mod
from .engine import TreeEngine, check_batch
from ..layout import TreeBatch, move_tensors, pack
from ..ops.logprobs import register_site, token_logprobs_site
from ..compiler import TreeCompileError
from ..compiler.lower.parts import PartLayoutMismatch, has_grad_hooks, part_outputs
from ..plan import PartLayout, Plan
from .step import TreeStep, step_batch, step_weights
from ..tree import Tree
from .model import TreeModel, TreeOutput, model_logits, tree_loss

__all__ = ["PartRunner", "backward", "part_forward", "part_step_function", "runners"]

log = logging.getLogger("treefx")

_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        register_site()
        torch._dynamo.allow_in_graph(part_outputs)
        _REGISTERED = True


def part_forward(opts: dict):
    """The function a compiled model's part captures: the model on the part's tokens, their
    log-probabilities at their predecessors, and the part's own columns and exit states (the
    marker the passes replace, :func:`treefx.compiler.lower.parts.part_outputs`)."""
    def tree_part(model, input_ids, tree_info, part_info, ctx_tok, ctx_state, state_entry,
                  state_exit, labels, emb_sink, grads):
        torch._check(tree_info.shape[1] == input_ids.shape[1])
        torch._check(state_entry.shape[0] == input_ids.shape[1])
        torch._check(ctx_tok.shape[0] == part_info.shape[1])
        logits = model_logits(model, opts, input_ids, tree_info)
        lp = token_logprobs_site(logits, labels[1], labels[0])
        own, exits = part_outputs(input_ids, ctx_tok, ctx_state, state_exit, part_info,
                                  state_entry, tree_info, emb_sink, grads)
        return lp, own, exits

    return tree_part


def part_step_function(user_fn):
    """The function a ``@treefx.step``'s part captures. The loss pass reads the part's
    predicted tokens from ``labels`` and their weights from ``tree_weights`` [2, m] ("sum",
    "mean"); the labels the step sees only mark the tokens with a predecessor (the pass
    checks the cross-entropy's shape, not their values)."""
    def tree_part_step(model, input_ids, tree_info, part_info, ctx_tok, ctx_state,
                       state_entry, state_exit, labels, tree_weights, emb_sink, grads):
        torch._check(tree_info.shape[1] == input_ids.shape[1])
        torch._check(state_entry.shape[0] == input_ids.shape[1])
        torch._check(ctx_tok.shape[0] == part_info.shape[1])
        torch._check(tree_weights.shape[1] == labels.shape[1])
        result = user_fn(model, step_batch(input_ids, tree_info, tree_info[1] >= 0))
        own, exits = part_outputs(input_ids, ctx_tok, ctx_state, state_exit, part_info,
                                  state_entry, tree_info, emb_sink, grads)
        # Small views of the label inputs keep them graph inputs whatever the step reads.
        return result, own, exits, labels[:, :1], tree_weights[:, :1]

    return tree_part_step


class PartRunner:
    """The part graph of a compiled model (or of a ``@treefx.step`` function for one model):
    the context layout its sites need, and the engine compiled for it.

    The layout (the widths of the context buffers) and the parameters whose ``.grad`` the
    graph adds into are known only once the passes ran: the first call captures the graph
    once to find them (``Plan.find_layout``: a capture that is never run), then builds the
    engine for them (:meth:`_settle`). ``engine`` is None until then. A recompute part's
    first forward (without autograd) runs through ``no_grad_engine``, the same plan captured
    on its own, so that ``engine`` holds the graphs that train."""

    def __init__(self, model: torch.nn.Module, fn, plan: Plan, *, verify: bool):
        _register()
        self.fn = fn
        self.plan = plan
        self.engine: TreeEngine | None = None
        self.no_grad_engine: TreeEngine | None = None
        self.layout: PartLayout | None = None
        self.model = model
        self.step = plan.mode == "part-step"
        # the first call checks the part graph against the oracle, as treefx.compile's
        # first call checks the whole-tree graph (verify=, TREEFX_VERIFY)
        self.verify = verify
        self.verification = None
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        w = getattr(emb, "weight", None)
        # the sink's width and dtype: the input embedding's ([n, 1] for a model without one)
        self.sink_layout = (w.shape[1], w.dtype) if isinstance(w, torch.Tensor) and \
            w.dim() == 2 else (1, torch.float32)
        self.embedding = None  # (parameter, padding_idx) whose part rows get the gradient
        # the parameters offered to the graph to add their gradients into .grad directly, as
        # candidates (offered) before the layout is found, then those it takes (the engine's)
        self.grad_key = None
        self.offered: tuple = ()

    @property
    def grad_params(self) -> tuple:
        return self.engine.plan.grad_params if self.engine is not None else self.offered

    def prepare_grads(self) -> list[torch.nn.Parameter]:
        """Before a call's parts: the parameters whose gradients the part graph adds into
        ``.grad`` directly (:func:`treefx.compiler.lower.parts.route_gradients`), each given a zero
        ``.grad`` where it has none; returns those it gave one. The first call offers every
        matrix that trains (without gradient hooks) and keeps those the graph takes
        (:meth:`_settle`); when that set of candidates changes (a parameter frozen, a hook
        added), the graph is captured again."""
        candidates = [p for p in self.model.parameters() if _grad_candidate(p)]
        key = tuple(map(id, candidates))
        if self.grad_key is not None and key != self.grad_key:
            log.info("treefx.backward: the trainable parameters changed; capturing the part "
                     "graph again")
            self.engine = None
            self.no_grad_engine = None
            self.layout = None
            self.embedding = None
            self.grad_key = None
        if self.grad_key is None:
            self.grad_key = key
            self.offered = tuple(candidates)
        created = []
        for p in self.grad_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                created.append(p)
        return created

    def sink(self, t: dict) -> torch.Tensor:
        """Zero rows [n, D] that receive the part's rows of the input embedding's gradient
        (:func:`treefx.compiler.lower.parts.route_embedding`; D and dtype the embedding's, [n, 1] for
        a model without one)."""
        width, dtype = self.sink_layout
        ids = t["input_ids"]
        return torch.zeros(ids.shape[1], width, dtype=dtype, device=ids.device,
                           requires_grad=True)

    def _args(self, t: dict, ctx_tok, ctx_state, sink, grad_params):
        grads = [_own_version(p.grad) for p in grad_params]
        args = (self.model, t["input_ids"], t["tree_info"], t["part_info"], ctx_tok, ctx_state,
                t["state_entry"], t["state_exit"], t["labels"])
        dynamic = (1, 2, 3, (4, 0), (5, 0), 6, 7, 8)
        if self.step:  # the label weights last
            args += (t["tree_weights"],)
            dynamic += (9,)
        dynamic += ((len(args), 0),)
        return args + (sink, grads), dynamic

    def _run(self, engine: TreeEngine, t: dict, ctx_tok, ctx_state, sink):
        args, dynamic = self._args(t, ctx_tok, ctx_state, sink, engine.plan.grad_params)
        return engine(t["input_ids"].device, *args, dynamic=dynamic, discover_in=self.model)

    def _settle(self, t: dict, created) -> None:
        """Find the layout and the gradient routing with empty context buffers (the first
        part has no context), keep the parameters the graph adds into (taking back the zero
        ``.grad`` given to the others, ``created``), and build the engine for them."""
        dtype = next(self.model.parameters()).dtype
        n_ctx, n_entries = t["part_info"].shape[1], t["state_entry"].shape[0]
        device = t["input_ids"].device
        finder = TreeEngine(self.fn, replace(self.plan, grad_params=self.offered,
                                             find_layout=True))
        self._run(finder, t, torch.zeros(n_ctx, 0, dtype=dtype, device=device),
                  torch.zeros(max(n_entries, 2), 0, dtype=dtype, device=device), self.sink(t))
        found = finder.compiled[-1].part
        kept = tuple(self.offered[k] for k in found.grads_used)
        kept_ids, created_ids = set(map(id, kept)), set(map(id, created))
        for p in self.offered:
            if id(p) not in kept_ids and id(p) in created_ids:
                p.grad = None
        self.layout = found.layout
        self.engine = TreeEngine(self.fn, replace(self.plan, grad_params=kept))
        self.no_grad_engine = TreeEngine(self.fn, replace(self.plan, grad_params=kept))
        log.info("treefx.backward: the part graph hands on %s, and adds %d weights' "
                 "gradients into .grad", found.layout.describe(), len(kept))

    def draws_random(self) -> str | None:
        """Where the part graphs captured so far draw random numbers, or None."""
        from ..verification import graph_draws_random

        for engine in (self.engine, self.no_grad_engine):
            where = graph_draws_random(engine) if engine is not None else None
            if where is not None:
                return where
        return None

    def __call__(self, t: dict, ctx_tok, ctx_state, sink, num_tokens: int):
        engine = self.engine if torch.is_grad_enabled() else self.no_grad_engine
        try:
            out = self._run(engine, t, ctx_tok, ctx_state, sink)
        except PartLayoutMismatch as e:
            raise TreeCompileError(
                f"the part graph for a part of {num_tokens} token(s) hands on "
                f"{e.found.layout.describe()} and adds {len(e.found.grads_used)} of "
                f"{len(self.engine.plan.grad_params)} weights' gradients into .grad, the "
                f"earlier parts' {self.layout.describe()}: the model's code takes another "
                "branch for this token count (a cache it fills, a short-row special case?), "
                "so its sites differ between parts") from e
        if self.embedding is None:
            self.embedding = next((c.part.embedding for c in engine.compiled
                                   if c.part is not None and c.part.embedding is not None),
                                  None)
        return out[:3]


def _own_version(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a new tensor with a version counter of its own (not a view, which
    shares its base's). A part's graph adds into ``.grad`` in its backward; AOTAutograd saves
    that input for the backward and checks, when it runs, that its version is the one saved.
    Parts run their backwards out of order, so an earlier part's backward may already have
    added into ``.grad`` in between: one alias per part keeps each check to its own writes."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        return out.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _grad_candidate(p: torch.nn.Parameter) -> bool:
    """A matrix that trains, has no gradient hook, and whose ``.grad`` (if any) is a dense,
    contiguous tensor of its own dtype: its gradient may be added into ``.grad`` directly."""
    g = p.grad
    return p.requires_grad and p.dim() == 2 and p.dtype.is_floating_point and \
        not has_grad_hooks(p) and (g is None or (
            g.layout == torch.strided and g.dtype == p.dtype and g.shape == p.shape
            and g.is_contiguous()))


# Each compiled model's part graph, and each step's per model (its sites' layout is the
# model's): treefx.backward's own state, kept here, keyed weakly by what it belongs to.
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runners(owner) -> list[PartRunner]:
    """The part graphs :func:`backward` built for a compiled model or a ``@treefx.step`` (one
    per model the step ran on), oldest first: their engines hold the captured graphs
    (``runners(tm)[0].engine.contexts``)."""
    found = _RUNNERS.get(owner)
    if found is None:
        return []
    return [found] if isinstance(found, PartRunner) else list(found.values())


def _runner(tm: TreeModel) -> PartRunner:
    runner = _RUNNERS.get(tm)
    if runner is None:
        runner = PartRunner(tm.model, part_forward(tm.opts), replace(tm.plan, mode="part"),
                            verify=tm.verify_requested)
        _RUNNERS[tm] = runner
    return runner


def _step_runner(step: TreeStep, model: torch.nn.Module) -> PartRunner:
    """The part graph of ``step`` for ``model``."""
    by_model = _RUNNERS.setdefault(step, weakref.WeakKeyDictionary())
    runner = by_model.get(model)
    if runner is None:
        runner = PartRunner(model, part_step_function(step.fn),
                            replace(step.plan, mode="part-step"), verify=False)
        by_model[model] = runner
    return runner


@dataclass(eq=False)
class _Held:
    """A part whose forward ran and whose backward has not: its loss and outputs (the graph
    to differentiate), and the detached leaves later parts read. A recompute part
    (``rerun`` set) holds no graph: its loss and outputs are None until :func:`_backward`
    runs its forward again (``rerun() -> (loss, own, exits, sink)``)."""

    loss: torch.Tensor | None
    own: torch.Tensor | None
    exits: torch.Tensor | None
    own_leaf: torch.Tensor
    exits_leaf: torch.Tensor
    sink: torch.Tensor | None  # the part's rows of the input embedding's gradient
    emb_rows: torch.Tensor  # the part's distinct ids, and each token's among them
    emb_inverse: torch.Tensor
    rerun: Callable | None = None


def _hold(part, loss, own, exits, t: dict, rerun: Callable) -> _Held:
    """What a part keeps from its forward until its backward: for a recompute part
    (``part.recompute``, its forward run without a graph) only the leaves later parts read,
    its inputs (``t``) and ``rerun``, which runs the forward again with a graph."""
    leaves = own.detach().requires_grad_(), exits.detach().requires_grad_()
    if part.recompute:  # the second forward makes its own sink for the embedding's rows
        t.pop("emb_sink")
        return _Held(None, None, None, *leaves, None, t["emb_rows"], t["emb_inverse"],
                     rerun=rerun)
    return _Held(loss, own, exits, *leaves, t["emb_sink"], t["emb_rows"], t["emb_inverse"])


def backward(tm: TreeModel, trees: Tree | Iterable[Tree] | TreeBatch, *, max_tokens: int,
             reduction: str | None = None, loss_fn: Callable | None = None,
             num_sequences: int | None = None, loss_scale: float | None = None,
             model: torch.nn.Module | None = None) -> torch.Tensor:
    """Train on trees larger than memory: forward and backward in parts, each token computed once.

    Forward and backward of ``trees`` (one tree or a forest, packed as one batch) in parts
    of at most ``max_tokens`` tokens, every token computed once; the parameter gradients are
    added to ``.grad`` (like ``loss.backward()``). Returns the loss, detached: the batch's
    loss as :func:`treefx.tree_loss` gives it for ``treefx.pack(trees, reduction=...)``.

    ``tm``: a model from :func:`treefx.compile`. ``trees``: trees, packed here with
    ``reduction`` (default ``"mean"``), ``num_sequences`` and ``loss_scale`` as
    :func:`treefx.pack` takes them; or a batch already packed (by :func:`treefx.pack`, or
    :func:`treefx.distributed.pack` for a rank's share of a global batch), which carries
    those itself. ``loss_fn(out, part_batch) -> scalar``:
    another per-token objective instead of :func:`treefx.tree_loss` (every :mod:`treefx.rl`
    objective is one); it is called once per part with ``out.token_logprobs`` [N] over the
    whole batch's row, the part's predicted tokens filled in and 0 elsewhere (``out.logits``
    is None), and ``part_batch`` the whole batch with its loss weights (and the
    sequences' coefficients :mod:`treefx.rl` reads) kept only on those tokens. The losses of
    the parts add up to the batch's loss for any objective that is a sum over tokens of a term
    of that token's log-probability.

    ``tm`` may instead be a ``@treefx.step`` function, with the model it trains as ``model=``
    (``treefx.backward(train_step, trees, model=model, max_tokens=...)``): the step runs once
    per part, its cross-entropy rewritten to the part's predicted tokens, and the returned
    loss is what ``train_step(model, treefx.pack(trees))`` returns (the step's own reduction,
    so ``reduction`` and ``loss_fn`` are not taken; the step takes no extra arguments and
    returns the loss alone, as a scalar).

    Gradients: each linear layer whose weight trains, and the output projection, add their
    weight's gradient straight into ``.grad`` in a part's backward (no per-part gradient for
    autograd to add); such a weight without a ``.grad`` gets a zero one when the call starts.
    A parameter with a gradient hook (``register_hook``, ``register_post_accumulate_grad_hook``)
    gets its gradient through autograd, once per part that reads it, as usual.

    A model sharded with FSDP2 or wrapped in DDP is refused (not yet): each rank would cut
    its trees into its own number of parts, and the ranks' collectives would not match.

    Parts are planned by :func:`treefx.parts.plan`: a boundary may fall anywhere, inside a
    node too. Memory: activations are held for at most ``max_tokens`` tokens at once
    (``plan.peak_held_tokens()``): the current part's and those of the held parts of open
    nodes on the current root path (nodes whose subtrees exceed the room), as many as the
    budget leaves room for; the other open parts are recomputed (``plan.recompute_tokens``:
    their forward runs twice, once without a graph). Beside them, the keys, values and conv
    inputs of the open path at every layer (``plan.peak_context_tokens()`` tokens, whatever
    the budget: later parts attend to them) and the recurrent states at the parts'
    boundaries; a held part's attention also saves its context's keys and values (it
    attends over them) for its backward. With activation checkpointing, a held part keeps
    its checkpointed layers' inputs instead of their activations, and its backward
    recomputes them. Runs on
    the compiled model's backend. Attention the model scores itself (a softcap, a sink, a
    bias of positions) is exact in parts; a bias the passes can read only at the part's own
    rows (not a function of positions) is refused.

    The first call for a compiled model checks the part graph on a small probe forest cut
    into parts against each sequence run alone (log-probabilities and gradients), unless the
    model was compiled with ``verify=False`` (or ``TREEFX_VERIFY=0``); the report is
    ``treefx.run.backward.runners(tm)[0].verification`` (a step is not checked: its loss is
    the user's code).
    """
    from . import regional
    from .engine import unwrap_compiled

    step = None
    if isinstance(tm, TreeStep):
        if not isinstance(model, torch.nn.Module):
            raise TypeError("treefx.backward(step, trees, model=..., max_tokens=...): a "
                            "@treefx.step function needs the model it trains as model=")
        if loss_fn is not None or reduction is not None:
            raise TypeError("treefx.backward: a @treefx.step function computes its own loss "
                            "and reduction; loss_fn= and reduction= are for a compiled model")
        step, root = tm, unwrap_compiled(model)
        target = regional.unwrap_ddp(root)[0]
    elif isinstance(tm, TreeModel):
        if model is not None:
            raise TypeError("treefx.backward: model= goes with a @treefx.step function; a "
                            "model from treefx.compile is the first argument itself")
        target, root = tm.model, tm._root[0]
    else:
        raise TypeError(f"treefx.backward takes a model from treefx.compile or a @treefx.step "
                        f"function, got {type(tm).__name__}")

    kind = regional.distributed_kind(target, root if root is not target else None)
    if kind is not None:
        # Each rank's trees cut into its own number of parts, forwards and backwards in its
        # own order: FSDP's gathers and reduce-scatters (and DDP's buffer broadcasts) would
        # pair different layers' collectives across ranks.
        how = "sharded with FSDP2" if kind == "fsdp" else "wrapped in DDP"
        raise TreeCompileError(
            f"treefx.backward does not run a model {how} yet: each rank would run its own "
            "number of parts, and the collectives of different ranks would not match. Train "
            "its trees in whole batches (treefx.distributed), or in parts on one GPU")
    runner = _runner(tm) if step is None else _step_runner(step, target)
    if runner.verify:
        runner.verify = False
        tm._note_token_ids(trees)  # the probe's vocabulary, where the model declares none
        _verify_first_call(tm, runner)
    if isinstance(trees, TreeBatch):
        given = [k for k, v in (("reduction", reduction), ("num_sequences", num_sequences),
                                ("loss_scale", loss_scale)) if v is not None]
        if given:
            raise TypeError(f"treefx.backward: a packed batch carries its own {given[0]}; "
                            "pack it with that, or pass the trees")
        batch = trees.to("cpu")
    else:
        batch = pack(trees, reduction=reduction or "mean", num_sequences=num_sequences,
                     loss_scale=1.0 if loss_scale is None else loss_scale)
    device = next(target.parameters()).device
    plan = parts_mod.plan(batch, max_tokens, block_size=runner.plan.block_size)
    full = batch.to(device)
    check_batch(target, full)
    log.info("treefx.backward: %d tokens in %d part(s) of at most %d", batch.num_tokens,
             plan.num_parts, plan.max_tokens)
    # Each part predicts the tokens whose predecessor it holds; for treefx.backward's own loss
    # and a step's only the trained ones (weight nonzero), whose weights come with the part:
    # no [N] scatter, and the log-prob backward needs no host synchronization to find them.
    if step is not None:  # the step's "sum" and "mean" weights
        weights = step_weights(batch)
    elif loss_fn is None:
        weights = batch.loss_weights[None]
    else:
        weights = None
    held: dict[int, _Held] = {}
    # the weights whose gradients the part graphs add into .grad directly have one from here
    created = runner.prepare_grads()
    total = torch.zeros((), dtype=torch.float64, device=device)
    incidence = _Incidence(full) if loss_fn is not None else None

    def part_loss(lp, t):
        if step is not None:
            loss = lp
        elif loss_fn is None:  # treefx.tree_loss over the part's trained tokens
            w = t["tree_weights"][0]
            loss = -(w.to(lp.dtype) * lp[:w.shape[0]]).sum()
        else:
            toks = t["label_tokens"]
            mask = torch.zeros(batch.num_tokens, dtype=torch.bool, device=device)
            mask.index_fill_(0, toks, True)  # `mask[toks] = True` copies from the host: a sync
            values = torch.zeros(batch.num_tokens, dtype=lp.dtype, device=device)
            values = values.index_put((toks,), lp[:toks.shape[0]])
            part_batch = _part_batch(full, mask, incidence)
            loss = loss_fn(TreeOutput(None, values), part_batch)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            what = ("the @treefx.step function must return its loss alone, a scalar tensor"
                    if step is not None else "loss_fn must return a scalar tensor")
            raise TypeError(f"treefx.backward: {what}; got {type(loss).__name__}")
        return loss

    for j, part in enumerate(plan.parts):
        t = _to_device(plan, part, device, weights, min_tokens=3 if step is not None else 2)
        # a recompute part's forward keeps no graph; its backward runs it again (_backward)
        rerun = _rerun(runner, plan, part, t, held, device, part_loss)
        with torch.no_grad() if part.recompute else contextlib.nullcontext():
            lp, own, exits = _forward(runner, plan, part, t, held, device, created)
            loss = part_loss(lp, t)
        if j == 0 and plan.recompute_tokens:
            _check_recompute(runner)
        total = total + loss.detach().to(total.dtype)
        held[j] = _hold(part, loss, own, exits, t, rerun)
        for i in parts_mod.ready(plan, sorted(held), part.end):
            _backward(held.pop(i), runner.embedding)
    if held:  # cannot happen: every part is released at the row's end
        raise RuntimeError(f"treefx.backward: parts {sorted(held)} never ran their backward")
    return total.to(lp.dtype)


def _to_device(plan, part, device, weights: torch.Tensor | None = None, *,
               min_tokens: int = 2) -> dict:
    """The part's tensors and the indices its context is gathered with, moved in one pinned,
    non-blocking copy per dtype: a plain copy from pageable memory would wait for the GPU to
    finish the previous part, so the host could not prepare this one meanwhile. ``weights``
    [R, N] (on the host): the part predicts only the tokens with a nonzero weight in some
    row, and their columns become ``tree_weights`` [R, m] (zero where ``labels`` is
    padded). ``min_tokens``: see :func:`treefx.parts.part_tensors`."""
    keep = None
    if weights is not None:
        mine = weights[:, torch.from_numpy(part.label_tokens)]
        keep = (mine != 0).any(0)
        mine = mine[:, keep]
        keep = keep.numpy()
    t = parts_mod.part_tensors(plan, part, min_tokens=min_tokens, keep_labels=keep)
    if weights is not None:
        w = weights.new_zeros(weights.shape[0], t["labels"].shape[1])
        w[:, :mine.shape[1]] = mine
        t["tree_weights"] = w
    rows, inverse = np.unique(t["input_ids"][0].numpy(), return_inverse=True)
    t["emb_rows"], t["emb_inverse"] = torch.from_numpy(rows), torch.from_numpy(inverse)
    ctx = part.context
    if len(ctx):
        owner = plan.part_of_token[ctx]
        for i in np.unique(owner).tolist():
            t[f"rows_{i}"] = torch.from_numpy(ctx[owner == i] - plan.parts[i].start)
    names = list(t)
    moved = move_tensors([t[k] for k in names], torch.device(device))
    return dict(zip(names, moved))


def _verify_first_call(tm: TreeModel, runner: PartRunner) -> None:
    """The probe check (:func:`treefx.verification.verify_compiled`) with the tree side run in
    parts: the probe forest cut at a third of its tokens (boundaries inside nodes, context and
    state crossing them), log-probabilities and gradients against each sequence alone. The
    model's ``.grad``, buffers and random state are left as they were."""
    from .. import verification
    from ..verification import VerificationUnavailable

    def tree_run(batch, chosen):
        lps = []

        def record(out, b):
            lps.append(out.token_logprobs.detach())
            return tree_loss(out, b)

        for _, p in chosen:
            p.grad = None
        try:
            with torch.enable_grad():
                backward(tm, batch.trees, max_tokens=max(3, batch.num_tokens // 3),
                         reduction=batch.reduction, loss_fn=record)
        except TreeCompileError:
            if runner.draws_random() is None:
                raise  # else the probe's recompute parts were refused: unavailable, below
        where = runner.draws_random()
        if where is not None:
            raise VerificationUnavailable(
                f"cannot verify treefx.backward's part graph: it draws random numbers at "
                f"{where} (dropout in training mode?)")
        return sum(lps), [p.grad for _, p in chosen]

    try:
        runner.verification = verification.verify_compiled(tm, tree_run=tree_run)
    except VerificationUnavailable as e:
        runner.verification = str(e)
        log.warning("%s", e)


def _forward(runner: PartRunner, plan, part, t: dict, held: dict, device, created=()):
    t["emb_sink"] = runner.sink(t)
    if runner.engine is None:
        with torch.enable_grad():  # the layout and routing of the training graph
            runner._settle(t, created)
    layout = runner.layout
    ctx_tok = _gather_tokens(part, t, held, layout.tok_width, layout.tok_dtype, device)
    ctx_state = _gather_states(plan, part, held, layout.state_width, layout.state_dtype, device)
    return runner(t, ctx_tok, ctx_state, t["emb_sink"], part.num_tokens)


def _gather_tokens(part, t: dict, held, width, dtype, device) -> torch.Tensor:
    """The context rows [A, W]: each context token's own row from the part that computed it
    (through the autograd graph into that part's leaf), then zero padding."""
    pieces = [held[int(k[5:])].own_leaf[rows] for k, rows in t.items() if k.startswith("rows_")]
    pad = part.context_pad - len(part.context)
    pieces.append(torch.zeros(pad, width, dtype=dtype, device=device, requires_grad=not pieces))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _gather_states(plan, part, held, width, dtype, device) -> torch.Tensor:
    """The entries' states [max(E, 2), S], each the exit state of its predecessor's part."""
    pieces = []
    for p in part.entries.tolist():
        i = int(plan.part_of_token[p])
        row = int(np.searchsorted(plan.parts[i].exits, p))
        pieces.append(held[i].exits_leaf[row:row + 1])
    pad = max(0, 2 - len(pieces))
    if pad or not pieces:
        pieces.append(torch.zeros(pad, width, dtype=dtype, device=device,
                                  requires_grad=not pieces))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _rerun(runner: PartRunner, plan, part, t: dict, held: dict, device, part_loss):
    """A recompute part's forward again, with a graph, for its backward: its context read
    from the same leaves of the parts still held (so their gradients arrive through this
    graph only: the first forward built none), its loss by ``part_loss``."""
    def rerun():
        with torch.enable_grad():
            lp, own, exits = _forward(runner, plan, part, t, held, device)
            return part_loss(lp, t), own, exits, t["emb_sink"]

    return rerun


def _check_recompute(runner: PartRunner) -> None:
    """Refuse recompute parts whose graph draws random numbers: the forward run again would
    draw others (dropout masks), so the gradients would not be those of the loss returned.
    Checked after the call's first forward, before any backward adds into ``.grad``."""
    where = runner.draws_random()
    if where is not None:
        raise TreeCompileError(
            f"treefx.backward: this plan recomputes parts (an open path longer than "
            f"max_tokens allows to hold), but the part graph draws random numbers at {where} "
            "(dropout in training mode?), which a second forward would not draw again. Set "
            "the dropout to 0 (or call model.eval()), or raise max_tokens until "
            "treefx.parts.plan(batch, max_tokens).recompute_tokens is 0")


def _backward(h: _Held, embedding) -> None:
    if h.rerun is not None:  # a recompute part: its forward again, with a graph
        h.loss, h.own, h.exits, h.sink = h.rerun()
    tensors, grads = [], []
    if h.loss.requires_grad:
        tensors.append(h.loss)
        grads.append(torch.ones_like(h.loss))
    for out, leaf in ((h.own, h.own_leaf), (h.exits, h.exits_leaf)):
        if leaf.grad is not None and out.requires_grad:
            tensors.append(out)
            grads.append(leaf.grad)
    if tensors:
        torch.autograd.backward(tensors, grads)
    if h.sink.grad is not None:
        _add_embedding_grad(embedding[0], h.sink.grad, h.emb_rows, h.emb_inverse)


def _add_embedding_grad(weight: torch.nn.Parameter, g: torch.Tensor, rows: torch.Tensor,
                        inverse: torch.Tensor) -> None:
    """A part's gradient rows [n, D] of the input embedding added into ``weight.grad`` at its
    distinct ids ``rows`` (``inverse``: each token's among them): summed per id in float32,
    rounded once, added like ``AccumulateGrad`` adds a dense gradient, at those rows only."""
    acc = torch.zeros(rows.shape[0], g.shape[1], device=g.device,
                      dtype=torch.promote_types(g.dtype, torch.float32))
    acc.index_add_(0, inverse, g.to(acc.dtype))
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    weight.grad.index_add_(0, rows, acc.to(weight.grad.dtype))


class _Incidence:
    """The whole batch's path incidence (:func:`treefx.rl.path_incidence`), built once, from
    which each part's keeps the coefficients of its predicted tokens."""

    def __init__(self, batch: TreeBatch):
        from .. import rl

        self.rl = rl
        self.inc = rl.path_incidence(batch)

    def restrict(self, batch: TreeBatch, mask: torch.Tensor) -> TreeBatch:
        return self.rl.restricted_incidence(batch, self.inc, mask)


def _part_batch(full: TreeBatch, mask: torch.Tensor, incidence: _Incidence | None) -> TreeBatch:
    """``full`` with its loss weights (and, for :mod:`treefx.rl`, its incidence's
    coefficients) zero outside ``mask``."""
    def keep(w):
        return torch.where(mask, w, torch.zeros_like(w))

    part = replace(full, loss_weights=keep(full.loss_weights), _block_masks={},
                   loss_weights_by_reduction={r: keep(w) for r, w in
                                              full.loss_weights_by_reduction.items()})
    return incidence.restrict(part, mask) if incidence is not None else part
