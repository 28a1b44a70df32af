"""Every import of a treefx module outside its public API (block masks, the attention op: modules
the package may rename), in one place: when they move, this file is the one to change."""

from treefx.mask import tree_block_tensors  # noqa: F401
from treefx.ops.attention import TreeFlexAttention  # noqa: F401
from treefx.ops.attention import flex as attention_ops  # noqa: F401  (STANDARD_KERNEL)
from treefx.ops.attention import intervals  # noqa: F401  (tree_intervals: chain_attention)


def recurrence_registry() -> dict:
    """The registered recurrences (name -> Recurrence), to tell which have a varlen fast path."""
    from treefx.compiler.recurrences import all_recurrences

    return all_recurrences()


def agree_captures(tm, batch) -> int:
    """Under FSDP2, before ``tm(batch)`` on every rank: a rank whose call would not capture its
    regional graph gathers and frees every FSDP unit as often as one whose call does (as
    ``treefx.backward`` does for its parts). Returns this rank's captures (0 or 1)."""
    import torch
    import torch.distributed as dist

    from treefx.run import regional
    from treefx.run.engine import tree_info

    model = tm.model
    mine = int(tm.engine.needs_capture(batch.device, model, batch.input_ids, tree_info(batch),
                                       discover_in=model, root=tm._root[0]))
    dev = batch.device if dist.get_backend() == "nccl" else torch.device("cpu")
    most = torch.tensor([mine], dtype=torch.int64, device=dev)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    for _ in range(int(most.item()) - mine):
        with regional.capture_state(model):
            pass
    return mine
