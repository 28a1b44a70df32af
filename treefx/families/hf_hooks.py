"""Hugging Face's output-capturing hooks (router logits, hidden states, attentions, ...).

Hugging Face installs them lazily, on the first forward that asks for such an output, under a
threading lock that Dynamo cannot trace. :func:`install_output_hooks` installs them before the
capture, for the modules whose config asks for a captured output (a Mixtral-style model with
``output_router_logits=True``), as that forward would; the engine calls it once per model.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["install_output_hooks"]


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
