"""treefx's options: every ``TREEFX_*`` environment switch, read in one place, into one frozen
:class:`Options`.

:func:`treefx.compile` and :func:`treefx.step` read the environment once
(:meth:`Options.from_env`), with the call's own arguments over it where they overlap
(``verify=``), and the :class:`treefx.plan.Plan` of each capture carries the result: the
compiler, the ops and the families take what they need from it (a graph context's
:attr:`~treefx.compiler.GraphContext.options`) or as arguments. A helper called on its own, with
no options given (a test, a benchmark), reads the environment then, the same way.

On/off switches are read one way: the value stripped and lower-cased, ``0``/``off``/``false``/
``no`` turn a switch off, ``1``/``on``/``true``/``yes`` turn it on, anything else (or unset)
leaves the default; the switches marked *strict* refuse other values.

=================================  =========  ==============================================
switch                             default    what it does
=================================  =========  ==============================================
``TREEFX_VERIFY``                  1          the compiled model's first-call check when
                                              ``verify=`` is not given (strict: 0/1)
``TREEFX_SHARE_TWINS``             1          a reference model of the policy's architecture
                                              runs the policy's graph without gradients
                                              (0: its own)
``TREEFX_SHARE_NO_GRAD``           1          a training model's no-grad calls run its
                                              training graph (0: a no-grad graph of their own)
``TREEFX_PART_LOSS_GRAD_LATE``     0          1: a part graph's own loss makes the output
                                              weight's gradient in the backward (one more
                                              product; held parts keep no such buffer)
``TREEFX_TRUNK_ATTENTION``         auto       a site's leading chain on cuDNN's kernels (auto:
                                              on CUDA, bf16/fp16, heads up to 128; 1: anywhere,
                                              0: never)
``TREEFX_CUDNN_ATTENTION``         auto       whole-tree sites on cuDNN's interval op (auto:
                                              where cuDNN has kernels; 1: anywhere; 0: never)
``TREEFX_CUDNN_WARMUP``            1          cuDNN's kernels compiled in second processes
``TREEFX_CUDNN_WARMUP_PROCESSES``  2          1: one process compiles all of them (strict)
``TREEFX_KEEP_RECURRENCE_GRAPH``   1          the recurrence's forward graph kept for the
                                              backward (0: recomputed; strict: 0/1)
``TREEFX_INDUCTOR_ON_CPU``         0          1: the inductor backend runs on the CPU (tests)
``TREEFX_WIDE_INDEXING``           1          64-bit indexing near 2**31 (0: Inductor's own)
``TREEFX_MIX_ORDER_REDUCTION``     0          1: Inductor's mix-order reductions
``TREEFX_AUTOTUNE_POINTWISE``      0          1: Inductor autotunes pointwise kernels
``TREEFX_DEFER_KERNEL_WAITS``      1          Triton compiles waited for once per capture
``TREEFX_FLA``                     auto       fla's kernels where known good (0: off)
``TREEFX_FLA_TREE``                1          fla's tree path (0: fla depth by depth)
``TREEFX_FLA_TREE_KEEP_STATES``    0          1: the chunk states kept for the backward
``TREEFX_FLA_TREE_STATE``          1          the one-launch state pass (0: per depth)
``TREEFX_FLA_TREE_STATE_CONFIG``   32,4,2     the state pass's BV,warps,stages
``TREEFX_FLA_L2NORM``              1          treefx's fixed-key L2-norm (0: fla's wrapper)
=================================  =========  ==============================================

docs/debugging.md ("Environment switches") holds the same table with more words; a test
(tests/test_structure.py) checks that it lists exactly the switches :class:`Options` reads,
and that no other module of treefx names a ``TREEFX_`` variable.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

__all__ = ["Options", "current", "switched_off", "switched_on"]

_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


def _value(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def switched_off(name: str) -> bool:
    """Whether the environment turns ``name`` off (a switch that is on unless turned off)."""
    return _value(name) in _OFF


def switched_on(name: str) -> bool:
    """Whether the environment turns ``name`` on (a switch that is off unless turned on)."""
    return _value(name) in _ON


def _tri(name: str) -> bool | None:
    """False (turned off), True (turned on) or None (unset or anything else: automatic)."""
    return False if switched_off(name) else True if switched_on(name) else None


def _verify() -> bool:
    value = os.environ.get("TREEFX_VERIFY", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"TREEFX_VERIFY must be 0 or 1, got {value!r}")
    return value in ("1", "true", "yes", "on")


def _keep_recurrence_graph() -> bool:
    value = os.environ.get("TREEFX_KEEP_RECURRENCE_GRAPH", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"TREEFX_KEEP_RECURRENCE_GRAPH must be 0 or 1, got {value!r}")
    return value == "1"


def _warmup_processes() -> int:
    name = "TREEFX_CUDNN_WARMUP_PROCESSES"
    value = os.environ.get(name, "").strip()
    if value not in ("", "1", "2"):
        raise ValueError(f"{name}={value!r}: 1 (one process compiles all of cuDNN's "
                         "kernels) or 2 (the forward's and the backward's apart, the default)")
    return 1 if value == "1" else 2


def _autotune_pointwise() -> bool:
    value = os.environ.get("TREEFX_AUTOTUNE_POINTWISE", "0").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _state_config() -> tuple[int, int, int]:
    name = "TREEFX_FLA_TREE_STATE_CONFIG"
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 32, 4, 2
    try:
        bv, warps, stages = (int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected 'BV,warps,stages', e.g. '32,4,2'") \
            from None
    if bv < 16 or bv & (bv - 1) or warps not in (1, 2, 4, 8) or stages < 1:
        raise ValueError(f"{name}={raw!r}: BV a power of two >= 16, warps 1, 2, 4 or 8, "
                         "stages >= 1")
    return bv, warps, stages


def _switch(env: str, default, read, doc: str):
    """A field of :class:`Options`: its environment variable, how it is read (``None``: an
    on/off switch, on unless turned off where its default is True, off unless turned on where
    False), what it does."""
    if read is None:
        read = ((lambda: not switched_off(env)) if default is True
                else (lambda: switched_on(env)))
    return field(default=default, metadata={"env": env, "read": read, "doc": doc})


@dataclass(frozen=True)
class Options:
    """Every ``TREEFX_*`` switch, read once (:meth:`from_env`); the module's docstring has the
    table. ``Options()`` holds the defaults, as with none of the variables set."""

    verify: bool = _switch("TREEFX_VERIFY", True, _verify,
                           "first-call check when verify= is not given")
    share_twins: bool = _switch("TREEFX_SHARE_TWINS", True,
                                None,
                                "a reference model runs its policy's graph without gradients")
    share_no_grad: bool = _switch("TREEFX_SHARE_NO_GRAD", True,
                                  None,
                                  "a training model's no-grad calls run its training graph")
    part_loss_grad_late: bool = _switch("TREEFX_PART_LOSS_GRAD_LATE", False,
                                        None,
                                        "a part's own loss: the weight's gradient in backward")
    trunk_attention: bool | None = _switch("TREEFX_TRUNK_ATTENTION", None,
                                           lambda: _tri("TREEFX_TRUNK_ATTENTION"),
                                           "leading chains on cuDNN's kernels (None: auto)")
    cudnn_attention: bool | None = _switch("TREEFX_CUDNN_ATTENTION", None,
                                           lambda: _tri("TREEFX_CUDNN_ATTENTION"),
                                           "whole-tree sites on the interval op (None: auto)")
    cudnn_warmup: bool = _switch("TREEFX_CUDNN_WARMUP", True,
                                 None,
                                 "cuDNN's kernels compiled in second processes")
    cudnn_warmup_processes: int = _switch("TREEFX_CUDNN_WARMUP_PROCESSES", 2, _warmup_processes,
                                          "how many second processes (1 or 2)")
    keep_recurrence_graph: bool = _switch("TREEFX_KEEP_RECURRENCE_GRAPH", True,
                                          _keep_recurrence_graph,
                                          "the recurrence's forward graph kept for backward")
    inductor_on_cpu: bool = _switch("TREEFX_INDUCTOR_ON_CPU", False,
                                    None,
                                    "the inductor backend allowed on the CPU")
    wide_indexing: bool = _switch("TREEFX_WIDE_INDEXING", True,
                                  None,
                                  "64-bit indexing near 2**31")
    mix_order_reduction: bool = _switch("TREEFX_MIX_ORDER_REDUCTION", False,
                                        None,
                                        "Inductor's mix-order reductions")
    autotune_pointwise: bool = _switch("TREEFX_AUTOTUNE_POINTWISE", False, _autotune_pointwise,
                                       "Inductor autotunes pointwise kernels")
    defer_kernel_waits: bool = _switch("TREEFX_DEFER_KERNEL_WAITS", True,
                                       None,
                                       "Triton compiles waited for once per capture")
    fla: str = _switch("TREEFX_FLA", "", lambda: os.environ.get("TREEFX_FLA", ""),
                       "fla's kernels: the raw setting, judged by families.fla.decide")
    fla_tree: bool = _switch("TREEFX_FLA_TREE", True,
                             None,
                             "fla's tree path (off: depth by depth)")
    fla_tree_keep_states: bool = _switch("TREEFX_FLA_TREE_KEEP_STATES", False,
                                         None,
                                         "the chunk states kept for the backward")
    fla_tree_state: bool = _switch("TREEFX_FLA_TREE_STATE", True,
                                   None,
                                   "the one-launch state pass")
    fla_tree_state_config: tuple = _switch("TREEFX_FLA_TREE_STATE_CONFIG", (32, 4, 2),
                                           _state_config,
                                           "the state pass's (BV, warps, stages)")
    fla_l2norm: bool = _switch("TREEFX_FLA_L2NORM", True,
                               lambda: not switched_off("TREEFX_FLA_L2NORM"),
                               "treefx's fixed-key L2-norm kernels")

    @classmethod
    def from_env(cls, **given) -> Options:
        """The options as the environment sets them now, every switch read once; ``given``
        (field names; a value of None is not given) overrides the environment: the explicit
        arguments of the call that builds them (``verify=``)."""
        values = {}
        for f in dataclasses.fields(cls):
            if given.get(f.name) is not None:
                values[f.name] = given[f.name]
            else:
                values[f.name] = f.metadata["read"]()
        return cls(**values)

    @classmethod
    def switches(cls) -> dict[str, str]:
        """Every environment variable :class:`Options` reads, and the field it sets."""
        return {f.metadata["env"]: f.name for f in dataclasses.fields(cls)}

    @classmethod
    def env_name(cls, name: str) -> str:
        """The environment variable of field ``name``."""
        return next(f.metadata["env"] for f in dataclasses.fields(cls) if f.name == name)

    def replace(self, **changes) -> Options:
        """A copy with ``changes`` (field names)."""
        return dataclasses.replace(self, **changes)


def current(options: Options | None = None) -> Options:
    """``options``, or when none is given (a helper called on its own: a test, a benchmark)
    the environment's now."""
    return options if options is not None else Options.from_env()
