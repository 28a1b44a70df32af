"""Everything a capture runs under, in one place: :func:`capture_environment`.

A capture (and every later call of a captured graph: Dynamo's guards read the same state)
runs with Hugging Face's kernel wrappers steered to the torch code beneath them
(:func:`treefx.families.hf_kernels.torch_kernel_paths`: never another package's packed kernel
over the tree's row), the registered recurrent kernels swapped for their markers
(:func:`treefx.compiler.recurrences.capture_patches`), treefx's compile config
(:func:`treefx.run.backends.capture_config`), a Hugging Face flex-attention model on its eager
attention (:mod:`treefx.families.hf_flex`), Hugging Face's packed-sequence inference finding one
sequence per path (:mod:`treefx.families.hf_packing`), the model's configs without a cache for a
step (:func:`no_cache`), Hugging Face's input-gradient hooks of activation checkpointing left out
(:func:`treefx.families.hf_hooks.without_input_grad_hooks`), duck shaping off for a part of a
tree, and, for a regional capture,
the model's FSDP/DDP state made traceable (:func:`treefx.run.regional.capture_state`). Every
call runs with autocast's weight cache emptied and off (:func:`no_autocast_cache`). Before
its first capture a model is made ready once (:func:`prepare_model`). The engine
(:mod:`treefx.run.engine`) is the one caller.
"""

from __future__ import annotations

import contextlib

import torch

from ..compiler import TreeCompileError
from ..compiler.recurrences import UnsupportedLayerError, capture_patches, discover
from ..families.hf_flex import eager_attention
from ..families.hf_kernels import torch_kernel_paths
from ..families.hf_hooks import (install_output_hooks, traced_padding_masks,
                                 without_input_grad_hooks)
from ..families.hf_packing import one_sequence_per_path
from ..plan import Plan
from . import backends, regional

__all__ = ["capture_environment", "no_autocast_cache", "no_cache", "prepare_model"]


@contextlib.contextmanager
def capture_environment(model: torch.nn.Module | None, plan: Plan, *,
                        regional_capture: bool = False):
    """What a capture of ``model`` for ``plan`` runs under (see the module's docstring);
    ``regional_capture``: the capture a regional graph is built from."""
    with contextlib.ExitStack() as stack:
        if regional_capture:
            stack.enter_context(regional.capture_state(model))
            stack.enter_context(torch._dynamo.config.patch(optimize_ddp=False))
        if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            # a checkpointed layer that writes a Python container (Gemma 3n / Gemma 4 store
            # their shared keys and values in a dict for later layers) is captured, its
            # write done in the forward and not again when the backward recomputes the layer
            # (else a graph break, which treefx refuses); what later layers read is the
            # forward's tensors. Exact against the oracle in the zoo with checkpointing
            # (docs/zoo.md); the first-call check compares every such model's gradients.
            stack.enter_context(torch._dynamo.config.patch(
                skip_fwd_side_effects_in_bwd_under_checkpoint=True))
        stack.enter_context(torch_kernel_paths(model))
        stack.enter_context(capture_patches(model))
        stack.enter_context(traced_padding_masks(model))
        stack.enter_context(without_input_grad_hooks(model))
        stack.enter_context(backends.capture_config())
        stack.enter_context(eager_attention(model))
        stack.enter_context(one_sequence_per_path())
        if not plan.duck_shape:
            # a part's sizes (tokens, context, labels, states) are unrelated and often equal
            # on the first call: one symbol for equal sizes would tie them
            import torch.fx.experimental._config as fx_config

            stack.enter_context(fx_config.patch(use_duck_shape=False))
        yield


@contextlib.contextmanager
def no_autocast_cache():
    """Autocast's cache of low-precision weight copies emptied and off while a tree graph runs
    (the flag restored after; no effect outside autocast).

    Within one autocast region, autocast casts a float32 weight to bfloat16 once and reuses the
    copy. A checkpointed layer of a captured graph (Hugging Face's gradient checkpointing, seen
    by Dynamo) is recomputed in the backward by replaying its forward's ops one by one, and
    refuses an op the forward did not run: "aten._to_copy.default ... encountered during
    backward but not found in storage". A weight the region had already cast before the tree
    call (the model run alone first in the same region: ``treefx.verify``'s first-call check,
    or a reference pass) was taken from the cache in the forward but is cast again in the
    recompute, which starts with an empty cache. So the cache is emptied before the call, and
    switched off during it (a model whose forward enters an autocast of its own, as
    accelerate's mixed precision wraps it, switches it on again inside: a weight's first use
    in the call is then a cast in the forward and in the recompute alike)."""
    torch.clear_autocast_cache()
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


@contextlib.contextmanager
def no_cache(model: torch.nn.Module | None):
    """The model's configs with ``use_cache=False`` while a tree step runs (restored after):
    a key/value or state cache of the DFS row means nothing on a tree, and filling one makes
    a model branch on the token count (Qwen3-Next pads a short row's conv state)."""
    changed, seen = [], set()
    for module in model.modules() if model is not None else ():
        cfg = getattr(module, "config", None)
        if cfg is not None and id(cfg) not in seen:
            seen.add(id(cfg))
            if getattr(cfg, "use_cache", None) is True:
                cfg.use_cache = False
                changed.append(cfg)
    try:
        yield
    finally:
        for cfg in changed:
            cfg.use_cache = True


def prepare_model(model: torch.nn.Module) -> None:
    """What a model needs before its first capture, done once per model (not per step): its
    recurrent kernels recognised (:func:`treefx.compiler.recurrences.discover`) and Hugging
    Face's output-capturing hooks installed
    (:func:`treefx.families.hf_hooks.install_output_hooks`)."""
    try:
        discover(model)
    except UnsupportedLayerError as e:
        raise TreeCompileError(str(e)) from None
    install_output_hooks(model)
