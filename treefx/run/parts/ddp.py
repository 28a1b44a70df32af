"""DDP under :func:`treefx.backward`: the parts run on the inner module without the
wrapper's hooks, and the gradients are averaged over its group once, at the end, as DDP's
default reducer averages them."""

from __future__ import annotations

import torch

from ...compiler import TreeCompileError

__all__ = ["check_ddp", "reduce_ddp", "sync_ddp_buffers"]


def check_ddp(wrapper) -> None:
    """A DDP wrapper whose gradients :func:`backward` may average itself: no communication
    hook, mixed precision or delayed all-reduce (each would reduce differently)."""
    what = ("a communication hook" if getattr(wrapper, "_comm_hooks", None) else
            "mixed precision" if getattr(wrapper, "mixed_precision", None) is not None else
            "delayed all-reduce parameters" if getattr(wrapper, "_delay_all_reduce_params",
                                                        None) else None)
    if what is not None:
        raise TreeCompileError(
            f"treefx.backward: the DDP wrapper has {what}; treefx.backward averages a DDP "
            "model's gradients itself, once per call (an all-reduce over its process group, "
            "divided by its size, as DDP's default), so that would not apply. Train whole "
            "batches through the wrapper, or remove it")


def sync_ddp_buffers(wrapper) -> None:
    """DDP's buffer broadcast from rank 0, once before the parts, as its forward does (the
    parts run the inner module, without the wrapper's forward)."""
    will = getattr(wrapper, "will_sync_module_buffers", None)
    sync = getattr(wrapper, "_sync_buffers", None)
    if callable(will) and callable(sync) and will():
        sync()


def reduce_ddp(wrapper, group, bucket_bytes: int = 25 << 20) -> None:
    """Every trained parameter's ``.grad`` (zeros where the parts left none) averaged over
    ``group`` as DDP's default reducer does (sum, divided by the group's size), in buckets
    of one dtype and device."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    ignore = getattr(wrapper, "parameters_to_ignore", set())
    params = [p for n, p in wrapper.module.named_parameters()
              if p.requires_grad and n not in ignore]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    world = dist.get_world_size(group)
    buckets: dict[tuple, list] = {}
    for p in params:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        while grads:
            take, size = [], 0
            while grads and (not take or size + grads[0].numel() * grads[0].element_size()
                             <= bucket_bytes):
                size += grads[0].numel() * grads[0].element_size()
                take.append(grads.pop(0))
            flat = _flatten_dense_tensors(take)
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            for g, r in zip(take, _unflatten_dense_tensors(flat, take)):
                g.copy_(r)
