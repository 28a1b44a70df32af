"""The tree recurrence as one opaque custom op, for graphs that AOTAutograd / Inductor trace.

Under AOTAutograd / Inductor the tree structure is data (it comes from parent_token), so the
per-depth loop (:func:`.reference.tree_recurrence`) cannot be traced. The recurrence then runs
as one opaque custom op: its fake implementation gives the output's shape. By default
(:func:`keeps_forward_graph`) a graph traced with gradients on runs the kernels under autograd
in the forward and keeps their graph for the backward (:func:`run_keeping`,
:func:`kept_grads`): each kernel call runs once. With ``TREEFX_KEEP_RECURRENCE_GRAPH=0`` (and
for a graph traced without gradients) the op runs the kernels without autograd and its
backward recomputes the forward under autograd and differentiates it
(:func:`recomputed_grads`). Each graph site's non-tensor arguments are registered under a key
(:func:`register_site`), which the op is called with; :mod:`.part` has the same for a part of
a tree.
"""

from __future__ import annotations



import torch

from ...options import Options, current
from .reference import Recurrence, tree_recurrence

__all__ = ["TracedSite", "TracedTreeRecurrence", "backward_paths", "keeps_forward_graph",
           "kept_grads", "output_dtype", "recomputed_backward", "recomputed_grads",
           "register_site", "run_keeping", "site"]

_SITES: dict[str, tuple] = {}  # key -> (recurrence, tensor argument names, static arguments)
_PATHS = {"kept": 0, "recomputed": 0}  # backward calls that used a kept graph / recomputed


def keeps_forward_graph(options: Options | None = None) -> bool:
    """Whether graphs traced with gradients on keep the recurrence's forward graph for its
    backward (the capture's ``options``, read when a graph is traced): yes by default,
    ``TREEFX_KEEP_RECURRENCE_GRAPH=0`` recomputes the forward in the backward instead (the
    earlier path: the same values, every kernel call run twice; BENCHMARKS.md, "Hybrids on
    fla's kernels")."""
    return current(options).keep_recurrence_graph


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
    return recomputed_backward(lambda xs: [_run_site(key, parent_token, xs)], tensors, [grad])


def recomputed_backward(run, tensors: list[torch.Tensor], grads: list[torch.Tensor]
                        ) -> list[torch.Tensor]:
    """A recurrence op's backward by :func:`recomputed_grads`, counted in
    :func:`backward_paths`."""
    _PATHS["recomputed"] += 1
    return recomputed_grads(run, tensors, grads)


def _autograd_leaves(tensors: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """(the indices of the float tensors, ``tensors`` with those detached and requiring grad:
    the leaves a kernel runs on under autograd)."""
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    leaves = list(tensors)
    for i in floats:
        leaves[i] = tensors[i].detach().requires_grad_()
    return floats, leaves


def _autograd_inside_op():
    """A custom op's body runs below the autograd dispatch keys and below ADInplaceOrView;
    re-admitting both (with grad mode on) lets plain autograd record the kernel's torch ops
    and classic autograd.Functions (fla's kernels) alike. ADInplaceOrView too: a kernel that
    writes its output into slices of a buffer (Hugging Face's torch Gated DeltaNet,
    ``out[:, :, i] = ...``) otherwise returns a tensor with no history, and its gradients
    came back as zeros without a word."""
    readmit = _Readmit((torch._C.DispatchKey.AutogradFunctionality,
                        torch._C.DispatchKey.ADInplaceOrView))
    return readmit, torch.enable_grad()


class _Readmit:
    """Dispatch keys taken out of the thread's exclude set for a ``with`` block."""

    def __init__(self, keys):
        self.keys = keys
        self.guards = []

    def __enter__(self):
        self.guards = [torch._C._SetExcludeDispatchKeyGuard(k, False) for k in self.keys]
        for g in self.guards:
            g.__enter__()
        return self

    def __exit__(self, *exc):
        for g in reversed(self.guards):
            g.__exit__(*exc)
        self.guards = []
        return False


def _per_tensor(floats: list[int], got, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One gradient per tensor: ``got`` for the floats, zeros for integer and unused ones."""
    by_index = dict(zip(floats, got))
    return [by_index[i].contiguous() if by_index.get(i) is not None else t.new_zeros(t.shape)
            for i, t in enumerate(tensors)]


def recomputed_grads(run, tensors: list[torch.Tensor], grads: list[torch.Tensor]
                      ) -> list[torch.Tensor]:
    """The gradients of ``run(tensors)`` (a list of outputs) for the upstream ``grads``, one
    per tensor (zeros for integer tensors and unused ones): the forward recomputed under
    autograd inside the op's body and differentiated."""
    floats, full = _autograd_leaves(tensors)
    readmit, grad_mode = _autograd_inside_op()
    with readmit, grad_mode:
        outs = run(full)
        got = torch.autograd.grad(outs, [full[i] for i in floats],
                                  [g.to(o.dtype) for g, o in zip(grads, outs)],
                                  allow_unused=True)
    return _per_tensor(floats, got, tensors)


@_tree_recurrence_backward.register_fake
def _(key, parent_token, tensors, grad):
    return [t.new_empty(t.shape) for t in tensors]


# ---------------------------------------------------------------------------- kept graphs
#
# Recomputing the forward in the backward runs every kernel call twice: on a hybrid's step on
# fla, a third of its per-level kernel calls (host time the GPU waits for). Opted in, a graph
# that computes gradients instead runs the forward under autograd once and keeps that graph
# for the backward op. A custom op returns only tensors, so the graph rides on one: a tiny
# "handle" output carries it as a Python attribute, and it lives exactly as long as AOTAutograd
# keeps the handle for the backward (a forward whose handle is not kept, e.g. one the
# partitioner recomputes under activation checkpointing, frees its graph at once). The
# kernels' saved tensors must not alias buffers the compiled graph may reuse, so the graph
# runs on copies of the inputs that the op owns and returns; the backward reads those.

def backward_paths() -> dict[str, int]:
    """How many backward calls of the recurrence ops in this process used the forward's kept
    graph (``kept``) and how many recomputed the forward (``recomputed``: the default, a graph
    traced without gradients, or a kept graph already used, e.g. by a second backward)."""
    return dict(_PATHS)


def run_keeping(run, tensors: list[torch.Tensor]
                ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """(the outputs of ``run(tensors)``, a handle carrying their autograd graph, copies of
    ``tensors`` the graph reads), for :func:`kept_grads`. ``run``'s outputs must be fresh
    tensors no kernel saved (a cat or stack last), as the op hands them to the compiled
    graph, which may write over them once they are dead."""
    owned = [t.clone(memory_format=torch.contiguous_format) for t in tensors]
    floats, leaves = _autograd_leaves(owned)
    readmit, grad_mode = _autograd_inside_op()
    # Saved-tensor hooks around the caller (a checkpoint outside the compiled code,
    # offloading) apply to this graph as to any other the call records.
    with readmit, grad_mode:
        outs = run(leaves)
        if floats and any(o.is_floating_point() and not o.requires_grad for o in outs):
            # the kernel ran on leaves that require grad and returned no history: its
            # gradients would be zeros without a word (a kernel that detaches, runs under
            # no_grad or writes its output where autograd does not record)
            raise RuntimeError(
                "treefx recurrence: the kernel's output has no autograd history although its "
                "inputs require grad, so the backward could only return zeros. Set "
                f"{Options.env_name('keep_recurrence_graph')}=0 (recompute the forward in the "
                "backward) and report the model")
        # edges, not the outputs: holding an output would keep its memory until the backward
        # (made here, where autograd records: _edge may add a view)
        edges = [(_edge(o), o.dtype) if o.requires_grad else None for o in outs]
    handle = torch.zeros(0, dtype=torch.int64)
    handle._treefx_kept = (edges, [leaves[i] for i in floats], floats)
    return [o.detach() for o in outs], handle, owned


def _edge(out: torch.Tensor):
    """``out``'s gradient edge, one that keeps the graph behind it alive. An output made by a
    Python autograd.Function (fla's kernels, the one-pass tree) has a node whose Python object
    holds it only weakly on torch 2.11: with the output handed out and dropped, the node is
    freed and the backward fails ("Attribute '_input_metadata' is invalid ..."). A view of
    the output has a C++ node that holds the Function's node; it saves nothing, so ``out``
    stays free to be handed out."""
    edge = torch.autograd.graph.get_gradient_edge(out)
    if not isinstance(edge.node, torch.autograd.function.BackwardCFunction):
        return edge
    return torch.autograd.graph.GradientEdge(out.view_as(out).grad_fn, 0)


def kept_grads(handle: torch.Tensor, run, owned: list[torch.Tensor],
               grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients :func:`recomputed_grads` gives, from the graph :func:`run_keeping`
    kept on ``handle`` (used once, then freed); recomputed where it is gone."""
    kept = getattr(handle, "_treefx_kept", None)
    if kept is None:
        return recomputed_backward(run, owned, grads)
    del handle._treefx_kept
    _PATHS["kept"] += 1
    edges, leaves, floats = kept
    pairs = [(e, g) for e, g in zip(edges, grads) if e is not None]
    got = torch.autograd.grad([e for (e, _), _ in pairs], leaves,
                              [g.to(dtype) for (_, dtype), g in pairs], allow_unused=True)
    return _per_tensor(floats, got, owned)


def _setup(ctx, inputs, output):
    key, parent_token, tensors = inputs
    ctx.key = key
    ctx.save_for_backward(parent_token, *tensors)


def _backward(ctx, grad):
    parent_token, *tensors = ctx.saved_tensors
    grads = _tree_recurrence_backward(ctx.key, parent_token, tensors, grad.contiguous())
    return None, None, [g if t.is_floating_point() else None for g, t in zip(grads, tensors)]


_tree_recurrence_op.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("treefx::tree_recurrence_kept", mutates_args=())
def _tree_recurrence_kept(key: str, parent_token: torch.Tensor, tensors: list[torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    (out,), handle, owned = run_keeping(lambda xs: [_run_site(key, parent_token, xs)], tensors)
    want = output_dtype(key, tensors)
    if out.dtype != want:
        raise RuntimeError(f"treefx recurrence {key}: the kernel returned {out.dtype} where "
                           f"the traced graph expects {want}")
    return out.contiguous(), handle, owned


@_tree_recurrence_kept.register_fake
def _(key, parent_token, tensors):
    rec, names, _, _ = _SITES[key]
    like = tensors[names.index(rec.output_like)]
    return (like.new_empty(like.shape, dtype=output_dtype(key, tensors)),
            torch.empty(0, dtype=torch.int64), [t.new_empty(t.shape) for t in tensors])


@torch.library.custom_op("treefx::tree_recurrence_kept_backward", mutates_args=())
def _tree_recurrence_kept_backward(key: str, parent_token: torch.Tensor, handle: torch.Tensor,
                                   owned: list[torch.Tensor], grad: torch.Tensor
                                   ) -> list[torch.Tensor]:
    return kept_grads(handle, lambda xs: [_run_site(key, parent_token, xs)], owned, [grad])


@_tree_recurrence_kept_backward.register_fake
def _(key, parent_token, handle, owned, grad):
    return [t.new_empty(t.shape) for t in owned]


def _kept_setup(ctx, inputs, output):
    key, parent_token, _ = inputs
    _, handle, owned = output
    ctx.key = key
    ctx.save_for_backward(parent_token, handle, *owned)


def _kept_backward(ctx, grad, _grad_handle, _grad_owned):
    parent_token, handle, *owned = ctx.saved_tensors
    grads = _tree_recurrence_kept_backward(ctx.key, parent_token, handle, owned,
                                           grad.contiguous())
    return None, None, [g if t.is_floating_point() else None for g, t in zip(grads, owned)]


_tree_recurrence_kept.register_autograd(_kept_backward, setup_context=_kept_setup)


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
    """The custom op over a whole tree, returning what the kernel returns; ``keep``: the
    forward keeps its autograd graph for the backward (a graph traced with gradients on),
    else the backward would recompute it."""

    def __init__(self, key: str, keep: bool = False):
        super().__init__(key)
        self.keep = keep
        if keep:
            self.__name__ += "_kept"

    def __call__(self, parent_token, *tensors):
        if self.keep:
            out = _tree_recurrence_kept(self.key, parent_token, list(tensors))[0]
        else:
            out = _tree_recurrence_op(self.key, parent_token, list(tensors))
        return out if self.rec.bare_output_without_state else (out, None)
