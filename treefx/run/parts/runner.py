"""The part graph of a compiled model or of a ``@treefx.step`` for one model
(:class:`PartRunner`): the context layout its sites need, found by a first capture, and the
engine compiled for it."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ...compiler import TreeCompileError
from ...compiler.lower.parts import PartLayoutMismatch, has_grad_hooks
from ...plan import PartLayout, Plan
from .. import backends, wrapping
from ..engine import TreeEngine, regional_by_default
from .graphs import register

__all__ = ["PartRunner"]

log = logging.getLogger("treefx")


class PartRunner:
    """The part graph of a compiled model (or of a ``@treefx.step`` function for one model):
    the context layout its sites need, and the engine compiled for it.

    The layout (the widths of the context buffers) and the parameters whose ``.grad`` the
    graph adds into are known only once the passes ran: the first call captures the graph
    once to find them (``Plan.find_layout``: a capture that is never run), then builds the
    engine for them (:meth:`settle`). ``engine`` is None until then. A recompute part's
    first forward (without autograd) runs through ``no_grad_engine``, the same plan captured
    on its own, so that ``engine`` holds the graphs that train."""

    def __init__(self, model: torch.nn.Module, fn, plan: Plan, *, verify: bool,
                 own_loss: bool = False):
        register()
        self.fn = fn
        self.plan = plan
        # the graph makes treefx.tree_loss itself (part_forward(loss=True)): it takes the
        # tokens' weights and returns (loss, own, exits, log-probabilities)
        self.own_loss = own_loss
        self.engine: TreeEngine | None = None
        self.no_grad_engine: TreeEngine | None = None
        # captures made so far by engines no longer held (the layout's, and those of a part
        # graph captured again for other trainable parameters): see num_compilations
        self._past_compilations = 0
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
        self.autograd_only = bool(plan.regional) or bool(wrapping.fsdp_units(model)) or \
            regional_by_default(plan, model, backends.resolve(plan.backend, device))
        if self.autograd_only:
            self.plan = replace(plan, route_embedding=False)

    @property
    def num_compilations(self) -> int:
        """The part graphs captured so far for this model: the capture that finds the
        layout, then the engines' (:attr:`TreeEngine.num_compilations`: the graph that
        trains, and the one a recompute part's first forward runs without autograd). Once
        each is the least a call with recompute parts makes; a later call, at any budget,
        captures nothing more unless the trainable parameters change."""
        return self._past_compilations + sum(
            e.num_compilations for e in (self.engine, self.no_grad_engine) if e is not None)

    @property
    def grad_params(self) -> tuple:
        return self.engine.plan.grad_params if self.engine is not None else self.offered

    def prepare_grads(self) -> list[torch.nn.Parameter]:
        """Before a call's parts: the parameters whose gradients the part graph adds into
        ``.grad`` directly (:func:`treefx.compiler.lower.parts.route_gradients`), each given a zero
        ``.grad`` where it has none; returns those it gave one. The first call offers every
        matrix that trains (without gradient hooks) and keeps those the graph takes
        (:meth:`settle`); when that set of candidates changes (a parameter frozen, a hook
        added), the graph is captured again."""
        candidates = [] if self.autograd_only else \
            [p for p in self.model.parameters() if _grad_candidate(p)]
        key = tuple(map(id, candidates))
        if self.grad_key is not None and key != self.grad_key:
            log.info("treefx.backward: the trainable parameters changed; capturing the part "
                     "graph again")
            self._past_compilations = self.num_compilations
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
        (:func:`treefx.compiler.lower.parts.route_embedding`; D and dtype the embedding's,
        [n, 1] for a model without one)."""
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

    def settle(self, t: dict, created) -> None:
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
        self._past_compilations += finder.num_compilations
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
        from ...verification import graph_draws_random

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
