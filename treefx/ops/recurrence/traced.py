"""The tree recurrence as one opaque custom op, for graphs that AOTAutograd / Inductor trace.

Under AOTAutograd / Inductor the tree structure is data (it comes from parent_token), so the
per-depth loop (:func:`.reference.tree_recurrence`) cannot be traced. The recurrence then runs
as one opaque custom op: its fake implementation gives the output's shape, its backward
recomputes the forward under autograd (the kernels' own torch code) and differentiates it.
Each graph site's non-tensor arguments are registered under a key (:func:`register_site`),
which the op is called with; :mod:`.part` has the same for a part of a tree.
"""

from __future__ import annotations

import torch

from .reference import Recurrence, tree_recurrence

__all__ = ["TracedSite", "TracedTreeRecurrence", "output_dtype", "recomputed_grads",
           "register_site", "site"]

_SITES: dict[str, tuple] = {}  # key -> (recurrence, tensor argument names, static arguments)


def register_site(rec: Recurrence, tensor_names: list[str], static: dict,
                  out_dtype: torch.dtype | None = None) -> str:
    """Remember one graph site's non-tensor arguments and its output's dtype (None: the
    ``output_like`` argument's); returns the key the op is called with. Sites with the same
    recurrence and arguments share a key, so recompiling a model (or compiling many) does not
    grow the table."""
    entry = (rec, list(tensor_names), dict(static), out_dtype)
    for key, known in _SITES.items():
        if known[0] is rec and known[1:] == entry[1:]:
            return key
    key = f"{rec.name}#{len(_SITES)}"
    _SITES[key] = entry
    return key


def site(key: str) -> tuple:
    """The site registered under ``key``: (recurrence, tensor argument names, static
    arguments, output dtype or None)."""
    return _SITES[key]


def _run_site(key: str, parent_token: torch.Tensor, tensors) -> torch.Tensor:
    rec, names, static, _ = _SITES[key]
    out = tree_recurrence(rec, parent_token, (), {**dict(zip(names, tensors)), **static})
    return out if rec.bare_output_without_state else out[0]


@torch.library.custom_op("treefx::tree_recurrence", mutates_args=())
def _tree_recurrence_op(key: str, parent_token: torch.Tensor,
                        tensors: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        # Contiguous, as the fake implementation promises (Inductor checks the strides).
        out = _run_site(key, parent_token, tensors).contiguous()
    want = output_dtype(key, tensors)
    if out.dtype != want:
        raise RuntimeError(f"treefx recurrence {key}: the kernel returned {out.dtype} where "
                           f"the traced graph expects {want}")
    return out


def output_dtype(key: str, tensors) -> torch.dtype:
    rec, names, _, out_dtype = _SITES[key]
    return out_dtype or tensors[names.index(rec.output_like)].dtype


@_tree_recurrence_op.register_fake
def _(key, parent_token, tensors):
    rec, names, _, _ = _SITES[key]
    like = tensors[names.index(rec.output_like)]
    return like.new_empty(like.shape, dtype=output_dtype(key, tensors))


@torch.library.custom_op("treefx::tree_recurrence_backward", mutates_args=())
def _tree_recurrence_backward(key: str, parent_token: torch.Tensor, tensors: list[torch.Tensor],
                              grad: torch.Tensor) -> list[torch.Tensor]:
    return recomputed_grads(lambda xs: [_run_site(key, parent_token, xs)], tensors, [grad])


def recomputed_grads(run, tensors: list[torch.Tensor], grads: list[torch.Tensor]
                      ) -> list[torch.Tensor]:
    """The gradients of ``run(tensors)`` (a list of outputs) for the upstream ``grads``, one
    per tensor (zeros for integer tensors and unused ones): the forward recomputed under
    autograd and differentiated. A custom op's body runs below the autograd dispatch key;
    re-admitting it lets plain autograd record the kernel's torch ops and classic
    autograd.Functions (fla's kernels) alike."""
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    readmit = torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality,
                                                   False)
    with readmit, torch.enable_grad():
        full = list(tensors)
        for i in floats:
            full[i] = tensors[i].detach().requires_grad_()
        outs = run(full)
        got = torch.autograd.grad(outs, [full[i] for i in floats],
                                  [g.to(o.dtype) for g, o in zip(grads, outs)],
                                  allow_unused=True)
    by_index = dict(zip(floats, got))
    return [by_index[i].contiguous() if by_index.get(i) is not None else t.new_zeros(t.shape)
            for i, t in enumerate(tensors)]


@_tree_recurrence_backward.register_fake
def _(key, parent_token, tensors, grad):
    return [t.new_empty(t.shape) for t in tensors]


def _setup(ctx, inputs, output):
    key, parent_token, tensors = inputs
    ctx.key = key
    ctx.save_for_backward(parent_token, *tensors)


def _backward(ctx, grad):
    parent_token, *tensors = ctx.saved_tensors
    grads = _tree_recurrence_backward(ctx.key, parent_token, tensors, grad.contiguous())
    return None, None, [g if t.is_floating_point() else None for g, t in zip(grads, tensors)]


_tree_recurrence_op.register_autograd(_backward, setup_context=_setup)


class TracedSite:
    """A graph node's call of a recurrence custom op for the site ``key``."""

    _prefix = "tree_recurrence_op"

    def __init__(self, key: str):
        self.key = key
        self.rec = _SITES[key][0]
        self.__name__ = f"{self._prefix}_{self.rec.name}"

    def __repr__(self):
        return self.__name__


class TracedTreeRecurrence(TracedSite):
    """The custom op over a whole tree, returning what the kernel returns."""

    def __call__(self, parent_token, *tensors):
        out = _tree_recurrence_op(self.key, parent_token, list(tensors))
        return out if self.rec.bare_output_without_state else (out, None)
