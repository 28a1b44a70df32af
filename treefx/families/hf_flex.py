"""Hugging Face models built with ``attn_implementation="flex_attention"``.

Their flex path builds a block mask over the whole row by a vmap of its ``mask_mod``, which
the passes cannot rewrite onto a tree. Their ``eager`` attention is the reference form of
every Hugging Face attention, with the same math (masks, windows, softcaps, sinks), and the
attention pass rewrites it into FlexAttention over the tree. So treefx captures and runs such
a model through its eager attention (:func:`eager_attention`, entered by the engine's capture
environment), and on the CPU, where FlexAttention has no backward, the per-sequence oracle
does the same (:func:`eager_attention_on_cpu`, registered into the oracle at import:
:func:`treefx.reference.register_oracle_attention`).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ..reference import register_oracle_attention

__all__ = ["eager_attention", "eager_attention_on_cpu"]


def _configs(model: torch.nn.Module) -> list:
    """The Hugging Face configs of the model's modules and their sub-configs."""
    found, seen, todo = [], set(), [getattr(m, "config", None) for m in model.modules()]
    while todo:
        cfg = todo.pop()
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation_internal"):
            continue
        seen.add(id(cfg))
        found.append(cfg)
        todo.extend(getattr(cfg, k, None) for k in getattr(cfg, "sub_configs", None) or ())
    return found


_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its configs


@contextlib.contextmanager
def eager_attention(model: torch.nn.Module | None):
    """Within this block, ``model``'s flex-attention configs say ``eager`` (set for the call
    only, on every call: Dynamo's guards read it), so the model keeps its implementation
    outside treefx."""
    if model is None:
        yield
        return
    if model not in _CONFIGS:
        _CONFIGS[model] = _configs(model)
    # Read now, not when first seen: the user may switch the implementation between calls.
    flex = [c for c in _CONFIGS[model] if c._attn_implementation_internal == "flex_attention"]
    for cfg in flex:
        cfg._attn_implementation_internal = "eager"
    try:
        yield
    finally:
        for cfg in flex:
            cfg._attn_implementation_internal = "flex_attention"


def eager_attention_on_cpu(model: torch.nn.Module):
    """How the oracle runs ``model``: as it is, except a flex-attention model on the CPU (no
    FlexAttention backward there, and its compiled CPU forward is not reliable at every
    length), which runs its eager attention."""
    p = next(model.parameters(), None)
    on_cpu = p is None or p.device.type == "cpu"
    return eager_attention(model) if on_cpu else contextlib.nullcontext()


register_oracle_attention(eager_attention_on_cpu)
