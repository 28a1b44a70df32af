"""``treefx.backward``: train on trees larger than one step's memory, in parts, computing every
token once.

The trees are packed as one row and cut into parts of at most ``max_tokens`` tokens
(:mod:`treefx.parts`). Each part runs through the model's tree graph in *part mode*: its
queries attend over the keys and values of its context (the path from the root to its first
token, computed by earlier parts) and its own, its convolutions read their left inputs there,
its recurrences start from the states earlier parts handed on; it returns its own keys, values
and conv inputs (and its exit states) for the parts after it.

Those come in as detached leaves that require grad, so after a part's backward their gradients
sit in the leaves' ``.grad``; a part's own backward runs once every later part that reads it
has run its own, with those gradients as the ``grad_tensors`` of its outputs. A part's
backward therefore runs exactly once, and as early as possible: right after its forward when
its subtrees end inside it, else once the row has passed the end of its last subtree.

A token is forwarded twice only in a *recompute* part (:mod:`treefx.parts`: the open tokens
past what the budget can hold, on a comb-shaped tree or a sequence longer than the budget):
its forward runs under ``no_grad``, keeping its own keys, values, conv inputs and exit states
as the leaves later parts read (and its inputs), and at its backward its forward runs again
with a graph, reading the same context leaves, and is differentiated with the gradients later
parts left in its leaves (part-level activation checkpointing). The first forward built no
graph, so the context's gradients arrive once, through the second. A plan with recompute
parts refuses a part graph that draws random numbers (dropout in training mode): the second
forward would draw others. In FSDP2's rounds the plan has no recompute parts (a recompute
part's backward gathers the layers for its second forward too, once more than another rank's
backward in that round): what the budget cannot hold is held, with a warning. With FSDP2's
units gathered once (``fsdp="gather_once"``) a second forward gathers nothing: recompute parts
run as on one process.

One job a module:

- :mod:`.graphs`: the functions a part captures (the model in part mode, its loss, a step's);
- :mod:`.runner`: :class:`PartRunner`, a part graph's layout and engine;
- :mod:`.registry`: the runners per compiled model and per step (:func:`runners`);
- :mod:`.executor`: one call's parts run in order, held, differentiated (:class:`~.executor.Run`);
- :mod:`.ddp`: DDP's buffers and its gradients averaged once, at the end;
- :mod:`.fsdp`: FSDP2's units gathered once a call, or its common rounds over the ranks;
- :mod:`.front`: :func:`backward` itself;
- :mod:`.memory`: ``max_memory=``, the memory model and the token budget it plans.

What the model is wrapped in (FSDP2, DDP) is read in :mod:`treefx.run.wrapping`, shared with
regional execution.
"""

from .front import backward
from .graphs import part_forward, part_step_function
from .registry import runners
from .runner import PartRunner

__all__ = ["PartRunner", "backward", "part_forward", "part_step_function", "runners"]
