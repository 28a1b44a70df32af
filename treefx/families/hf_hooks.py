"""Hugging Face's hooks around a capture.

Output-capturing hooks (router logits, hidden states, attentions, ...): Hugging Face installs
them lazily, on the first forward that asks for such an output, under a threading lock that
Dynamo cannot trace. :func:`install_output_hooks` installs them before the capture, for the
modules whose config asks for a captured output (a Mixtral-style model with
``output_router_logits=True``), as that forward would; the engine calls it once per model.

Input-gradient hooks: activation checkpointing (``gradient_checkpointing_enable`` /
``activation_checkpointing_enable``) calls ``enable_input_require_grads``, a forward hook on
the input embeddings that calls ``requires_grad_(True)`` on their output, so that *reentrant*
checkpointing reaches adapter weights behind frozen embeddings. Dynamo of torch 2.11 breaks the
graph there when the output does not require grad yet (a part's embedding rows); a captured
checkpoint is non-reentrant, which reaches every parameter inside without them.
:func:`without_input_grad_hooks` leaves them out of a capture (they are restored after).

Checkpointing flags: which modules run Hugging Face's activation checkpointing (a module's
``gradient_checkpointing``, with its ``_gradient_checkpointing_func``) decides whether a capture
holds checkpointed layers. :func:`checkpointing_flags` reads them (a regional graph's key),
:func:`checkpointing_state` snapshots them and :func:`checkpointing_restored` puts a snapshot
back for a block (TRL turns checkpointing off around its no-grad calls).
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch

__all__ = ["checkpointing_flags", "checkpointing_restored", "checkpointing_state",
           "install_output_hooks", "traced_padding_masks", "without_input_grad_hooks"]


def checkpointing_flags(model: torch.nn.Module) -> tuple[bool, ...]:
    """Each module's Hugging Face checkpointing flag (``gradient_checkpointing``), in
    ``model.modules()`` order, for the modules that have one."""
    return tuple(bool(m.gradient_checkpointing) for m in model.modules()
                 if hasattr(m, "gradient_checkpointing"))


def checkpointing_state(model: torch.nn.Module) -> list:
    """A snapshot of ``model``'s checkpointing: (module, flag, checkpoint function) for each
    module with a ``gradient_checkpointing`` flag."""
    return [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"))
            for m in model.modules() if hasattr(m, "gradient_checkpointing")]


@contextlib.contextmanager
def checkpointing_restored(state: list):
    """The checkpointing of a :func:`checkpointing_state` snapshot while the block runs; what
    each module had before, after."""
    before = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"))
              for m, _, _ in state]
    _set_checkpointing(state)
    try:
        yield
    finally:
        _set_checkpointing(before)


def _set_checkpointing(state: list) -> None:
    for m, flag, func in state:
        m.gradient_checkpointing = flag
        if func is not None:
            m._gradient_checkpointing_func = func
        else:
            m.__dict__.pop("_gradient_checkpointing_func", None)


@contextlib.contextmanager
def without_input_grad_hooks(model: torch.nn.Module | None):
    """``model``'s ``enable_input_require_grads`` hooks removed while the block runs, put back
    in their order after (see the module's docstring)."""
    saved = []
    for module in model.modules() if model is not None else ():
        handles = list(getattr(module, "_require_grads_hooks", None) or ())
        one = getattr(module, "_require_grads_hook", None)
        if one is not None and one not in handles:
            handles.append(one)
        for handle in handles:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                if not any(h is hooks for h, _ in saved):
                    saved.append((hooks, dict(hooks)))
                del hooks[handle.id]
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


# Hugging Face's hybrid models up to transformers 5.14 drop their recurrent layers' padding
# mask where it is all ones, with ``torch.all(attention_mask == 1)``: a branch on data, a graph
# break. From 5.15 they skip that test while tracing
# (``masking_utils.create_recurrent_attention_mask``) and keep the mask.
_PADDING_MASK_METHODS = ("_update_linear_attn_mask", "_update_mamba_mask")


# model -> (module, method) of the padding-mask methods its modules have
_MASK_METHODS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mask_as_given(attention_mask, *args, **kwargs):
    return attention_mask


@contextlib.contextmanager
def traced_padding_masks(model: torch.nn.Module | None):
    """While a tree runs, ``model``'s padding-mask methods above return the mask as it is, as
    later releases do while tracing: the same values (a mask of ones multiplies nothing away;
    one with zeros is kept by both), without the branch. Removed after."""
    patched = []
    if model is not None and model not in _MASK_METHODS:  # found once per model
        _MASK_METHODS[model] = [(m, a) for m in model.modules() for a in _PADDING_MASK_METHODS
                                if callable(getattr(type(m), a, None))]
    for module, attr in _MASK_METHODS.get(model, ()) if model is not None else ():
        if attr not in vars(module):
            setattr(module, attr, _mask_as_given)
            patched.append((module, attr))
    try:
        yield
    finally:
        for module, attr in patched:
            if vars(module).get(attr) is _mask_as_given:
                delattr(module, attr)


def install_output_hooks(model: torch.nn.Module) -> None:
    """Install Hugging Face's output-capturing hooks on ``model``'s modules whose config asks
    for a captured output, as their first forward would (a transformers without them, or not
    imported, is left alone). See the module's docstring."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    install = getattr(capturing, "maybe_install_capturing_hooks", None)
    if registry is None or install is None:
        return
    for module in model.modules():
        flags = None
        # keyed by the module (transformers >= 5.2x) or by str(its class) (5.17)
        for key in (module, str(type(module))):
            try:
                flags = registry.get(key)
            except TypeError:
                flags = None
            if flags:
                break
        config = getattr(module, "config", None)
        if flags and config is not None and any(getattr(config, f"output_{k}", False)
                                                for k in flags):
            install(module)
