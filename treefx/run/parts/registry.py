"""Each compiled model's part graphs, and each ``@treefx.step``'s per model: the
:class:`~treefx.run.parts.runner.PartRunner` objects :func:`treefx.backward` builds, kept
weakly by what they belong to."""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ..model import TreeModel
from ..step import TreeStep
from .graphs import part_forward, part_step_function
from .runner import PartRunner

__all__ = ["runner_for", "runners", "step_runner"]


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


def runner_for(tm: TreeModel, own_loss: bool) -> PartRunner:
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


def step_runner(step: TreeStep, model: torch.nn.Module) -> PartRunner:
    """The part graph of ``step`` for ``model``."""
    by_model = _RUNNERS.setdefault(step, weakref.WeakKeyDictionary())
    runner = by_model.get(model)
    if runner is None:
        runner = PartRunner(model, part_step_function(step.fn),
                            replace(step.plan, mode="part-step"), verify=False)
        by_model[model] = runner
    return runner
