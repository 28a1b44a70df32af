"""Regional execution's structure keys: two graph pieces with equal keys (the decoder layers
of one type) share one compiled function."""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["getattr_path", "structure_key"]


def structure_key(gm: fx.GraphModule, fakes) -> tuple:
    """Everything a compiled piece depends on: its nodes (ops, targets, constants, wiring,
    higher-order bodies, recursively) and its inputs' kinds. Equal keys: one compiled piece
    serves both."""
    index: dict[fx.Node, int] = {}
    rows = []

    def arg(a):
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", arg(a.start), arg(a.stop), arg(a.step))
        return _object_key(a)

    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        target = n.target
        if n.op == "get_attr":
            sub = getattr_path(gm, target)
            target = structure_key(sub, ()) if isinstance(sub, fx.GraphModule) else \
                ("attr", id(sub))
        elif n.op == "placeholder":
            target = "placeholder"
        elif callable(target):
            target = _object_key(target)
        rows.append((n.op, target, arg(n.args), arg(n.kwargs)))
    kinds = []
    for f in fakes:
        if isinstance(f, torch.Tensor):
            kinds.append(("t", str(f.dtype), str(f.device), str(tuple(f.shape)),
                          str(f.stride()), bool(f.requires_grad)))
        else:
            kinds.append(("v", str(f)))
    return (tuple(rows), tuple(kinds))


# Per-site state of treefx's own call targets that does not change what they compute: the
# node name they were made for, and the layouts a site recorded while it was traced.
_NOT_CONFIG = frozenset({"__name__", "layouts"})


def _object_key(a, depth: int = 0):
    """A key equal for two objects that compute the same thing: values by value, treefx's own
    callables (an attention site, a recurrence site: one object per layer) by their
    configuration, recursively; anything else (functions, closures, tensors, modules) by
    identity."""
    if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device,
                      torch.layout, torch.memory_format)):
        return (type(a).__name__, repr(a))
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_object_key(x, depth + 1) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((repr(k), _object_key(v, depth + 1)) for k, v in a.items()))
    if isinstance(a, (set, frozenset)):
        return ("set", tuple(sorted(repr(_object_key(x, depth + 1)) for x in a)))
    if isinstance(a, fx.GraphModule):
        return ("graph", structure_key(a, ()))
    cls = type(a)
    if depth < 6 and cls.__module__.startswith("treefx.") and hasattr(a, "__dict__") \
            and not isinstance(a, torch.nn.Module):
        return ("treefx", cls.__module__, cls.__qualname__, tuple(
            (k, _object_key(v, depth + 1)) for k, v in sorted(vars(a).items())
            if k not in _NOT_CONFIG))
    return ("id", id(a), cls.__qualname__)


def getattr_path(obj, target: str):
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


