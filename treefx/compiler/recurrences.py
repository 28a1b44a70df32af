"""The registry of recurrent / chunked state kernels treefx routes through the tree
(what runs them over the tree is :mod:`treefx.ops.recurrence`).

A hybrid model's linear-attention or SSM layer calls a kernel that runs a recurrence over the
sequence (Gated DeltaNet's chunked delta rule, Mamba2's chunked scan, Mamba's selective scan).
Inlined into the graph such a kernel is hundreds of ops that nothing can recognise; on a DFS
row its state would run from one branch into the next sibling. So during capture treefx swaps
each registered kernel, where the model looks it up, for a *marker*: a function Dynamo keeps
as one graph node (``allow_in_graph``) that still computes the original kernel when run. The
SSM pass then finds the markers and rewrites each into a tree recurrence (every tree node is
one chunk whose initial state is its parent node's final state). A kernel without an
initial-state parameter (Hugging Face's Mamba selective scan) is run over the tree by a
``tree_fn`` that has one.

A :class:`Recurrence` says what the kernel's arguments mean. Register your own with
:func:`register_recurrence`. The kernels and layers of the model families treefx knows
(:mod:`treefx.families`) register themselves here: kernel families recognised by name
(:func:`register_kernel_family`), layers whose forward is replaced during capture
(:func:`register_layer_family`) and the built-in kernels, registered lazily
(:func:`add_builtins`). This module never imports a family.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ops.recurrence import Recurrence

__all__ = [
    "LayerFamily",
    "Recurrence",
    "UnsupportedLayerError",
    "add_builtins",
    "all_recurrences",
    "capture_patches",
    "discover",
    "lookup",
    "recurrence",
    "refuse_sites",
    "register_if_compatible",
    "register_kernel_family",
    "register_layer_family",
    "register_recurrence",
    "registered",
]

log = logging.getLogger("treefx")


_REGISTRY: dict[str, Recurrence] = {}
_SITES: list[tuple[str, str, str]] = []  # (module, attribute, recurrence name)
# Layer classes whose forward writes a recurrence inline (a Python block loop Dynamo would
# unroll): (class, its forward in treefx's form, which calls the recurrence's marker); see
# :class:`LayerFamily`.
_LAYER_SITES: list[tuple[type, object]] = []


def register_recurrence(rec: Recurrence, *, sites: list[tuple[str, str]] = ()) -> Recurrence:
    """Register a recurrent kernel.

    ``sites``: (module path, attribute) pairs where models look
    the kernel up, patched with the marker during capture (e.g. the module of your layer and
    the name it calls)."""
    rec.signature = inspect.signature(rec.fn)
    rec.output_like = rec.output_like or next(iter(rec.seq_args))
    if rec.output_like not in rec.seq_args:
        raise ValueError(f"recurrence {rec.name!r}: output_like={rec.output_like!r} is not one "
                         "of its seq_args")
    missing = [a for a in rec.seq_args if a not in rec.signature.parameters]
    if rec.tree_fn is None:
        missing += [a for a in (rec.initial_state, rec.output_final_state)
                    if a not in rec.signature.parameters]
    if missing:
        raise ValueError(f"recurrence {rec.name!r}: "
                         f"{getattr(rec.fn, '__name__', type(rec.fn).__name__)}{rec.signature} "
                         f"has no parameters {missing}")
    if rec.tree_fn is not None:
        # The tree runs tree_fn with fn's arguments (as the model binds them) and the state's.
        params = inspect.signature(rec.tree_fn).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        needed = [a for a in rec.signature.parameters
                  if rec.signature.parameters[a].kind not in (inspect.Parameter.VAR_KEYWORD,
                                                              inspect.Parameter.VAR_POSITIONAL)]
        unknown = [a for a in (*needed, rec.initial_state, rec.output_final_state)
                   if a not in params and not (takes_any and a in needed)]
        if unknown:
            raise ValueError(f"recurrence {rec.name!r}: its tree_fn "
                             f"{getattr(rec.tree_fn, '__name__', rec.tree_fn)} has no "
                             f"parameters {unknown}")
    original = rec.fn

    def marker(*args, **kwargs):
        if _fake_call(args, kwargs):
            # Dynamo runs the marker on fake tensors for the output's shape; Triton kernels
            # (fla's) cannot run on them. The rewritten graph never asks for a final state.
            bound = rec.bind(args, kwargs)
            if not bound.get(rec.output_final_state):
                like = bound[rec.output_like]
                out = like.new_empty(like.shape, dtype=_output_dtype(rec, bound))
                return out if rec.bare_output_without_state else (out, None)
        return original(*args, **kwargs)

    marker.__name__ = marker.__qualname__ = f"treefx_recurrence_{rec.name}"
    marker._treefx_recurrence = rec
    rec.marker = torch._dynamo.allow_in_graph(marker)
    _REGISTRY[rec.name] = rec
    _SITES.extend((mod, attr, rec.name) for mod, attr in sites)
    return rec


_OUTPUT_DTYPES: dict = {}  # (recurrence, argument dtypes) -> the output's dtype


def _output_dtype(rec: Recurrence, bound: dict) -> torch.dtype:
    """The dtype of the kernel's output for these arguments' dtypes. Hugging Face's torch
    kernels compute in float32 and some return it for bfloat16 inputs (Mamba2's chunked scan):
    a traced graph told otherwise would read the output with the wrong dtype. Measured once
    per dtype combination on two real CPU tokens (the kernel cannot run on the fake tensors
    of the trace); a kernel that cannot run there (a Triton kernel) is taken to return its
    ``output_like`` argument's dtype."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    like = bound[rec.output_like]
    key = (rec.name, tuple((k, v.dtype) for k, v in bound.items()
                           if isinstance(v, torch.Tensor)))
    if key not in _OUTPUT_DTYPES:
        dtype = like.dtype
        try:
            with unset_fake_temporarily(), torch.no_grad():
                small = {k: _tiny(v, rec.seq_args.get(k)) if isinstance(v, torch.Tensor) else v
                         for k, v in bound.items()}
                small[rec.output_final_state] = False
                out = rec.fn(**small)
                out = out if rec.bare_output_without_state else out[0]
                dtype = out.dtype
        except Exception as e:  # noqa: BLE001 - the argument's dtype is the usual answer
            log.info("recurrence %s: output dtype not measured (%s)", rec.name, e)
        _OUTPUT_DTYPES[key] = dtype
    return _OUTPUT_DTYPES[key]


def _tiny(t: torch.Tensor, seq_dim: int | None) -> torch.Tensor:
    """A real CPU tensor like ``t`` with two tokens along ``seq_dim`` and batch 1 (symbolic
    sizes take their example value)."""
    shape = []
    for d, s in enumerate(t.shape):
        if seq_dim is not None and d == seq_dim % t.dim():
            shape.append(2)
        elif d == 0 and seq_dim is not None:
            shape.append(1)
        else:
            shape.append(int(s.node.hint) if isinstance(s, torch.SymInt) else int(s))
    if t.is_floating_point():
        return torch.randn(shape, dtype=t.dtype) * 0.1
    return torch.zeros(shape, dtype=t.dtype)


def _fake_call(args, kwargs) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(a, torch.Tensor) and is_fake(a)
               for a in (*args, *kwargs.values()))


def recurrence(name: str) -> Recurrence:
    """The registered recurrence called ``name`` (built-in ones: ``qwen3_next_gated_delta_rule``,
    ``mamba2_mamba2_chunk_scan``, ...)."""
    _ensure_builtins(force=True)
    if name not in _REGISTRY:
        raise KeyError(f"no recurrence {name!r} is registered (registered: {sorted(_REGISTRY)})")
    return _REGISTRY[name]


def registered(target) -> Recurrence | None:
    """The recurrence whose marker ``target`` is, if any."""
    rec = getattr(target, "_treefx_recurrence", None)
    return rec if rec is not None and rec.marker is target else None


@contextlib.contextmanager
def capture_patches(model: torch.nn.Module | None = None):
    """Swap every registered kernel for its marker where models look it up: in the modules
    that define it and, in ``model``, on layers that hold it as an attribute (Hugging Face's
    Gated DeltaNet layers up to transformers 5.14 bind ``self.chunk_gated_delta_rule`` in
    their ``__init__``)."""
    _ensure_builtins()
    saved = []
    try:
        kernels = {id(r.fn): r for r in _REGISTRY.values()}
        for m, attr in _function_attributes(model) if model is not None else ():
            value = vars(m).get(attr)
            rec = kernels.get(id(value))
            if rec is not None and rec.fn is value:
                saved.append((m, attr, value))
                setattr(m, attr, rec.marker)
        for mod_name, attr, name in _SITES:
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, _REGISTRY[name].marker)
        for cls, forward in _LAYER_SITES:
            saved.append((cls, "forward", cls.__dict__["forward"]))
            cls.forward = forward
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


# model -> (layer, attribute) of the plain functions its layers hold as attributes, found once:
# capture_patches runs on every call of a compiled model.
_FUNCTION_ATTRIBUTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _function_attributes(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    if model not in _FUNCTION_ATTRIBUTES:
        _FUNCTION_ATTRIBUTES[model] = [(m, attr) for m in model.modules()
                                       for attr, value in vars(m).items()
                                       if inspect.isfunction(value)]
    return _FUNCTION_ATTRIBUTES[model]


def discover(model: torch.nn.Module) -> list[Recurrence]:
    """Register the kernels of the known families (:func:`register_kernel_family`) that the
    modules of ``model``'s code define or import, by name and signature, wherever they are: a
    model that copies Gated DeltaNet's or Mamba2's torch kernel into its own file (as Hugging
    Face does for every new hybrid) is recognised without treefx knowing the model. A function
    with the family's name but other parameters is left alone (its layer is then refused
    with an error naming the node). Then the layers of the known layer families
    (:func:`register_layer_family`). Returns the recurrences found."""
    _ensure_builtins()
    found = []
    modules = sorted({type(m).__module__ for m in model.modules()})
    sites = {(mod, attr) for mod, attr, _ in _SITES}
    # what the registered sites hold: the same object in another module is the same kernel
    at_sites = {}
    for mod_name, attr, name in _SITES:
        obj = getattr(sys.modules.get(mod_name), attr, None)
        if obj is not None and registered(obj) is None:
            at_sites.setdefault(id(obj), name)
    for mod_name in modules:
        mod = sys.modules.get(mod_name)
        for attr, make in _KERNEL_FAMILIES.items():
            fn = getattr(mod, attr, None)
            if not callable(fn) or registered(fn) is not None or (mod_name, attr) in _REFUSED:
                continue
            name = at_sites.get(id(fn))
            if name is not None:  # the same kernel, imported into another module
                if (mod_name, attr) not in sites:
                    _SITES.append((mod_name, attr, name))
                found.append(_REGISTRY[name])
                continue
            if (mod_name, attr) in sites:
                continue
            owner = mod_name.rsplit(".", 1)[-1].removeprefix("modeling_")
            explain = _EXPLAIN.get(attr)
            rec = register_if_compatible(
                lambda: make(owner, fn), [(mod_name, attr)],
                explain=None if explain is None else functools.partial(explain, mod_name, fn))
            if rec is not None:
                log.info("recognised %s.%s as recurrence %s", mod_name, attr, rec.name)
                found.append(rec)
    refused = [why for mod_name in modules for (m, _), why in _REFUSED.items() if m == mod_name]
    if refused:
        raise UnsupportedLayerError(f"treefx refuses {type(model).__name__}: {refused[0]}")
    for name, m in model.named_modules():
        cls = type(m)
        family = next((f for f in _LAYER_FAMILIES if f.is_layer(m)), None)
        if family is None:
            continue
        family.check(name, m)
        if any(c is cls for c, _ in _LAYER_SITES):
            continue
        if family.matches(m):
            _LAYER_SITES.append((cls, family.forward))
            log.info("recognised %s as %s", cls.__qualname__, family.name)
            found.append(family.recurrence())
        else:
            log.info("%s looks like %s but its forward differs from the recurrence; left "
                     "alone", cls.__qualname__, family.name)
    return found


class UnsupportedLayerError(ValueError):
    """A recognised layer that treefx cannot run as its recurrence (the engine reports it as a
    :class:`treefx.TreeCompileError`)."""


@dataclass
class LayerFamily:
    """Layers whose forward writes a recurrence inline (a Python block loop Dynamo would
    unroll), replaced during capture by ``forward``, which calls the recurrence's marker.

    ``is_layer(module)``: a layer of the family; ``check(name, module)``: raises
    :class:`UnsupportedLayerError` for one treefx cannot run; ``matches(module)``: whether the
    layer's own forward and ``forward`` agree (another version of the layer's code is left
    alone); ``recurrence()``: the registered recurrence ``forward`` runs."""

    name: str
    is_layer: Callable[[torch.nn.Module], bool]
    check: Callable[[str, torch.nn.Module], None]
    matches: Callable[[torch.nn.Module], bool]
    forward: Callable
    recurrence: Callable[[], Recurrence]


# Kernel families recognised by name wherever a model defines them: the function's name ->
# how to describe it (``make(owner, fn)``, owner: the model's module name).
_KERNEL_FAMILIES: dict[str, Callable[[str, Callable], Recurrence]] = {}
_LAYER_FAMILIES: list[LayerFamily] = []


# How each family explains a kernel it cannot register: (module, fn, error) -> one line.
_EXPLAIN: dict[str, Callable[[str, Callable, Exception], str]] = {}


def register_kernel_family(attr: str, make: Callable[[str, Callable], Recurrence],
                           explain: Callable[[str, Callable, Exception], str] | None = None
                           ) -> None:
    """Recognise a kernel by its name ``attr`` in any module of a model's code
    (:func:`discover`): ``make(owner, fn)`` describes it as a :class:`Recurrence`;
    ``explain(module, fn, error)``: why one cannot be registered, in one line (the refusal of
    the models that use it)."""
    _KERNEL_FAMILIES[attr] = make
    if explain is not None:
        _EXPLAIN[attr] = explain


def kernel_families() -> dict[str, Callable[[str, Callable], Recurrence]]:
    """The registered kernel families (name -> how to describe it), in registration order."""
    return dict(_KERNEL_FAMILIES)


def register_layer_family(family: LayerFamily) -> None:
    """Recognise the layers of ``family`` in a model (:func:`discover`)."""
    _LAYER_FAMILIES.append(family)


def lookup(name: str) -> Recurrence | None:
    """The recurrence registered as ``name``, or None (built-in ones are not loaded for it)."""
    return _REGISTRY.get(name)


def all_recurrences() -> dict[str, Recurrence]:
    """Every registered recurrence by name, the built-in ones loaded first."""
    _ensure_builtins(force=True)
    return dict(_REGISTRY)


# Kernels of a known family that could not be registered: (module, attribute) -> why, in one
# line. The models whose code holds one are refused (:func:`discover`); no other model is.
_REFUSED: dict[tuple[str, str], str] = {}


def refuse_sites(sites, why: str) -> None:
    """The kernels at ``sites`` ((module path, attribute) pairs) cannot be registered: a model
    whose modules include one of those modules is refused at compile time with ``why`` (one
    line), and every other model is untouched."""
    for site in sites:
        _REFUSED[tuple(site)] = why


def register_if_compatible(make: Callable[[], Recurrence], sites,
                           explain: Callable[[Exception], str] | None = None
                           ) -> Recurrence | None:
    """Register the kernel ``make()`` describes at ``sites``, for a known family. A kernel
    that cannot be described or registered (another transformers version: another signature, a
    wrapper treefx cannot see into) is not registered, and its sites are refused
    (:func:`refuse_sites`, with ``explain(error)`` as the reason): the models that use it fail
    to compile with that line, every other model is untouched. Never raises."""
    try:
        return register_recurrence(make(), sites=sites)
    except Exception as e:  # noqa: BLE001 - one family must not take down the others
        why = explain(e) if explain is not None else f"{type(e).__name__}: {e}"
        refuse_sites(sites, why)
        log.info("recurrence at %s not registered: %s", sites, why)
        return None


_BUILTINS: list[Callable[[], None]] = []
_BUILTINS_DONE = False


def add_builtins(register: Callable[[], None]) -> None:
    """``register()`` registers built-in kernels (of Hugging Face's modeling modules): run
    once, where the registry is first consulted after transformers was imported (capture,
    :func:`discover`, :func:`recurrence`), not at ``import treefx``."""
    _BUILTINS.append(register)
    if _BUILTINS_DONE:
        _run_builtin(register)


def _ensure_builtins(force: bool = False) -> None:
    """Register the built-in kernels once, where the registry is first consulted (capture,
    :func:`discover`, :func:`recurrence`), not at ``import treefx``: importing transformers'
    modeling modules takes seconds. Until something has imported transformers no model can
    call one of its kernels, so a capture then leaves them for a later one (``force``: import
    them now)."""
    global _BUILTINS_DONE
    if _BUILTINS_DONE or not (force or "transformers" in sys.modules):
        return
    _BUILTINS_DONE = True
    for register in _BUILTINS:
        _run_builtin(register)


def _run_builtin(register: Callable[[], None]) -> None:
    """One family's registration; its own failure must not stop the others (it refuses its own
    sites, :func:`register_if_compatible`: this is the last guard)."""
    try:
        register()
    except Exception as e:  # noqa: BLE001
        log.warning("treefx: built-in kernels of %s not registered: %s: %s",
                    getattr(register, "__module__", register), type(e).__name__, e)
