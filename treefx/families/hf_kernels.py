"""Hugging Face's kernel wrappers: the torch function beneath them, and the model's calls steered
to it while treefx captures or the oracle runs.

Hugging Face wraps the kernels of its hybrid layers (Gated DeltaNet, Mamba's scans, the causal
conv1d, ...) in ``transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback``.
The wrapper calls a kernel from the Hub when one is asked for, else the original package (fla,
mamba_ssm, causal_conv1d) when it is installed and runs on the inputs' device, else the torch
code. Up to transformers 5.24 the wrapper is a function (``functools.wraps`` of the torch code);
from 5.25, with the ``kernels`` package installed, it is a small ``nn.Module`` (``Func``) whose
call is ``(*args, **kwargs)`` and whose forward calls that function.

A packed kernel of such a package, run over the tree's depth-first row, would carry state from
one branch into the next. So treefx reads the torch function beneath every wrapper
(:func:`torch_function`), and while it captures a model, or the oracle runs it, the model's
modules call that function (:func:`torch_kernel_paths`): the tree routes what it can read and
refuses what it cannot, and the oracle runs Hugging Face's reference code. Outside those, the
model's own calls go through the wrappers as before.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import sys
import weakref
from collections.abc import Callable

import torch

from .._version import TESTED_TRANSFORMERS
from ..reference import register_oracle_attention

log = logging.getLogger("treefx")

__all__ = ["check_release", "describe", "is_kernel_wrapper", "steer_by_name", "torch_function",
           "torch_kernel_paths", "transformers_version"]


def transformers_version() -> str:
    """The installed transformers' version, for messages ("not installed" if it is not)."""
    mod = sys.modules.get("transformers")
    if mod is None:
        try:
            import transformers as mod
        except ImportError:
            return "not installed"
    return getattr(mod, "__version__", "unknown")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def check_release() -> bool:
    """Whether the installed transformers is one treefx was run against
    (:data:`treefx._version.TESTED_TRANSFORMERS`); warns once where it is not (``pip install
    "treefx[hf]"`` installs one that is). Such a release still runs: a model family treefx
    cannot read is refused, and the first-call check compares the rest with the oracle."""
    version = transformers_version()
    low, high = TESTED_TRANSFORMERS
    try:
        inside = _release(low) <= _release(version) <= _release(high)
    except ValueError:
        inside = False
    if not inside:
        log.warning("treefx was run with transformers %s to %s; %s is installed. A model "
                    "family treefx cannot read under it is refused; the first-call check "
                    "compares the rest with each sequence run alone. pip install "
                    "\"treefx[hf]\" installs a release it was run with.", low, high, version)
    return inside


def _is_func_module(obj) -> bool:
    """A function turned into a module by the ``kernels`` package
    (``use_kernel_forward_from_hub`` on a function): an ``nn.Module`` whose class carries the
    layer name kernels look it up by."""
    return isinstance(obj, torch.nn.Module) and hasattr(type(obj), "kernel_layer_name")


def _is_fallback_function(obj) -> bool:
    """Hugging Face's hub-kernel fallback as a function (``functools.wraps`` of the torch code)."""
    code = getattr(obj, "__code__", None)
    return (inspect.isfunction(obj) and hasattr(obj, "__wrapped__") and code is not None
            and code.co_filename.replace("\\", "/").endswith("integrations/hub_kernels.py"))


def is_kernel_wrapper(obj) -> bool:
    """Whether ``obj`` is one of Hugging Face's kernel wrappers (which may call another
    package's kernel instead of the torch code)."""
    return _is_func_module(obj) or _is_fallback_function(obj)


def _func_of_module(obj) -> Callable | None:
    """The function a ``kernels`` ``Func`` module calls: its forward's closure holds it."""
    forward = type(obj).__dict__.get("forward")
    code = getattr(forward, "__code__", None)
    if code is None or forward.__closure__ is None or "func" not in code.co_freevars:
        return None
    try:
        return forward.__closure__[code.co_freevars.index("func")].cell_contents
    except ValueError:  # an empty cell
        return None


def torch_function(obj) -> Callable | None:
    """The plain function beneath Hugging Face's kernel wrappers (``obj`` itself for a plain
    function), or None where ``obj`` is a callable treefx cannot see into."""
    for _ in range(16):  # wrappers of wrappers, a few deep at most
        if _is_func_module(obj):
            obj = _func_of_module(obj)
        elif inspect.isfunction(obj):
            inner = getattr(obj, "__wrapped__", None)
            if inner is None:
                return obj
            obj = inner
        else:
            return None
    return None


def describe(obj) -> str:
    """What ``obj`` is, for an error: its type, and the parameters a call of it takes."""
    kind = "function" if inspect.isfunction(obj) else f"{type(obj).__name__} object"
    name = getattr(obj, "__name__", None)
    try:
        params = str(inspect.signature(obj))
    except (TypeError, ValueError):
        params = "(unknown parameters)"
    article = "an" if kind[0].lower() in "aeiou" else "a"
    return f"{article} {kind}{f' {name!r}' if name else ''} called as {params}"


# Kernel names whose wrapper is steered to the torch function beneath it whatever wrapped it
# (a family's kernels: :func:`steer_by_name`).
_BY_NAME: set[str] = set()


def steer_by_name(*names: str) -> None:
    """Steer the kernels called ``names`` in a model's modules to the torch function beneath
    any wrapper (``functools.wraps``), not only Hugging Face's (:func:`torch_kernel_paths`)."""
    _BY_NAME.update(names)


# model -> its modeling modules
_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _wrappers(model: torch.nn.Module) -> list[tuple]:
    """(module, attribute, wrapper, torch function) for the wrappers ``model``'s modeling
    modules hold now (read on every call: a module's attributes may change between calls)."""
    if model not in _MODULES:
        _MODULES[model] = sorted({type(m).__module__ for m in model.modules()})
    found = []
    for name in _MODULES[model]:
        mod = sys.modules.get(name)
        for attr, value in list(vars(mod).items()) if mod is not None else ():
            if is_kernel_wrapper(value) or (attr in _BY_NAME and callable(value)):
                fn = torch_function(value)
                if fn is not None and fn is not value:
                    found.append((mod, attr, value, fn))
    return found


# Kernels a layer binds in its ``__init__`` (Hugging Face's hybrid layers up to transformers
# 5.14: ``self.chunk_gated_delta_rule = chunk_gated_delta_rule or torch_chunk_gated_delta_rule``,
# fla's kernel when fla is installed, and ``self.causal_conv1d_fn``, the causal_conv1d
# package's): the attribute -> the torch function its modeling module defines, or None where
# the layer's own code path is the torch one (its ``nn.Conv1d``).
_LAYER_KERNELS = {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
                  "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
                  "causal_conv1d_update": "torch_causal_conv1d_update",
                  "causal_conv1d_fn": None}
# model -> its layers that bind one of them
_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layer_kernels(model: torch.nn.Module) -> list[tuple]:
    """(layer, attribute, torch function or None) for the kernels ``model``'s layers bind."""
    if model not in _LAYERS:
        found = []
        for layer in model.modules():
            mod = sys.modules.get(type(layer).__module__)
            if mod is None or not type(layer).__module__.startswith("transformers."):
                continue
            for attr, torch_name in _LAYER_KERNELS.items():
                if attr in vars(layer):
                    fn = getattr(mod, torch_name, None) if torch_name else None
                    if torch_name is None or fn is not None:
                        found.append((layer, attr, torch_function(fn) if fn else None))
        _LAYERS[model] = found
    return _LAYERS[model]


@contextlib.contextmanager
def torch_kernel_paths(model: torch.nn.Module | None):
    """Within this block, every Hugging Face kernel wrapper that ``model``'s modeling modules
    hold is their torch function, and so is every kernel its layers bind (a package's kernel
    bound in ``__init__``: fla's, causal_conv1d's); restored after (one replaced meanwhile, by
    treefx's recurrence markers say, is left as it was found)."""
    swapped = []
    try:
        for mod, attr, wrapper, fn in _wrappers(model) if model is not None else ():
            if vars(mod).get(attr) is wrapper:
                setattr(mod, attr, fn)
                swapped.append((mod, attr, wrapper, fn))
        for layer, attr, fn in _layer_kernels(model) if model is not None else ():
            held = vars(layer).get(attr)
            if held is not fn:
                setattr(layer, attr, fn)
                swapped.append((layer, attr, held, fn))
        yield
    finally:
        for owner, attr, wrapper, fn in reversed(swapped):
            if vars(owner).get(attr) is fn:
                setattr(owner, attr, wrapper)


# The oracle runs Hugging Face's reference code beneath the wrappers: it then shares no kernel
# with the tree (which runs fla where treefx's checks allow it, so a kernel's error cannot hide
# on both sides), never takes fla's gradients from an fla and GPU combination known to give
# wrong ones, and autotunes no kernels of its own in the first-call check.
register_oracle_attention(torch_kernel_paths)
