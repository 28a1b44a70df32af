"""Regional execution's blocks: the modules the tree graph is cut at (the FSDP units, the
decoder layers), the model as it computes for the capture (every FSDP unit gathered, FSDP's
hooks hidden), and a block's call with its forward replaced by a compiled piece."""

from __future__ import annotations

import contextlib

import torch

from ...compiler import TreeCompileError
from ..wrapping import fsdp_gathered, fsdp_module_type, fsdp_units, is_fsdp_hook

__all__ = ["call_with_forward", "capture_state", "check_hooks", "find_blocks",
           "forward_replaced"]


def find_blocks(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The block modules, by qualified name: the FSDP units below the root; else the modules
    of the classes a Hugging Face model names in ``_no_split_modules`` (its decoder layers);
    else the children of the model's ``ModuleList``\\ s. Outermost only."""
    fsdp = fsdp_module_type()
    named = list(model.named_modules())
    if fsdp is not None and any(isinstance(m, fsdp) for _, m in named):
        picked = [(n, m) for n, m in named if n and isinstance(m, fsdp)]
    else:
        classes = set()
        for _, m in named:
            classes.update(getattr(m, "_no_split_modules", None) or ())
        picked = [(n, m) for n, m in named if n and type(m).__name__ in classes]
        if not picked:
            picked = [(f"{n}.{c}" if n else c, child) for n, m in named
                      if isinstance(m, torch.nn.ModuleList) and len(m) > 1
                      for c, child in m.named_children()]
    out: dict[str, torch.nn.Module] = {}
    for n, m in sorted(picked, key=lambda x: x[0].count(".")):
        if not any(n.startswith(p + ".") for p in out):
            out[n] = m
    return out


def _non_fsdp_hooks(module: torch.nn.Module) -> list:
    hooks = []
    for d in (module._forward_pre_hooks, module._forward_hooks):
        hooks += [h for h in d.values() if not (is_fsdp_hook(h) or _is_traced_output_hook(h))]
    return hooks


# Forward hooks known to act only on the module's output tensor, which the capture traced into
# the tree graph: regional execution leaves them out of the module's own call (the block's
# output there is the graph piece's tuple), so they act once, in the graph. Hugging Face's
# ``enable_input_require_grads`` hook on the input embeddings (``output.requires_grad_(True)``,
# registered with activation checkpointing by verl's and PEFT's set-ups).
_TRACED_OUTPUT_HOOKS = {("transformers.modeling_utils",
                         "PreTrainedModel.enable_input_require_grads.<locals>."
                         "make_inputs_require_grads")}


def _is_traced_output_hook(hook) -> bool:
    return (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)) in \
        _TRACED_OUTPUT_HOOKS


@contextlib.contextmanager
def _traced_output_hooks_hidden(module: torch.nn.Module):
    hidden = {k: h for k, h in module._forward_hooks.items() if _is_traced_output_hook(h)}
    for k in hidden:
        del module._forward_hooks[k]
    try:
        yield
    finally:
        module._forward_hooks.update(hidden)



@contextlib.contextmanager
def capture_state(model: torch.nn.Module):
    """The model as it computes, for Dynamo: every FSDP unit gathered, FSDP's hooks hidden
    (their mixed-precision input/output casts kept as traceable hooks); all restored after,
    a unit that was gathered before (``treefx.backward(..., fsdp="gather_once")`` holds
    every unit gathered for the step) left gathered, the others resharded."""
    units = fsdp_units(model)
    if not units:
        yield
        return
    saved = []
    root_state = units[0]._get_fsdp_state()
    root_state._lazy_init()
    was_gathered = [fsdp_gathered(m) for m in units]
    try:
        for m in units:
            m.unshard()
        for m in units:
            saved.append((m, m._forward_pre_hooks, m._forward_hooks))
            pre = type(m._forward_pre_hooks)(
                (k, h) for k, h in m._forward_pre_hooks.items() if not is_fsdp_hook(h))
            post = type(m._forward_hooks)(
                (k, h) for k, h in m._forward_hooks.items() if not is_fsdp_hook(h))
            policy = getattr(m._get_fsdp_state(), "_mp_policy", None)
            cast_in = getattr(policy, "param_dtype", None) if getattr(
                policy, "cast_forward_inputs", False) else None
            cast_out = getattr(policy, "output_dtype", None)
            m._forward_pre_hooks, m._forward_hooks = pre, post
            if cast_in is not None:
                h = m.register_forward_pre_hook(_casting(cast_in), prepend=True,
                                                with_kwargs=True)
                m._forward_pre_hooks_with_kwargs[h.id] = True
            if cast_out is not None:
                m.register_forward_hook(_casting_output(cast_out))
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post
        for m, kept in zip(units, was_gathered):
            if not kept:
                m.reshard()


def _cast_floats(dtype, x):
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, x)


def _casting(dtype):
    def cast_inputs(module, args, kwargs):  # FSDP's MixedPrecisionPolicy.cast_forward_inputs
        return _cast_floats(dtype, args), _cast_floats(dtype, kwargs)
    return cast_inputs


def _casting_output(dtype):
    def cast_output(module, args, output):  # FSDP's MixedPrecisionPolicy.output_dtype
        return _cast_floats(dtype, output)
    return cast_output


@contextlib.contextmanager
def forward_replaced(module: torch.nn.Module, forward):
    """``forward`` in place of ``module``'s own forward, restored after."""
    had = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if had:
            module.forward = old
        else:
            del module.forward


def call_with_forward(module: torch.nn.Module, forward, *args):
    """``nn.Module.__call__(module, *args)`` (its hooks: FSDP's gather and free, DDP's)
    with ``forward`` in place of the module's own forward for this call."""
    with forward_replaced(module, forward), _traced_output_hooks_hidden(module):
        return torch.nn.Module.__call__(module, *args)


def check_hooks(model: torch.nn.Module, wrapper=None) -> None:
    """Refuse forward hooks (other than FSDP's) on the modules regional execution calls: the
    capture traced them into the graph, so calling the module would run them again."""
    mods = [("the model", model)] + [(f"block {n}", m) for n, m in find_blocks(model).items()]
    for what, m in mods:
        hooks = _non_fsdp_hooks(m)
        if hooks:
            raise TreeCompileError(
                f"regional execution: {what} ({type(m).__name__}) has forward hooks besides "
                f"FSDP's ({', '.join(getattr(h, '__qualname__', repr(h)) for h in hooks[:3])}); "
                "they were traced into the tree graph and would run twice. Remove them, or "
                "register them on a module inside the layer")
    glob = torch.nn.modules.module
    if getattr(glob, "_global_forward_hooks", None) or \
            getattr(glob, "_global_forward_pre_hooks", None):
        raise TreeCompileError("regional execution: global module forward hooks are "
                               "registered; they would run twice")
