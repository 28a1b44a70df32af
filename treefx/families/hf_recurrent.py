"""Hugging Face's recurrent kernels: the torch code of Gated DeltaNet, Kimi Delta Attention,
Mamba2's chunked scan and Mamba's selective scan, registered as recurrences
(:mod:`treefx.compiler.recurrences`): by name wherever a model defines them (a kernel family),
and lazily, once transformers is imported, in the modeling modules known today.

Hugging Face wraps these kernels (:mod:`.hf_kernels`); treefx reads the torch function beneath
the wrapper, runs it over the tree (or fla's checked kernels, :mod:`.fla`), and the oracle runs it
too. A kernel that cannot be read under the installed transformers (another signature, a
wrapper treefx cannot see into) is left unregistered and the models that use it are refused at
compile time in one line that names the family, the release and what was found; every other
model is untouched."""

from __future__ import annotations

import functools
import importlib
import sys

from ..compiler.recurrences import (
    LayerFamily,
    Recurrence,
    UnsupportedLayerError,
    add_builtins,
    register_if_compatible,
    register_kernel_family,
    register_layer_family,
)
from ..ops.selective_scan import selective_scan
from . import fla, fla_tree
from .hf_kernels import (check_release, describe, steer_by_name, torch_function,
                         transformers_version)

__all__ = ["FAMILIES", "MODELS", "register_builtins"]


def _import(path: str):
    """The module, or None where this transformers has none (or it fails to import: then no
    model of it can be built either)."""
    try:
        return importlib.import_module(path)
    except Exception:  # noqa: BLE001 - a module that cannot be imported has no models to refuse
        return None


class UnreadableKernel(ValueError):
    """A kernel whose torch function treefx cannot see beneath its wrapper."""


def _torch_code(fn):
    """The torch function beneath Hugging Face's wrapper of ``fn`` (:func:`.hf_kernels.
    torch_function`); raises :class:`UnreadableKernel` where there is none to read."""
    torch_fn = torch_function(fn)
    if torch_fn is None:
        raise UnreadableKernel("its torch function cannot be read beneath it")
    return torch_fn


def _delta_rule(name: str, fn, kernel: str) -> Recurrence:
    """A delta-rule kernel in Gated DeltaNet's signature: ``(query, key, value, g, beta, ...,
    initial_state, output_final_state)``, each [B, N, ...]. ``g`` is a log decay (0: keep the
    state), ``beta`` the update rate (0: no update), so zeros pad a node neutrally.

    On the GPU the tree runs fla's chunked kernel ``kernel`` where :mod:`.fla` says its
    gradients are right (:func:`.fla.use_fla`, which announces a fallback), else the torch
    kernel. Hugging Face wraps its torch kernels so that they call fla's themselves when fla
    is installed, with no such check (and, in transformers 5.24, with fewer key than value
    heads, which fla 0.4 does not take): the tree runs the torch function beneath the wrapper
    (:func:`.hf_kernels.torch_function`); the model's own calls are left as they are."""
    return Recurrence(
        name=name,
        fn=_torch_code(fn),
        seq_args={"query": 1, "key": 1, "value": 1, "g": 1, "beta": 1},
        output_like="value",
        neutral={"g": 0.0, "beta": 0.0},
        varlen=getattr(fla, kernel),
        varlen_check=functools.partial(fla.use_fla, kernel),
        varlen_split=fla.split_calls,
        tree_varlen=fla_tree.tree_gated_delta_rule if kernel == "gated_delta_rule" else None,
    )


def _gated_delta_rule(owner: str, fn) -> Recurrence:
    """Hugging Face's torch Gated DeltaNet kernel (``torch_chunk_gated_delta_rule``)."""
    return _delta_rule(f"{owner}_gated_delta_rule", fn, "gated_delta_rule")


def _kimi_delta_attention(owner: str, fn) -> Recurrence:
    """Hugging Face's torch Kimi Delta Attention kernel (``chunk_kimi_delta_attention``,
    Kimi-Linear and Bailing-hybrid): the gated delta rule with a decay per key channel
    (``g`` [B, N, H, K] instead of [B, N, H])."""
    return _delta_rule(f"{owner}_kimi_delta_attention", fn, "kimi_delta_attention")


def _mamba2_chunk_scan(owner: str, fn) -> Recurrence:
    """Hugging Face's torch Mamba2 chunked scan (``mamba2_chunk_scan``)."""
    return Recurrence(
        name=f"{owner}_mamba2_chunk_scan",
        fn=_torch_code(fn),
        seq_args={"hidden_states": 1, "dt": 1, "B": 1, "C": 1},
        # dt = -inf: softplus gives a step of 0, so the state neither decays nor takes input
        # (x·dt = 0, exp(A·dt) = 1); padded x is 0. A model that clamps dt from below makes
        # this padding non-neutral: measured per kernel (ops.recurrence.padding_is_neutral).
        neutral={"dt": float("-inf")},
        initial_state="initial_states",
        output_final_state="return_final_states",
        bare_output_without_state=True,
    )


def _mamba_selective_scan(owner: str, fn) -> Recurrence:
    """Hugging Face's torch Mamba (v1) selective scan (``mamba_selective_scan``, after
    mamba_ssm's ``selective_scan_fn``). It has no initial state, so the tree runs treefx's own
    selective scan (:func:`treefx.ops.selective_scan.selective_scan`) with the same arguments."""
    return Recurrence(
        name=f"{owner}_mamba_selective_scan",
        fn=_torch_code(fn),
        seq_args={"hidden_states": 2, "dt": 2, "B": 2, "C": 2, "z": 2},
        output_seq_dim=2,
        output_like="hidden_states",
        # dt = -inf: after the bias and softplus a step of 0 (exp(A·0) = 1, no input), as for
        # Mamba2. Without delta_softplus it is not neutral: measured (padding_is_neutral).
        neutral={"dt": float("-inf")},
        initial_state="initial_state",
        output_final_state="return_last_state",
        bare_output_without_state=True,
        tree_fn=selective_scan,
    )


# The kernel families treefx recognises by name wherever a model defines them.
FAMILIES = {"torch_chunk_gated_delta_rule": _gated_delta_rule,
            "chunk_kimi_delta_attention": _kimi_delta_attention,
            "mamba2_chunk_scan": _mamba2_chunk_scan,
            "mamba_selective_scan": _mamba_selective_scan}
# What each is, for a refusal.
NAMES = {"torch_chunk_gated_delta_rule": "Gated DeltaNet's chunked kernel",
         "chunk_kimi_delta_attention": "Kimi Delta Attention's chunked kernel",
         "mamba2_chunk_scan": "Mamba2's chunked scan",
         "mamba_selective_scan": "Mamba's selective scan"}
# The Hugging Face models whose modeling modules define one of them today.
MODELS = ("qwen3_next", "qwen3_5", "mamba2", "bamba", "falcon_h1", "granitemoehybrid",
          "nemotron_h", "zamba2", "mamba", "falcon_mamba", "jamba", "zamba")


def refusal(attr: str, module: str, fn, error: Exception) -> str:
    """Why the kernel ``attr`` of ``module`` cannot be registered, in one line: the family, the
    transformers release, what was found."""
    why = str(error).split("\n")[0]
    return (f"it cannot read {NAMES.get(attr, attr)} under transformers "
            f"{transformers_version()}: {module}.{attr} is {describe(fn)}, and {why} "
            "(models that do not use it are unaffected)")


def register_builtins() -> None:
    """The torch kernels of Hugging Face's hybrid layers known today (others are recognised
    when a model is compiled: :func:`treefx.compiler.recurrences.discover`). A module that is
    missing is skipped; a kernel that cannot be read is refused for the models that use it."""
    check_release()
    for model in MODELS:
        path = f"transformers.models.{model}.modeling_{model}"
        mod = _import(path)
        for attr, make in FAMILIES.items():
            fn = getattr(mod, attr, None)
            if fn is not None:
                register_if_compatible(functools.partial(make, model, fn), sites=[(path, attr)],
                                       explain=functools.partial(refusal, attr, path, fn))


for _attr, _make in FAMILIES.items():
    register_kernel_family(_attr, _make, explain=functools.partial(refusal, _attr))
add_builtins(register_builtins)

# The kernels the oracle runs beneath whatever wraps them (besides Hugging Face's wrappers of
# any kernel, :func:`.hf_kernels.torch_kernel_paths`).
steer_by_name(*FAMILIES, "torch_recurrent_gated_delta_rule")


def _inline_scan(kind: str, parts: tuple[str, ...], kernel: str) -> LayerFamily:
    """Hugging Face's ``kind`` layers of a transformers before 5.15, which write their scan
    inline: a layer with ``parts`` whose modeling module defines no ``kernel`` for the tree to
    run. Refused (its check always raises), in one line naming the release."""

    def is_layer(m) -> bool:
        module = type(m).__module__
        return (module.startswith("transformers.") and all(hasattr(m, a) for a in parts)
                and not hasattr(sys.modules.get(module), kernel))

    def refuse(name: str, m) -> None:
        raise UnsupportedLayerError(
            f"treefx cannot run the {kind} at {name} ({type(m).__name__}) under transformers "
            f"{transformers_version()}: before 5.15 it writes its scan inline rather than "
            f"calling {kernel}, the kernel treefx runs over the tree; use transformers>=5.15 "
            "for this model")

    return LayerFamily(name=f"{kind} with an inline scan", is_layer=is_layer, check=refuse,
                       matches=lambda m: False, forward=None, recurrence=None)


# Mamba2 mixers (Mamba2, Bamba, Falcon-H1, GraniteMoeHybrid, NemotronH, Zamba2) and Mamba
# mixers (Mamba, Falcon-Mamba, Jamba, Zamba) before transformers 5.15.
register_layer_family(_inline_scan("Mamba2 mixer", ("torch_forward", "A_log", "chunk_size",
                                                    "ssm_state_size"), "mamba2_chunk_scan"))
register_layer_family(_inline_scan("Mamba mixer", ("x_proj", "dt_proj", "A_log",
                                                   "cuda_kernels_forward"),
                                   "mamba_selective_scan"))
