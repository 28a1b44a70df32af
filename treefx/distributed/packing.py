"""This rank's trees packed with the loss normalized over every rank's sequences
(:func:`pack`: one all-reduce gives the global sequence count)."""

from __future__ import annotations

import inspect

import torch

from .. import layout
from ..layout import TreeBatch
from ..tree import Tree
from .sizes import tree_list

__all__ = ["pack"]


_PACK_OPTIONS = frozenset(inspect.signature(layout.pack).parameters) - {"trees", "reduction"}
_SET_HERE = ("num_sequences", "loss_scale")


def pack(my_trees, group=None, reduction: str = "mean", *, allow_empty: bool = False,
         **pack_kwargs) -> TreeBatch | None:
    """Pack this rank's trees with the loss normalized over all ranks' sequences.

    This rank's trees packed for data-parallel training: ``treefx.pack(my_trees,
    reduction=, num_sequences=P, loss_scale=W, **pack_kwargs)`` with P the **global** sequence
    count (an all-reduce SUM of every rank's count over ``group``) and W the group's size.

    So every loss weight is ``w_t = W · Σ_{p∋t} ω_p r_p m_p(t) / P``: the rank's loss is W
    times its sequences' share of the global mean, and the mean over the W ranks of their
    losses — what DDP and FSDP compute when they average gradients over the group — is the
    loss of the whole global batch, ``(1/P) Σ_p ω_p · loss_p``, with its gradients, however
    the trees are split (see the module's docstring). It holds for ``treefx.tree_loss``,
    ``@treefx.step`` and every :mod:`treefx.rl` objective (all read the weights, or
    ``batch.num_sequences_normalizer`` = P and ``batch.loss_scale`` = W). Don't multiply the
    loss by the world size again. A loss whose gradients are summed over ranks rather than
    averaged wants ``treefx.pack(trees, num_sequences=P)`` without the scale instead.

    Every rank of ``group`` must call it (it is a collective), with at least one tree and the
    same ``reduction``; a rank given no trees, something that is not a ``treefx.Tree`` or an
    unknown option raises on every rank, not only its own (so no rank is left waiting).
    ``allow_empty=True``: a rank given no trees counts none and gets None, which
    :func:`treefx.backward` takes as a rank with nothing to train (it still runs its share of
    the collectives).
    ``group``: the process group gradients are averaged over (DDP's ``process_group``, FSDP's
    data-parallel ranks); default the default group. With tensor / context parallelism, ranks
    that share one batch are one data-parallel rank: pass the data-parallel group. The
    all-reduce runs on the device the group's backend needs (a CPU tensor for gloo, the
    current CUDA device for NCCL; with NCCL reading P back waits for the current stream).
    ``pack_kwargs``: the other options of :func:`treefx.pack` (``pad_to_multiple``,
    ``pad_token_id``, ``weight_dtype``); ``num_sequences`` and ``loss_scale`` are set here.
    The batch stays on the CPU: ``.to(device)`` it.
    """
    world = _group_size(group, pack_kwargs)
    # Problems found here are shared through the all-reduce, so that every rank raises.
    trees, error = _this_ranks_trees(my_trees, reduction, allow_empty, pack_kwargs)
    total = _global_count(trees, error, reduction, world, group)
    if not trees:
        return None
    return layout.pack(trees, reduction=reduction, num_sequences=total, loss_scale=world,
                       **pack_kwargs)


def _group_size(group, pack_kwargs: dict) -> int:
    """The size of ``group``, once the options :func:`pack` sets itself are left out and this
    process is a member of an initialized process group."""
    import torch.distributed as dist

    for key in _SET_HERE:
        if key in pack_kwargs:
            raise TypeError(
                f"treefx.distributed.pack sets {key} itself (num_sequences = the global "
                "sequence count over the group, loss_scale = the group size); leave it out, or "
                "use treefx.pack directly to set it by hand"
            )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "treefx.distributed.pack needs an initialized torch.distributed process group: "
            "call torch.distributed.init_process_group(...) first (torchrun sets up its "
            "environment), or, in a single process, use treefx.pack(trees) (with "
            "num_sequences= for micro-batches of a larger batch)"
        )
    world = dist.get_world_size(group)
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of the given process group")
    return world


def _this_ranks_trees(my_trees, reduction: str, allow_empty: bool,
                      pack_kwargs: dict) -> tuple[list[Tree], Exception | None]:
    """This rank's trees and the error its input raises (None if none), not raised yet: every
    rank learns of it through :func:`_global_count`'s all-reduce first."""
    error: Exception | None = None
    trees: list[Tree] = []
    try:
        unknown = sorted(set(pack_kwargs) - _PACK_OPTIONS)
        if unknown:
            raise TypeError(f"treefx.pack has no option {', '.join(map(repr, unknown))}; it "
                            f"takes {', '.join(sorted(_PACK_OPTIONS - set(_SET_HERE)))}")
        if reduction not in layout.REDUCTIONS:
            raise ValueError(f"reduction must be one of {layout.REDUCTIONS}, got {reduction!r}")
        trees = tree_list(my_trees, "my_trees")
        if not trees and not allow_empty:
            raise ValueError("this rank has no trees; every rank needs at least one (see "
                             "treefx.distributed.assign), or allow_empty=True for "
                             "treefx.backward")
    except (TypeError, ValueError) as e:
        error = e
    return trees, error


def _global_count(trees: list[Tree], error: Exception | None, reduction: str, world: int,
                  group) -> int:
    """The sequence count over every rank of ``group`` (one all-reduce, which also tells each
    rank whether another failed and which reductions the ranks packed with); raises this
    rank's ``error``, or when another rank failed or the ranks disagree on the reduction."""
    import torch.distributed as dist

    local = sum(t.num_sequences for t in trees) if error is None else 0
    stats = torch.tensor([local, int(error is not None), int(reduction == "mean")],
                         dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    total, failed, means = (int(x) for x in stats.tolist())
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"treefx.distributed.pack: {failed} other rank(s) of the group were given invalid "
            "input (their error is raised there); this rank stops as well so that none waits "
            "in a later collective"
        )
    if means not in (0, world):
        raise ValueError(
            f"ranks disagree on the reduction: {means} of {world} packed with \"mean\", the "
            "others with \"sum\"; one global batch has one reduction"
        )
    return total


def _collective_device(group) -> torch.device:
    """Where a tensor for a collective of ``group`` must live: the CPU for gloo (and MPI), the
    current CUDA device for NCCL, the current accelerator for other device backends."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or backend == "mpi":  # "cpu:gloo,cuda:nccl" takes CPU tensors too
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        dev = accelerator.current_accelerator()
        return torch.device(dev.type, accelerator.current_device_index())
    return torch.device("cpu")
