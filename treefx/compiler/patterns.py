"""The op families the recognisers match (softmax, matmul, casts, the elementwise ops of a
score chain, ...)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph import arg, example, is_call, same_size

__all__ = ["SDPA", "SOFTMAX", "MATMUL", "DROPOUT", "CASTS", "OTHER_ATTENTION", "POINTWISE",
           "OUT_OF_PLACE", "POINTWISE_METHODS", "MAX", "SCALINGS", "apply_scale", "constant",
           "feeds_matmul", "is_pointwise", "repeated_heads_source", "same_shape_view", "scale_step",
           "score_source"]

SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
SOFTMAX = (torch.softmax, F.softmax, torch.nn.functional.softmax, torch.special.softmax)
MATMUL = (torch.matmul, operator.matmul, torch.bmm)
DROPOUT = (F.dropout, torch.dropout, torch.nn.functional.dropout)
CASTS = ("to", "float", "type", "type_as", "half", "bfloat16", "double")
OTHER_ATTENTION = (
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    F.multi_head_attention_forward,
)


# Elementwise ops a model may apply to its scores before the softmax.
POINTWISE = (torch.mul, operator.mul, torch.div, operator.truediv, torch.add, operator.add,
             torch.sub, operator.sub, torch.neg, operator.neg, torch.tanh, torch.sigmoid,
             torch.clamp, torch.clip, torch.where, torch.masked_fill, F.tanh, F.sigmoid,
             operator.imul, operator.itruediv, operator.iadd, operator.isub)
# ``x *= c`` on the scores (Falcon): replayed out of place, on the op's own copy of the scores
# (a chain op has one user, so nothing else sees the update).
OUT_OF_PLACE = {operator.imul: operator.mul, operator.itruediv: operator.truediv,
                operator.iadd: operator.add, operator.isub: operator.sub}
POINTWISE_METHODS = ("mul", "div", "add", "sub", "neg", "tanh", "sigmoid", "clamp", "clip",
                     "clamp_min", "clamp_max", "masked_fill", *CASTS)
MAX = (torch.max, torch.amax)


def is_pointwise(node) -> bool:
    """An elementwise op a score chain may apply: those above, or the binary maximum
    (``torch.max(scores, floor)``, XGLM's clamp of its masked scores)."""
    if is_call(node, *POINTWISE, methods=POINTWISE_METHODS):
        return True
    if is_call(node, torch.maximum, methods=("maximum",)):
        return True
    other = arg(node, 1, "other")
    return is_call(node, torch.max, methods=("max",)) and isinstance(
        example(other), torch.Tensor)


def feeds_matmul(node: fx.Node) -> bool:
    """Whether a matmul (or einsum) reads ``node`` within a few steps."""
    return any(is_call(u, *MATMUL, methods=("matmul", "bmm")) or is_call(u, torch.einsum)
               for u in _downstream(node))


def _downstream(node: fx.Node, depth: int = 4):
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                yield u
                nxt.append(u)
        frontier = nxt


def constant(node) -> float | None:
    """A Python number, or a 0-d tensor made by ``torch.full([], c)`` / ``torch.tensor(c)``."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if is_call(node, torch.full) and tuple(arg(node, 0, "size")) == ():
        return constant(arg(node, 1, "fill_value"))
    if is_call(node, torch.tensor, torch.scalar_tensor):
        return constant(node.args[0])
    if is_call(node, methods=CASTS):
        return constant(node.args[0])
    return None


def same_shape_view(node: fx.Node) -> bool:
    """``x.view(shape of x)`` (Falcon views its attention weights to the shape they have)."""
    if not is_call(node, torch.reshape, methods=("view", "reshape")):
        return False
    a, b = example(node.args[0]), example(node)
    return (a is not None and b is not None and a.dim() == b.dim()
            and all(same_size(x, y) for x, y in zip(a.shape, b.shape)))


SCALINGS = (torch.mul, operator.mul, torch.div, operator.truediv, operator.imul,
             operator.itruediv)


def scale_step(node: fx.Node) -> tuple[float, bool, fx.Node] | None:
    """(constant, divides, scores) when ``node`` multiplies or divides the scores by a
    constant (``s * c``, ``c * s``, ``s / c``), else None."""
    a, b = node.args[:2]
    is_div = node.target in (torch.div, operator.truediv, operator.itruediv, "div")
    c, other = (constant(b), a) if constant(b) is not None else (constant(a), b)
    if c is None or (is_div and other is not a):
        return None
    return c, is_div, other


def apply_scale(scale: float, step: tuple[float, bool, fx.Node]) -> float:
    """``scale`` times or divided by the constant of a :func:`scale_step`."""
    c, is_div, _ = step
    return scale / c if is_div else scale * c


def repeated_heads_source(node) -> fx.Node | None:
    """``x`` when ``node`` is ``x`` [B, Hkv, N, D] with each head repeated ``r > 1`` times in
    place along dim 1, written as Hugging Face's ``repeat_kv``
    (``x[:, :, None].expand(B, Hkv, r, N, D).reshape(B, Hkv * r, N, D)``, or ``unsqueeze(2)``
    for the indexing) or as ``repeat_interleave(x, r, dim=1)``; else None. Every shape is
    checked on the example values, so a look-alike reshape is left alone."""
    out = example(node)
    if out is None or out.dim() != 4:
        return None
    if is_call(node, torch.repeat_interleave, methods=("repeat_interleave",)):
        x, reps = node.args[0], arg(node, 1, "repeats")
        dim = arg(node, 2, "dim")
        xv = example(x)
        if (isinstance(reps, int) and reps > 1 and dim in (1, -3) and xv is not None
                and xv.dim() == 4 and same_size(xv.shape[1] * reps, out.shape[1])):
            return x
        return None
    if not is_call(node, torch.reshape, methods=("reshape", "view")):
        return None
    expand = node.args[0]
    if not is_call(expand, methods=("expand",)):
        return None
    src = expand.args[0]
    if is_call(src, torch.unsqueeze, methods=("unsqueeze",)) and arg(src, 1, "dim") in (2, -3):
        x = src.args[0]
    elif (src.op == "call_function" and src.target is operator.getitem
          and isinstance(src.args[1], tuple) and len(src.args[1]) >= 3
          and src.args[1][2] is None
          and all(i == slice(None) for i in src.args[1][:2])
          and all(i in (slice(None), Ellipsis) for i in src.args[1][3:])):
        x = src.args[0]
    else:
        return None
    xv, ev = example(x), example(expand)
    if xv is None or ev is None or xv.dim() != 4 or ev.dim() != 5:
        return None
    b, h, n, d = xv.shape
    r = ev.shape[2]
    want = (b, h, r, n, d)
    if not all(same_size(a, w) for a, w in zip(ev.shape, want)):
        return None
    if not all(same_size(a, w) for a, w in zip(out.shape, (b, h * r, n, d))):
        return None
    if isinstance(r, int) and r < 2:
        return None
    return x


def score_source(node, memo: dict) -> fx.Node | None:
    """The matmul a value is computed from through elementwise ops only, or None."""
    if not isinstance(node, fx.Node):
        return None
    if node not in memo:
        memo[node] = None  # cycles cannot happen in a DAG, but keep the walk bounded
        if is_call(node, *MATMUL, methods=("matmul",)):
            memo[node] = node
        elif same_shape_view(node):
            memo[node] = score_source(node.args[0], memo)
        elif is_pointwise(node):
            found = {score_source(a, memo) for a in node.all_input_nodes} - {None}
            memo[node] = found.pop() if len(found) == 1 else None
    return memo[node]
