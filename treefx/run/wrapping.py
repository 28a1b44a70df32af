"""What a model is wrapped in: FSDP2 units, a DDP wrapper, and the process group whose ranks
run together. One place for the detection that regional execution (:mod:`.regional`: which
blocks to cut at, which hooks are FSDP's) and the parts (:mod:`treefx.run.parts`: which
collectives the ranks must pair up) both read."""

from __future__ import annotations

import torch

from ..compiler import TreeCompileError

__all__ = ["distributed_kind", "fsdp_gathered", "fsdp_module_type", "fsdp_param_groups",
           "fsdp_units", "is_fsdp_hook", "is_fsdp_unit", "process_group", "unwrap_ddp"]


def fsdp_module_type():
    """FSDP2's module class (``fully_shard``'s), or None in a torch built without
    distributed."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    return FSDPModule


def ddp_type():
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return None
    return DistributedDataParallel


def unwrap_ddp(model):
    """``(module, wrapper)``: a DDP-wrapped model's inner module and the wrapper, or
    ``(model, None)``."""
    ddp = ddp_type()
    if ddp is not None and isinstance(model, ddp):
        return model.module, model
    return model, None


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 units (``fully_shard``-ed modules) in ``model``, the root first."""
    fsdp = fsdp_module_type()
    if fsdp is None:
        return []
    return [m for m in model.modules() if isinstance(m, fsdp)]


def fsdp_param_groups(unit: torch.nn.Module) -> list:
    """An FSDP2 unit's parameter groups (FSDP's own state: ``_fsdp_param_groups``, one
    ``_fsdp_param_group`` in older torch), where its gather and reduce settings live."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if hasattr(state, "_fsdp_param_group"):  # torch before per-parameter meshes
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise TreeCompileError(
        f"this torch's FSDP2 ({torch.__version__}) keeps its parameter groups where treefx "
        "does not know to read them (neither _fsdp_param_groups nor _fsdp_param_group)")


def fsdp_gathered(unit: torch.nn.Module) -> bool:
    """Whether an FSDP2 unit's parameters are gathered (unsharded) now."""
    return all(g.is_unsharded for g in fsdp_param_groups(unit))


def is_fsdp_unit(module: torch.nn.Module) -> bool:
    fsdp = fsdp_module_type()
    return fsdp is not None and isinstance(module, fsdp)


def is_fsdp_hook(hook) -> bool:
    """A hook FSDP installed (its gathers, frees, casts and reduce-scatters)."""
    return str(getattr(hook, "__module__", "") or "").startswith("torch.distributed.fsdp")


def distributed_kind(model: torch.nn.Module, wrapper=None) -> str | None:
    """``"fsdp"`` (FSDP2 units in the model), ``"ddp"`` (a DDP wrapper) or None."""
    if fsdp_units(model):
        return "fsdp"
    if wrapper is not None:
        return "ddp"
    return None


def process_group(kind: str | None, model: torch.nn.Module, wrapper):
    """The process group whose ranks run together: DDP's ``process_group``; for FSDP2, its
    mesh's group (a 1-D mesh) or the default group (a mesh over every rank, None)."""
    if kind is None:
        return None
    import torch.distributed as dist

    if kind == "ddp":
        return wrapper.process_group
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    if mesh is None or mesh.ndim == 1:
        return mesh.get_group() if mesh is not None else None
    if mesh.size() == dist.get_world_size():
        return None
    raise TreeCompileError(
        "treefx.backward: an FSDP2 model on a mesh of several dimensions that does not span "
        "every rank (with tensor or pipeline parallelism): which ranks run their parts "
        "together is not known; shard it on a 1-D mesh, or over every rank")
