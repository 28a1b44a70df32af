"""treefx: ``treefx.pack(tree).to(dev)``, ``treefx.compile(model)`` (inductor),
``treefx.tree_loss``. Variants, each the same step with one option changed:
``treefx_nologits``: ``logits=False`` (the output projection fused with the log-softmax);
``treefx_regional``: ``regional=True`` (one compiled piece per layer type);
``treefx_keep_states`` (hybrids on fla, one pass): the forward's chunk states kept for the
backward (``TREEFX_FLA_TREE_KEEP_STATES=1``), sharing ``treefx``'s compiled model."""

from __future__ import annotations

import os

import treefx

from ..env import TREE_ATTN, set_attn


def make(env, model, parts, args=None, key="treefx_model", **options):
    tm = treefx.compile(model, backend=env.tree_backend, **options)
    parts[key] = tm

    return lambda tree: tree_step(env, model, tm, tree)


def make_nologits(env, model, parts, args=None):
    return make(env, model, parts, key="treefx_nologits_model", logits=False)


def make_regional(env, model, parts, args=None):
    return make(env, model, parts, key="treefx_regional_model", regional=True)


def _with_env(env, model, parts, key: str, name: str, value: str):
    """The default compiled model (shared with ``treefx`` when both run), each step run with
    the environment variable ``name`` set to ``value`` (a switch read at run time)."""
    tm = parts.get("treefx_model") or treefx.compile(model, backend=env.tree_backend)
    parts[key] = tm

    def prepare(trees):
        inner = tree_step(env, model, tm, trees)

        def step():
            old = os.environ.get(name)
            os.environ[name] = value
            try:
                return inner()
            finally:
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
        return step
    return prepare


def make_keep_states(env, model, parts, args=None):
    from treefx.families.fla_tree import KEEP_ENV

    return _with_env(env, model, parts, "treefx_keep_states_model", KEEP_ENV, "1")


# Each variant's method name -> (maker, the parts entry holding its compiled model)
VARIANTS = {"treefx_nologits": (make_nologits, "treefx_nologits_model"),
            "treefx_regional": (make_regional, "treefx_regional_model"),
            "treefx_keep_states": (make_keep_states, "treefx_keep_states_model")}


def tree_step(env, model, tm, trees):
    """One timed step of a compiled TreeModel: layout, forward, tree loss, backward."""
    def step():
        set_attn(model, TREE_ATTN)
        model.zero_grad(set_to_none=True)
        batch = treefx.pack(trees, reduction="mean").to(env.dev)
        loss = treefx.tree_loss(tm(batch), batch)
        loss.backward()
        return loss.detach()
    return step
