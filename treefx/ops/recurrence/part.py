"""The tree recurrence over one part of a tree (:mod:`treefx.parts`, :func:`treefx.backward`):
the part's nodes start from the context states of their entries (the states after their
predecessors in earlier parts), and the states after its exit tokens are a second output.
:func:`tree_recurrence_part` runs it eagerly; :class:`TracedTreeRecurrencePart` is the opaque
custom op for traced graphs, as :mod:`.traced` is for a whole tree.
"""

from __future__ import annotations

import torch

from ..host_row import on_host
from .reference import Recurrence, run_tree, tree_nodes
from .traced import TracedSite, output_dtype, recomputed_backward, site

__all__ = ["TracedTreeRecurrencePart", "tree_recurrence_part"]


def tree_recurrence_part(rec: Recurrence, parent_local: torch.Tensor, state_entry: torch.Tensor,
                         state_exit: torch.Tensor, context_states: torch.Tensor, args: tuple,
                         kwargs: dict):
    """The recurrence over one part of a tree (:mod:`treefx.parts`): ``parent_local`` [n]
    the predecessors inside the part (-1 where it is in an earlier part, or none); a node
    whose first token's predecessor is in an earlier part starts from row
    ``state_entry[first token]`` of ``context_states`` [E, *state] (the state after that
    predecessor), a true root from zeros. Returns (what :func:`.reference.tree_recurrence`
    returns, the states after the tokens ``state_exit`` [X], each the last token of a node:
    [X, *state])."""
    entry = on_host(state_entry).tolist()
    exit_rows = on_host(state_exit).tolist()

    def root_state(start):
        e = entry[start]
        return context_states[e] if e >= 0 else None

    nodes = tree_nodes(parent_local, ends=exit_rows)
    end_of = {s + ln - 1: i for i, (s, ln) in enumerate(zip(nodes[0], nodes[1]))}
    row, final, nodes = run_tree(rec, parent_local, args, kwargs, root_state, nodes,
                                 keep=[end_of[t] for t in exit_rows if t in end_of])
    exits = []
    for t in exit_rows:
        if t not in end_of:
            raise RuntimeError(f"{rec.name}: token {t} of the part is not the last of a node; "
                               "its state cannot be handed to a later part")
        exits.append(final[end_of[t]])
    out = row if rec.bare_output_without_state else (row, None)
    return out, torch.stack(exits)


def _run_part_site(key, parent_local, state_entry, state_exit, context_states, tensors):
    rec, names, static, _ = site(key)
    out, exits = tree_recurrence_part(rec, parent_local, state_entry, state_exit,
                                      context_states, (), {**dict(zip(names, tensors)),
                                                           **static})
    return (out if rec.bare_output_without_state else out[0]), exits


@torch.library.custom_op("treefx::tree_recurrence_part", mutates_args=())
def _tree_recurrence_part_op(key: str, parent_local: torch.Tensor, state_entry: torch.Tensor,
                             state_exit: torch.Tensor, context_states: torch.Tensor,
                             tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out, exits = _run_part_site(key, parent_local, state_entry, state_exit,
                                    context_states, tensors)
    return out.contiguous(), exits.to(context_states.dtype).contiguous()


@_tree_recurrence_part_op.register_fake
def _(key, parent_local, state_entry, state_exit, context_states, tensors):
    rec, names, _, _ = site(key)
    like = tensors[names.index(rec.output_like)]
    return (like.new_empty(like.shape, dtype=output_dtype(key, tensors)),
            context_states.new_empty((state_exit.shape[0], *context_states.shape[1:])))


@torch.library.custom_op("treefx::tree_recurrence_part_backward", mutates_args=())
def _tree_recurrence_part_backward(key: str, parent_local: torch.Tensor,
                                   state_entry: torch.Tensor, state_exit: torch.Tensor,
                                   context_states: torch.Tensor, tensors: list[torch.Tensor],
                                   grad_out: torch.Tensor, grad_exits: torch.Tensor
                                   ) -> list[torch.Tensor]:
    """Gradients of the context states and of every tensor (zeros for the non-float ones)."""
    def run(xs):
        return list(_run_part_site(key, parent_local, state_entry, state_exit, xs[0], xs[1:]))

    return recomputed_backward(run, [context_states, *tensors], [grad_out, grad_exits])


@_tree_recurrence_part_backward.register_fake
def _(key, parent_local, state_entry, state_exit, context_states, tensors, grad_out,
      grad_exits):
    return [context_states.new_empty(context_states.shape)] + [t.new_empty(t.shape)
                                                               for t in tensors]


def _part_setup(ctx, inputs, output):
    key, parent_local, state_entry, state_exit, context_states, tensors = inputs
    ctx.key = key
    ctx.n = len(tensors)
    ctx.save_for_backward(parent_local, state_entry, state_exit, context_states, *tensors)


def _part_backward(ctx, grad_out, grad_exits):
    parent_local, state_entry, state_exit, context_states, *tensors = ctx.saved_tensors
    grads = _tree_recurrence_part_backward(
        ctx.key, parent_local, state_entry, state_exit, context_states, tensors,
        grad_out.contiguous(), grad_exits.contiguous())
    return (None, None, None, None, grads[0],
            [g if t.is_floating_point() else None for g, t in zip(grads[1:], tensors)])


_tree_recurrence_part_op.register_autograd(_part_backward, setup_context=_part_setup)


class TracedTreeRecurrencePart(TracedSite):
    """The custom op over a part of a tree: (what the kernel returns, the exit states)."""

    _prefix = "tree_recurrence_part_op"

    def __call__(self, parent_local, state_entry, state_exit, context_states, *tensors):
        out, exits = _tree_recurrence_part_op(self.key, parent_local, state_entry, state_exit,
                                              context_states, list(tensors))
        return (out if self.rec.bare_output_without_state else (out, None)), exits
