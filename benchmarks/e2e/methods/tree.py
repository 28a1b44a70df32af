"""treefx: ``treefx.pack(tree).to(dev)``, ``treefx.compile(model)`` (inductor),
``treefx.tree_loss``. Variants, each the same step with one option changed:
``treefx_nologits``: ``logits=False`` (the output projection fused with the log-softmax);
``treefx_regional``: ``regional=True`` (one compiled piece per layer type);
``treefx_keep_states`` (hybrids on fla, one pass): the forward's chunk states kept for the
backward (``TREEFX_FLA_TREE_KEEP_STATES=1``), sharing ``treefx``'s compiled model."""

from __future__ import annotations

import os
from functools import partial

import treefx

from ..env import TREE_ATTN, set_attn


def make(env, model, parts, args=None, key="treefx_model", **options):
    tm = treefx.compile(model, backend=env.tree_backend, **options)
    parts[key] = tm

    return lambda tree: tree_step(env, model, tm, tree)


def make_keep_states(env, model, parts, args=None):
    """The default compiled model (shared with ``treefx`` when both run), each step run with
    ``TREEFX_FLA_TREE_KEEP_STATES=1`` (a switch read at run time)."""
    from treefx.families.fla_tree import KEEP_ENV

    tm = parts.get("treefx_model") or treefx.compile(model, backend=env.tree_backend)
    parts["treefx_keep_states_model"] = tm

    def prepare(trees):
        inner = tree_step(env, model, tm, trees)

        def step():
            old = os.environ.get(KEEP_ENV)
            os.environ[KEEP_ENV] = "1"
            try:
                return inner()
            finally:
                if old is None:
                    os.environ.pop(KEEP_ENV, None)
                else:
                    os.environ[KEEP_ENV] = old
        return step
    return prepare


# Each variant's method name -> (maker, the parts entry holding its compiled model)
VARIANTS = {"treefx_nologits": (partial(make, key="treefx_nologits_model", logits=False),
                                "treefx_nologits_model"),
            "treefx_regional": (partial(make, key="treefx_regional_model", regional=True),
                                "treefx_regional_model"),
            "treefx_keep_states": (make_keep_states, "treefx_keep_states_model")}


def tree_step(env, model, tm, trees, loss_of=None):
    """One timed step of a compiled TreeModel: layout, forward, tree loss, backward
    (``loss_of(batch)``: another loss of the batch)."""
    def step():
        set_attn(model, TREE_ATTN)
        model.zero_grad(set_to_none=True)
        batch = treefx.pack(trees, reduction="mean").to(env.dev)
        loss = loss_of(batch) if loss_of else treefx.tree_loss(tm(batch), batch)
        loss.backward()
        return loss.detach()
    return step
