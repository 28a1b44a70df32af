"""What a capture is told and what it hands back: :class:`Plan` (down) and :class:`Compiled` (up).

A front end (:func:`treefx.compile`, :func:`treefx.step`, :func:`treefx.backward`) builds one
frozen :class:`Plan` and gives it to its engine; the engine hands it to the compiler with the
captured graph, and the lowerings read from it everything that is not in the graph itself
(backend, FlexAttention's block size and kernel options, head interleaving, and for a part of a
tree the parameters whose ``.grad`` it may add into and whether the capture only finds the
part's context layout). Each capture hands back one :class:`Compiled`: the rewritten graphs and
their rewrite log, and for a part the layout and routing the compiler found. Nothing else
travels between the layers: no attribute of an engine or a graph context is set from another
module.

This module holds data only (its one treefx import is :mod:`treefx.options`, data too): the
compiler below the engine reads it, the engine and the front ends above build it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from .options import Options

__all__ = ["Compiled", "PartFindings", "PartLayout", "Plan"]


@dataclass(frozen=True)
class PartLayout:
    """The context buffers of a part's graph (:mod:`treefx.run.backward`): the width and dtype of
    the per-token columns (every attention site's keys and values, every conv's inputs, side by
    side) and of the per-state columns (every recurrence's state)."""

    tok_width: int
    tok_dtype: torch.dtype
    state_width: int
    state_dtype: torch.dtype

    @classmethod
    def empty(cls, dtype: torch.dtype) -> PartLayout:
        return cls(0, dtype, 0, dtype)

    def describe(self) -> str:
        return (f"{self.tok_width} columns per token ({self.tok_dtype}) and {self.state_width} "
                f"per state ({self.state_dtype})")


@dataclass(frozen=True)
class Plan:
    """Everything a capture needs to know that the captured graph does not say.

    ``backend``: as the user asked ("auto", "eager", "inductor", ...; resolved per device by
    the engine). ``block_size``, ``kernel_options``, ``interleave_heads``: FlexAttention's.
    ``regional``: one compiled graph per repeated block (True), the whole graph (False), or as
    the model's wrapping and the backend say (None: regional under FSDP2 or DDP, and for a
    compiled model through Inductor). ``mode``: "tree" (a compiled model on a whole batch),
    "step" (a ``@treefx.step`` function), "part" / "part-step" (a part of a tree, run by
    :func:`treefx.backward`). For parts: ``grad_params``, the parameters whose ``.grad`` the
    part's graph is given (in the order of its ``grads`` input) and may add its gradients into
    directly; ``find_layout``: the capture only finds the context layout and gradient routing
    (:class:`Compiled`'s ``part``), its buffers' widths are not yet the right ones, and it is
    never run; ``route_embedding``: the input embedding's gradient may go to the part's
    ``emb_sink`` rows, which the driver adds into ``.grad`` (off for a sharded model, whose
    ``.grad`` is a shard: autograd then accumulates it as the wrapper expects).
    ``options``: the ``TREEFX_*`` switches (:class:`treefx.options.Options`), read once when
    the front end is built (the environment then, when a plan is made without them), with
    the front end's own arguments over them (``verify=``).
    """

    backend: str = "auto"
    block_size: int = 128
    kernel_options: Any = field(default_factory=lambda: MappingProxyType({}))
    interleave_heads: bool | None = None
    regional: bool | None = None
    mode: str = "tree"
    grad_params: tuple = ()
    find_layout: bool = False
    route_embedding: bool = True
    options: Options = field(default_factory=Options.from_env)

    def __post_init__(self):
        if self.mode not in ("tree", "step", "part", "part-step"):
            raise ValueError(f"Plan.mode must be tree, step, part or part-step, got {self.mode!r}")
        # a dict (or None) frozen; anything else kept for the engine's check to refuse
        if self.kernel_options is None or isinstance(self.kernel_options, dict):
            object.__setattr__(self, "kernel_options",
                               MappingProxyType(dict(self.kernel_options or {})))

    @property
    def is_part(self) -> bool:
        return self.mode.startswith("part")

    @property
    def duck_shape(self) -> bool:
        """One symbol for equal sizes at capture: on for whole batches; off for a part, whose
        sizes (tokens, context, labels, states) are unrelated and often equal at first."""
        return not self.is_part


@dataclass(frozen=True)
class PartFindings:
    """What the compiler found in a part's graph: the context ``layout`` its sites need,
    ``grads_used`` (the positions among :attr:`Plan.grad_params` whose ``.grad`` it adds
    into), and ``embedding``: the input embedding (parameter, padding_idx or -1) whose rows
    the part's ``emb_sink`` collects, or None."""

    layout: PartLayout
    grads_used: tuple[int, ...]
    embedding: tuple[Any, int] | None = None


@dataclass
class Compiled:
    """What one capture hands back: ``context``, the rewritten root graph with its bodies and
    its rewrite log (a :class:`treefx.compiler.GraphContext`); ``backend``, the backend that
    compiled it; ``part``, for a part's graph what the compiler found (:class:`PartFindings`);
    ``fn``, the compiled callable (None for a capture that only finds a part's layout)."""

    context: Any
    backend: str
    part: PartFindings | None = None
    fn: Callable | None = None
