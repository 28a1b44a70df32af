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
forward would draw others. Under FSDP2 the plan has no recompute parts (a recompute part's
backward gathers the layers for its second forward too, once more than another rank's
backward in that round): what the budget cannot hold is held, with a warning.
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
from . import regional
from . import backends
from .engine import TreeEngine, check_batch, regional_by_default
from ..layout import TreeBatch, forget_host_rows, move_tensors, pack
from ..ops.logprobs import register_site, token_logprobs_site, token_loss_site
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


def _check_part_shapes(input_ids, tree_info, part_info, ctx_tok, state_entry, labels,
                       weights=None) -> None:
    """The sizes a part graph's inputs share (told to Dynamo: the token count, the context's,
    the labels')."""
    torch._check(tree_info.shape[1] == input_ids.shape[1])
    torch._check(state_entry.shape[0] == input_ids.shape[1])
    torch._check(ctx_tok.shape[0] == part_info.shape[1])
    if weights is not None:
        torch._check(weights.shape[1] == labels.shape[1])


def part_forward(opts: dict, loss: bool = False):
    """The function a compiled model's part captures: the model on the part's tokens, their
    log-probabilities at their predecessors, and the part's own columns and exit states (the
    marker the passes replace, :func:`treefx.compiler.lower.parts.part_outputs`). ``loss``:
    the part's tree loss made in the graph from its tokens' weights (``loss_weights`` [1, m],
    an input after ``labels``; not named ``tree_weights``, which marks a step's graph),
    returned first, the log-probabilities last and detached
    (:func:`treefx.ops.logprobs.token_loss_site`: the output projection's gradients made in
    the forward, one product fewer than differentiating the log-probabilities)."""
    if loss:
        def tree_part_loss(model, input_ids, tree_info, part_info, ctx_tok, ctx_state,
                           state_entry, state_exit, labels, loss_weights, emb_sink, grads):
            _check_part_shapes(input_ids, tree_info, part_info, ctx_tok, state_entry, labels,
                               loss_weights)
            logits = model_logits(model, opts, input_ids, tree_info)
            total, lp = token_loss_site(logits, labels[1], labels[0], loss_weights[0])
            own, exits = part_outputs(input_ids, ctx_tok, ctx_state, state_exit, part_info,
                                      state_entry, tree_info, emb_sink, grads)
            return total, own, exits, lp

        return tree_part_loss

    def tree_part(model, input_ids, tree_info, part_info, ctx_tok, ctx_state, state_entry,
                  state_exit, labels, emb_sink, grads):
        _check_part_shapes(input_ids, tree_info, part_info, ctx_tok, state_entry, labels)
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
        _check_part_shapes(input_ids, tree_info, part_info, ctx_tok, state_entry, labels,
                           tree_weights)
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

    def __init__(self, model: torch.nn.Module, fn, plan: Plan, *, verify: bool,
                 own_loss: bool = False):
        _register()
        self.fn = fn
        self.plan = plan
        # the graph makes treefx.tree_loss itself (part_forward(loss=True)): it takes the
        # tokens' weights and returns (loss, own, exits, log-probabilities)
        self.own_loss = own_loss
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
        # Run regionally (FSDP2, regional=True, or by default through Inductor), gradients go
        # through autograd only: an FSDP2 parameter's .grad is a shard (the graph runs on the
        # gathered parameters, FSDP reduce-scatters what autograd accumulates there), and a
        # regional graph takes no list of .grad buffers per call. (A default regional run that
        # falls back to the whole graph keeps autograd's gradients: the same values.)
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        self.autograd_only = bool(plan.regional) or bool(regional.fsdp_units(model)) or \
            regional_by_default(plan, model, backends.resolve(plan.backend, device))
        if self.autograd_only:
            self.plan = replace(plan, route_embedding=False)

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
        candidates = [] if self.autograd_only else \
            [p for p in self.model.parameters() if _grad_candidate(p)]
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
        if self.step or self.own_loss:  # the label weights last
            args += (t["tree_weights"],)
            dynamic += (9,)
        dynamic += ((len(args), 0),)
        return args + (sink, grads), dynamic

    def needs_capture(self, t: dict, ctx_tok, ctx_state, sink) -> bool:
        """Whether the engine would capture its graph again for this part (regional only)."""
        args, _ = self._args(t, ctx_tok, ctx_state, sink, self.engine.plan.grad_params)
        return self.engine.needs_capture(t["input_ids"].device, *args, discover_in=self.model)

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
        # a graph that makes its own loss hands on its log-probabilities too
        return out[:4] if self.own_loss else out[:3]


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


def _runner(tm: TreeModel, own_loss: bool) -> PartRunner:
    """The part graph of ``tm``: making treefx.tree_loss itself (``own_loss``: ``backward``'s
    own objective) or handing out log-probabilities (for a ``loss_fn``). The first call of
    either for ``tm`` is checked against the oracle (``verify``)."""
    by_kind = _RUNNERS.setdefault(tm, {})
    runner = by_kind.get(own_loss)
    if runner is None:
        runner = PartRunner(tm.model, part_forward(tm.opts, loss=own_loss),
                            replace(tm.plan, mode="part"), verify=tm.verify_requested,
                            own_loss=own_loss)
        by_kind[own_loss] = runner
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
    dummy: bool = False  # a zero-weight part run to keep the ranks' collectives in step
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


def backward(tm: TreeModel, trees: Tree | Iterable[Tree] | TreeBatch | None, *,
             max_tokens: int,
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
    gets its gradient through autograd, once per part that reads it, as usual; so does every
    parameter of a model run regionally (FSDP2, ``regional=True``).

    Several processes: a model sharded with FSDP2 (``fully_shard`` per layer and root) or
    wrapped in DDP trains in parts too. Every rank of the group calls ``backward`` with its
    share of the global batch (:func:`treefx.distributed.pack`, whose ``allow_empty=True``
    gives None to a rank without trees: pass that, or ``[]``) and may cut it into its own
    number of parts; the gathered gradients equal one process on all trees whole, and the
    returned loss is the rank's (their mean over ranks is the global batch's). Under FSDP2 the
    ranks run their parts in common rounds, a rank without a part to run in a round running a
    two-token part of zero weight, so that their collectives pair up; a round lasts as long
    as its largest part, so every rank cuts its trees into as many parts as the rank with the
    most, as evenly as they allow within ``max_tokens`` (:func:`treefx.parts.plan_even`); gradients go through
    autograd (FSDP reduce-scatters them in every part's backward). Under DDP the parts run on
    the inner module and the gradients are averaged over the group once, at the end (a
    wrapper with a communication hook or mixed precision is refused). See
    docs/ARCHITECTURE.md, "Parts on several processes".

    Parts are planned by :func:`treefx.parts.plan`: a boundary may fall anywhere, inside a
    node too. Memory: activations are held for at most ``max_tokens`` tokens at once
    (``plan.peak_held_tokens()``): the current part's and those of the held parts of open
    nodes on the current root path (nodes whose subtrees exceed the room), as many as the
    budget leaves room for; the other open parts are recomputed (``plan.recompute_tokens``:
    their forward runs twice, once without a graph; not under FSDP2, where they are held). Beside them, the keys, values and conv
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
    the user's code; nor is an FSDP2 model's part graph, whose gradients are shards).
    """
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
    wrapper = regional.unwrap_ddp(root)[1] if kind == "ddp" else None
    group = _group(kind, target, wrapper)
    runner = _runner(tm, own_loss=loss_fn is None) if step is None else \
        _step_runner(step, target)
    if runner.verify:
        runner.verify = False
        if kind == "fsdp":
            # the probe's parts would gather and reduce-scatter (sharded .grad, collectives
            # every rank must match): not checked here; tests/test_distributed_parts.py
            runner.verification = ("not checked: the part graph of a model sharded with FSDP2 "
                                   "is not probed on its first call")
            log.info("treefx.backward: %s", runner.verification)
        else:  # a DDP model's parts run on its inner module, with no collective
            if trees is not None:  # the probe's vocabulary, where the model declares none
                tm._note_token_ids(trees)
            with wrapper.no_sync() if wrapper is not None else contextlib.nullcontext():
                _verify_first_call(tm, runner)
    if trees is None or (isinstance(trees, (list, tuple)) and not trees):
        if kind is None:
            raise ValueError("treefx.backward: no trees (an empty forest trains nothing); a "
                             "rank with no trees passes None (or []) only under FSDP2 or DDP")
        batch = None
    elif isinstance(trees, TreeBatch):
        given = [k for k, v in (("reduction", reduction), ("num_sequences", num_sequences),
                                ("loss_scale", loss_scale)) if v is not None]
        if given:
            raise TypeError(f"treefx.backward: a packed batch carries its own {given[0]}; "
                            "pack it with that, or pass the trees")
        batch = trees.to("cpu")
    else:
        batch = pack(trees, reduction=reduction or "mean", num_sequences=num_sequences,
                     loss_scale=1.0 if loss_scale is None else loss_scale)
    if kind == "ddp":
        _check_ddp(wrapper)
    run = _Run(runner, batch, max_tokens, target, step=step, loss_fn=loss_fn,
               collective=kind == "fsdp")
    if kind == "fsdp":
        try:
            _rounds(run, group)
        finally:
            run.release()
    elif kind == "ddp":
        # The parts run on the inner module, without DDP's hooks (no_sync: its reducer ignores
        # the parts' backwards); the gradients are averaged over the group once, at the end.
        with wrapper.no_sync():
            _sync_ddp_buffers(wrapper)
            try:
                for event, i in run.events:
                    run.forward(i) if event == "F" else run.backward(i)
            finally:
                run.release()
        run.finish()
        _reduce_ddp(wrapper, group)
    else:
        try:
            for event, i in run.events:
                run.forward(i) if event == "F" else run.backward(i)
        finally:
            run.release()
        run.finish()
    return run.total.to(run.dtype)


def _group(kind: str | None, model: torch.nn.Module, wrapper):
    """The process group whose ranks run their parts together: DDP's ``process_group``; for
    FSDP2, its mesh's group (a 1-D mesh) or the default group (a mesh over every rank)."""
    if kind is None:
        return None
    import torch.distributed as dist

    if kind == "ddp":
        return wrapper.process_group
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    if mesh is None or mesh.ndim == 1:
        return mesh.get_group() if mesh is not None else None
    if mesh.size() == dist.get_world_size():
        return None
    raise TreeCompileError(
        "treefx.backward: an FSDP2 model on a mesh of several dimensions that does not span "
        "every rank (with tensor or pipeline parallelism): which ranks run their parts "
        "together is not known; shard it on a 1-D mesh, or over every rank")


def _check_ddp(wrapper) -> None:
    """A DDP wrapper whose gradients :func:`backward` may average itself: no communication
    hook, mixed precision or delayed all-reduce (each would reduce differently)."""
    what = ("a communication hook" if getattr(wrapper, "_comm_hooks", None) else
            "mixed precision" if getattr(wrapper, "mixed_precision", None) is not None else
            "delayed all-reduce parameters" if getattr(wrapper, "_delay_all_reduce_params",
                                                        None) else None)
    if what is not None:
        raise TreeCompileError(
            f"treefx.backward: the DDP wrapper has {what}; treefx.backward averages a DDP "
            "model's gradients itself, once per call (an all-reduce over its process group, "
            "divided by its size, as DDP's default), so that would not apply. Train whole "
            "batches through the wrapper, or remove it")


def _sync_ddp_buffers(wrapper) -> None:
    """DDP's buffer broadcast from rank 0, once before the parts, as its forward does (the
    parts run the inner module, without the wrapper's forward)."""
    will = getattr(wrapper, "will_sync_module_buffers", None)
    sync = getattr(wrapper, "_sync_buffers", None)
    if callable(will) and callable(sync) and will():
        sync()


def _reduce_ddp(wrapper, group, bucket_bytes: int = 25 << 20) -> None:
    """Every trained parameter's ``.grad`` (zeros where the parts left none) averaged over
    ``group`` as DDP's default reducer does (sum, divided by the group's size), in buckets
    of one dtype and device."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    ignore = getattr(wrapper, "parameters_to_ignore", set())
    params = [p for n, p in wrapper.module.named_parameters()
              if p.requires_grad and n not in ignore]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    world = dist.get_world_size(group)
    buckets: dict[tuple, list] = {}
    for p in params:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        while grads:
            take, size = [], 0
            while grads and (not take or size + grads[0].numel() * grads[0].element_size()
                             <= bucket_bytes):
                size += grads[0].numel() * grads[0].element_size()
                take.append(grads.pop(0))
            flat = _flatten_dense_tensors(take)
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            for g, r in zip(take, _unflatten_dense_tensors(flat, take)):
                g.copy_(r)


def _events(plan) -> list[tuple[str, int]]:
    """A plan's run in order: ("F", j), part j's forward; ("B", i), held part i's backward (as
    early as :func:`treefx.parts.ready` allows), ("R", i) where part i is a recompute part
    (its backward runs its forward again first)."""
    out, held = [], []
    for j, part in enumerate(plan.parts):
        out.append(("F", j))
        held.append(j)
        for i in parts_mod.ready(plan, sorted(held), part.end):
            out.append(("R" if plan.parts[i].recompute else "B", i))
            held.remove(i)
    return out


def _rounds(run: _Run, group) -> None:
    """Every rank's events run as one common sequence of rounds (FSDP2: each part's forward
    and backward gathers and reduce-scatters every layer, collectives all ranks must call in
    one order). The ranks' event strings are exchanged once; a round is a forward if any
    rank's next event is one, else a backward. A rank whose next event is not the round's
    runs a zero-weight dummy part's forward, or a held dummy's backward: every rank has run
    as many rounds, so every rank holds as many parts, and in a backward round that is at
    least one (a rank with a real backward holds it), all dummies on a rank that is done.
    The dummies left at the end run their backwards together."""
    import torch.distributed as dist

    def exchange() -> list:
        mine = "".join(e for e, _ in run.events)
        strings: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(strings, mine, group=group)
        return strings

    strings = exchange()
    # Every round lasts as long as its largest part: each rank cuts its trees into as many
    # parts as the rank with the most, as evenly as its trees allow (parts.plan_even), and
    # the event strings are exchanged again. Counted on real agent trees (benchmarks.balance
    # --rounds; medians over random steps of 2-8 ranks with 1-4 trees each), the rounds'
    # largest parts summed to 1.17-1.81x the busiest rank's tokens with each rank's own
    # plan, 1.00-1.50x so.
    most = max(s.count("F") for s in strings)
    if most > 1 and len(strings) > 1:
        run.even_parts(most)
        strings = exchange()
    # _Run plans without recompute parts under FSDP2; should one come, every rank sees it
    # here and all refuse together
    if any("R" in s for s in strings):
        raise TreeCompileError(
            "treefx.backward under FSDP2: a rank's plan recomputes parts (an open path longer "
            "than max_tokens lets it hold), whose second forward would gather the layers once "
            "more than the other ranks do. Raise max_tokens until treefx.parts.plan(batch, "
            "max_tokens).recompute_tokens is 0 on every rank, or use DDP")
    me = dist.get_rank(group)
    pos = [0] * len(strings)
    while True:
        nxt = [s[p] if p < len(s) else None for s, p in zip(strings, pos)]
        if all(x is None for x in nxt):
            break
        event = "F" if "F" in nxt else "B"
        real = run.events[pos[me]][1] if nxt[me] == event else None
        if event == "F":
            run.forward(real, group=group)
        elif real is not None:
            run.backward(real)
        else:
            run.backward(None)
        for r, x in enumerate(nxt):
            pos[r] += x == event
    while run.dummies:  # as many on every rank: backward rounds of dummies only
        run.backward(None)
    run.finish()


class _Run:
    """One call's parts (``batch`` None: a rank with no trees) and their state: the parts held
    for their backward, the dummies (zero-weight parts a rank runs to keep the ranks'
    collectives in step, :func:`_rounds`), the loss so far."""

    def __init__(self, runner: PartRunner, batch: TreeBatch | None, max_tokens: int,
                 target: torch.nn.Module, *, step, loss_fn, collective: bool,
                 on_logprobs: Callable | None = None):
        self.runner, self.step, self.loss_fn = runner, step, loss_fn
        # called with each part's log-probabilities in the batch's row, in the forward that
        # builds the backward's graph (the first-call check records them)
        self.on_logprobs = on_logprobs
        self.model = target
        self.collective = collective
        self.device = device = next(target.parameters()).device
        self.events: list[tuple[str, int]] = []
        self.plan = None
        if batch is not None:
            # Under FSDP2 no recompute parts: a recompute part's backward gathers the layers
            # for its second forward too, once more than another rank's backward in that
            # round. What the budget cannot hold there is held (as before recompute parts).
            self.max_tokens = max_tokens
            self.plan = parts_mod.plan(batch, max_tokens, block_size=runner.plan.block_size,
                                       recompute=not collective)
            if collective and self.plan.peak_held_tokens() > max_tokens:
                log.warning("treefx.backward under FSDP2: activations of %d tokens held at "
                            "once, over max_tokens=%d (an open path longer than the budget "
                            "holds; recompute parts do not run under FSDP2 yet)",
                            self.plan.peak_held_tokens(), max_tokens)
            self.full = batch.to(device)
            check_batch(target, self.full)
            self.events = _events(self.plan)
            log.info("treefx.backward: %d tokens in %d part(s) of at most %d",
                     batch.num_tokens, self.plan.num_parts, self.plan.max_tokens)
            # Each part predicts the tokens whose predecessor it holds; for treefx.backward's
            # own loss and a step's only the trained ones (weight nonzero), whose weights come
            # with the part: no [N] scatter, and the log-prob backward needs no host
            # synchronization to find them.
            self.weights = self._weights(batch)
            self.incidence = _Incidence(self.full) if loss_fn is not None else None
        self.held: dict[int, _Held] = {}
        self.dummies: list[_Held] = []
        # the keys of the host rows kept for each held part's (and dummy's) ops
        self.row_keys: dict[int, list] = {}
        self.dummy_keys: list[list] = []
        self.dummy_plan = None
        # the weights whose gradients the part graphs add into .grad directly have one from here
        self.created = runner.prepare_grads()
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.dtype = next(target.parameters()).dtype
        self.min_tokens = 3 if step is not None else 2

    def even_parts(self, num_parts: int) -> None:
        """Under FSDP2, before the rounds: the plan replaced by the one with at most
        ``num_parts`` parts (the most any rank has) whose largest part is smallest
        (:func:`treefx.parts.plan_even`), within the same budget."""
        if self.plan is None or not self.collective:
            return
        even = parts_mod.plan_even(self.plan.batch, self.max_tokens, num_parts,
                                   block_size=self.runner.plan.block_size, recompute=False)
        if even is not self.plan and even.num_parts <= num_parts:
            log.info("treefx.backward under FSDP2: %d part(s) of at most %d tokens, as many "
                     "as the rank with the most (%d), largest %d (was %d part(s), largest %d)",
                     even.num_parts, even.max_tokens, num_parts,
                     max(p.num_tokens for p in even.parts), self.plan.num_parts,
                     max(p.num_tokens for p in self.plan.parts))
            self.plan = even
            self.events = _events(even)

    def _weights(self, batch: TreeBatch):
        if self.step is not None:  # the step's "sum" and "mean" weights
            return step_weights(batch)
        if self.loss_fn is None:
            return batch.loss_weights[None]
        return None

    def _agree(self, group):
        """Under FSDP2: before a forward, the ranks agree on the captures it makes (a capture
        gathers every unit): each rank tells how many it needs, and one that needs fewer than
        the most gathers and frees every unit as often, as a capture would."""
        if not self.collective:
            return None
        import torch.distributed as dist

        def agree(mine: int) -> None:
            most = torch.tensor([mine], dtype=torch.int64, device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
            for _ in range(int(most.item()) - mine):
                with regional.capture_state(self.model):
                    pass

        return agree

    def forward(self, j: int | None, group=None) -> None:
        """Part ``j``'s forward, held for its backward; None: a dummy's."""
        if j is None:
            self._dummy_forward(group)
            return
        plan, part = self.plan, self.plan.parts[j]
        t, keys = _to_device(plan, part, self.device, self.weights,
                             min_tokens=self.min_tokens, every_label=self.on_logprobs is not None)
        self.row_keys[j] = keys
        # a recompute part's forward keeps no graph; its backward runs it again (_backward)
        rerun = _rerun(self.runner, plan, part, t, self.held, self.device, self._loss,
                       self._report)
        with torch.no_grad() if part.recompute else contextlib.nullcontext():
            first, own, exits, *rest = _forward(self.runner, plan, part, t, self.held,
                                                self.device, self.created, self._agree(group))
            loss = self._loss(first, t)
        if not part.recompute:
            self._report(first, rest, t)
        if j == 0 and plan.recompute_tokens:
            _check_recompute(self.runner)
        self.total = self.total + loss.detach().to(self.total.dtype)
        self.dtype = first.dtype
        self.held[j] = _hold(part, loss, own, exits, t, rerun)

    def _loss(self, lp: torch.Tensor, t: dict) -> torch.Tensor:
        """A part's loss from its graph's first output: the loss itself (a step's, or
        treefx.tree_loss made in the graph), or ``loss_fn`` on the part's batch from its
        log-probabilities."""
        if self.step is not None or self.runner.own_loss:
            loss = lp
        else:
            full = self.full
            toks = t["label_tokens"]
            mask = torch.zeros(full.num_tokens, dtype=torch.bool, device=self.device)
            mask.index_fill_(0, toks, True)  # `mask[toks] = True` copies from the host: a sync
            values = self._row(lp, t)
            part_batch = _part_batch(full, mask, self.incidence)
            loss = self.loss_fn(TreeOutput(None, values), part_batch)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            what = ("the @treefx.step function must return its loss alone, a scalar tensor"
                    if self.step is not None else "loss_fn must return a scalar tensor")
            raise TypeError(f"treefx.backward: {what}; got {type(loss).__name__}")
        return loss

    def _row(self, lp: torch.Tensor, t: dict) -> torch.Tensor:
        """The part's log-probabilities (over its predicted tokens, ``t["label_tokens"]``) in
        the batch's row [N], 0 elsewhere."""
        toks = t["label_tokens"]
        values = torch.zeros(self.full.num_tokens, dtype=lp.dtype, device=self.device)
        return values.index_put((toks,), lp[:toks.shape[0]])

    def _report(self, first: torch.Tensor, rest: list, t: dict) -> None:
        """``on_logprobs`` of the part's log-probabilities in the batch's row, from its graph's
        outputs: the last of a graph that makes its own loss, else the first (a step's graph
        hands out none)."""
        if self.on_logprobs is None or self.step is not None:
            return
        lp = rest[0] if self.runner.own_loss else first
        self.on_logprobs(self._row(lp.detach(), t))

    def _dummy_forward(self, group) -> None:
        """The forward of a two-token tree whose loss is backpropagated with a zero gradient:
        every module runs (so every collective), and nothing is added to any gradient."""
        if self.dummy_plan is None:
            batch = pack([Tree.from_sequences([[0, 0]])], reduction="sum")
            self.dummy_plan = parts_mod.plan(batch, 2, block_size=self.runner.plan.block_size)
            w = self._weights(batch)
            self.dummy_weights = None if w is None else torch.zeros_like(w)
        plan = self.dummy_plan
        part = plan.parts[0]
        t, keys = _to_device(plan, part, self.device, self.dummy_weights,
                             min_tokens=self.min_tokens)
        self.dummy_keys.append(keys)
        first, own, exits, *_ = _forward(self.runner, plan, part, t, {}, self.device,
                                         self.created, self._agree(group))
        self.dummies.append(_Held(first.sum(), own, exits, own.detach().requires_grad_(),
                                  exits.detach().requires_grad_(), t["emb_sink"],
                                  t["emb_rows"], t["emb_inverse"], dummy=True))

    def backward(self, i: int | None) -> None:
        """Held part ``i``'s backward; None: a held dummy's."""
        h = self.held.pop(i) if i is not None else self.dummies.pop()
        _backward(h, self.runner.embedding, every_output=self.collective)
        forget_host_rows(self.row_keys.pop(i) if i is not None else self.dummy_keys.pop())

    def finish(self) -> None:
        self.release()
        if self.held:  # cannot happen: every part is released at the row's end
            raise RuntimeError(f"treefx.backward: parts {sorted(self.held)} never ran their "
                               "backward")

    def release(self) -> None:
        """Forget the host rows kept for parts whose backward did not run (an error)."""
        for keys in [*self.row_keys.values(), *self.dummy_keys]:
            forget_host_rows(keys)
        self.row_keys.clear()
        self.dummy_keys.clear()


def _to_device(plan, part, device, weights: torch.Tensor | None = None, *,
               min_tokens: int = 2, every_label: bool = False) -> tuple[dict, list]:
    """The part's tensors and the indices its context is gathered with, moved in one pinned,
    non-blocking copy per dtype, and the keys of the rows whose host copies are kept for the
    part's ops until its backward (:func:`treefx.parts.keep_host_rows`). A plain copy from
    pageable memory would wait for the GPU to
    finish the previous part, so the host could not prepare this one meanwhile. ``weights``
    [R, N] (on the host): the part predicts only the tokens with a nonzero weight in some
    row, and their columns become ``tree_weights`` [R, m] (zero where ``labels`` is
    padded; ``every_label``: every token with a predecessor, weighted or not, as the
    first-call check reads every log-probability). ``min_tokens``: see
    :func:`treefx.parts.part_tensors`."""
    keep = None
    if weights is not None:
        mine = weights[:, torch.from_numpy(part.label_tokens)]
        keep = (mine != 0).any(0) | every_label
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
    # move_tensors hands back views into one buffer per dtype; Dynamo makes a view's storage
    # offset a size of the graph, which regional execution does not bind: own storage each
    # (a few small device copies a part)
    moved = [m if m.storage_offset() == 0 else m.clone() for m in moved]
    t_dev = dict(zip(names, moved))
    return t_dev, parts_mod.keep_host_rows(t_dev, t, pinned=True)


def _verify_first_call(tm: TreeModel, runner: PartRunner) -> None:
    """The probe check (:func:`treefx.verification.verify_compiled`) with the tree side run in
    parts: the probe forest cut at a third of its tokens (boundaries inside nodes, context and
    state crossing them), log-probabilities and gradients against each sequence alone, through
    ``runner``'s graph (one that makes treefx.tree_loss itself, or one handing out
    log-probabilities for a ``loss_fn``, with treefx.tree_loss as that). The model's ``.grad``,
    buffers and random state are left as they were."""
    from .. import verification
    from ..verification import VerificationUnavailable

    def tree_run(batch, chosen):
        # each part's log-probabilities in the batch's row, once: a recompute part's forward
        # runs twice, first without autograd (not reported), then in its backward
        lps = []
        for _, p in chosen:
            p.grad = None
        try:
            with torch.enable_grad():
                # this process's parts alone (a DDP model's inner module: no collective)
                run = _Run(runner, batch.to("cpu"), max(3, batch.num_tokens // 3), tm.model,
                           step=None, loss_fn=None if runner.own_loss else tree_loss,
                           collective=False, on_logprobs=lps.append)
                try:
                    for event, i in run.events:
                        run.forward(i) if event == "F" else run.backward(i)
                finally:
                    run.release()
                run.finish()
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


def _forward(runner: PartRunner, plan, part, t: dict, held: dict, device, created=(),
             agree=None):
    """A part's forward. ``agree(n)`` (under FSDP2): called with the number of captures this
    forward makes, before any (see :meth:`_Run._agree`)."""
    t["emb_sink"] = runner.sink(t)
    settle = runner.engine is None
    if settle:
        if agree is not None:
            agree(2)  # the layout's capture, then the engine's first
        with torch.enable_grad():  # the layout and routing of the training graph
            runner._settle(t, created)
    layout = runner.layout
    ctx_tok = _gather_tokens(part, t, held, layout.tok_width, layout.tok_dtype, device)
    ctx_state = _gather_states(plan, part, held, layout.state_width, layout.state_dtype, device)
    if agree is not None and not settle:
        agree(int(runner.needs_capture(t, ctx_tok, ctx_state, t["emb_sink"])))
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


def _rerun(runner: PartRunner, plan, part, t: dict, held: dict, device, part_loss, report):
    """A recompute part's forward again, with a graph, for its backward: its context read
    from the same leaves of the parts still held (so their gradients arrive through this
    graph only: the first forward built none), its loss by ``part_loss``; ``report`` (as
    :meth:`_Run._report`) told of this run's outputs."""
    def rerun():
        with torch.enable_grad():
            first, own, exits, *rest = _forward(runner, plan, part, t, held, device)
            report(first, rest, t)
            return part_loss(first, t), own, exits, t["emb_sink"]

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


def _backward(h: _Held, embedding, *, every_output: bool = False) -> None:
    """A held part's backward: its loss (a dummy's with a zero gradient) and the outputs later
    parts read, with the gradients those left in its leaves. ``every_output`` (FSDP2): every
    output that requires grad is a root, with zeros where nothing read it, so that every
    part's backward (a dummy's too) has the same graph and reaches the layers' hooks
    (gathers, reduce-scatters) in the same order on every rank."""
    if h.rerun is not None:  # a recompute part: its forward again, with a graph
        h.loss, h.own, h.exits, h.sink = h.rerun()
    tensors, grads = [], []
    if h.loss.requires_grad:
        tensors.append(h.loss)
        grads.append(torch.zeros_like(h.loss) if h.dummy else torch.ones_like(h.loss))
    for out, leaf in ((h.own, h.own_leaf), (h.exits, h.exits_leaf)):
        if out.requires_grad and (leaf.grad is not None or every_output):
            tensors.append(out)
            grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(out))
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
