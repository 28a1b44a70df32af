"""treefx: ``treefx.pack(tree).to(dev)``, ``treefx.compile(model)`` (inductor),
``treefx.tree_loss``. ``treefx_standard``: the same with ``interleave_heads=False`` (the usual
[heads, row] layout at the attention sites; treefx interleaves the KV heads in training)."""

from __future__ import annotations

import treefx

from ..env import set_attn, tree_attn_impl


def make(env, model, parts, args=None, key="treefx_model", **options):
    tm = treefx.compile(model, backend=env.tree_backend, **options)
    parts[key] = tm

    return lambda tree: tree_step(env, model, tm, tree)


def make_standard(env, model, parts, args=None):
    return make(env, model, parts, key="treefx_standard_model", interleave_heads=False)


def tree_step(env, model, tm, trees):
    """One timed step of a compiled TreeModel: layout, forward, tree loss, backward."""
    def step():
        set_attn(model, tree_attn_impl(model))
        model.zero_grad(set_to_none=True)
        batch = treefx.pack(trees, reduction="mean").to(env.dev)
        loss = treefx.tree_loss(tm(batch), batch)
        loss.backward()
        return loss.detach()
    return step
