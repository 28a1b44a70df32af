"""treefx: ``treefx.pack(tree).to(dev)``, ``treefx.compile(model)`` (inductor),
``treefx.tree_loss``. Its variant ``treefx_nologits``: the same step with ``logits=False`` (the
output projection fused with the log-softmax)."""

from __future__ import annotations

from functools import partial

import treefx

from ..env import TREE_ATTN, set_attn


def make(env, model, parts, args=None, key="treefx_model", **options):
    tm = treefx.compile(model, backend=env.tree_backend, **options)
    parts[key] = tm

    return lambda tree: tree_step(env, model, tm, tree)


# Each variant's method name -> (maker, the parts entry holding its compiled model)
VARIANTS = {"treefx_nologits": (partial(make, key="treefx_nologits_model", logits=False),
                                "treefx_nologits_model")}


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
