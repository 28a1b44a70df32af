"""Loss recogniser: the cross-entropy on shifted logits/labels as a
:class:`treefx.compiler.sites.LossSite` (lowered into the weighted tree loss).

A training step written for ordinary batches computes ``F.cross_entropy`` of the logits at
position j against the label at j + 1, written either way:

- ``logits[:, :-1]`` against ``labels[:, 1:]`` (hand-written), or
- ``logits`` against ``pad(labels, (0, 1), value=-100)[..., 1:]`` (Hugging Face 5.x).

On a tree, the token before t is its tree predecessor ``parent_token[t]``, not t - 1. So the
shift by one becomes a gather at ``parent_token`` and the reduction becomes the tree's per-token
weights: ``Σ_t w_t · ℓ_t`` with w for the reduction the step asked for ("mean": each sequence's
mean over its own masked tokens; "sum": its sum), averaged over the sequences with their
weights. Anything the pass cannot prove equivalent raises an error naming the node.

In a part of a tree (:func:`treefx.backward`), the part predicts the tokens whose predecessor
it holds, its own and the first tokens of later parts: the gather reads the rows and ids of
the part's ``labels`` input and the weights are those tokens' (``tree_weights`` [2, m]).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph import (
    GraphContext,
    TreeCompileError,
    describe,
    example,
    is_call,
    module_path,
)
from ..sites import LossSite

__all__ = ["LINEAR", "projection_only_for", "sites", "strip_reshapes"]

_CE = (F.cross_entropy, torch.nn.functional.cross_entropy)
LINEAR = (F.linear, torch._C._nn.linear)
_RESHAPES = ("view", "reshape", "flatten", "contiguous", "float", "to", "type")
_RESHAPE_FUNCS = (torch.reshape, torch.flatten)


def _fail(node: fx.Node, why: str) -> TreeCompileError:
    return TreeCompileError(
        f"treefx cannot prove the loss at {module_path(node)} equivalent to per-sequence "
        f"training (graph node `{describe(node)}`): {why}",
        node=node,
    )


def strip_reshapes(node):
    """Skip reshapes, contiguous and dtype casts."""
    while isinstance(node, fx.Node) and (
        is_call(node, *_RESHAPE_FUNCS, methods=_RESHAPES)
    ):
        node = node.args[0]
    return node


def _seq_slice(node: fx.Node):
    """For ``x[..., a:b, ...]`` slicing only the sequence dim of a [1, N, ...] tensor, return
    (x, start, stop); else None. The sequence dim is dim 1 (or the last for a 2-D x)."""
    if not is_call(node, operator.getitem):
        return None
    base, key = node.args
    val = example(base)
    if val is None:
        return None
    key = key if isinstance(key, tuple) else (key,)
    seq_dim = 1 if val.dim() >= 2 else 0
    if val.dim() == 2 and Ellipsis in key:
        seq_dim = 1
    # Expand an Ellipsis to explicit full slices.
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (val.dim() - len(key) + 1) + key[i + 1:]
    key = key + (slice(None),) * (val.dim() - len(key))
    for d, k in enumerate(key):
        if d == seq_dim:
            if not isinstance(k, slice) or k.step not in (None, 1):
                return None
        elif k != slice(None):
            return None
    k = key[seq_dim]
    return base, k.start or 0, k.stop


def _match_logits(ctx: GraphContext, ce: fx.Node):
    """(the model's [1, N, V] logits node, shift) for the CE input; shift 1 means
    ``logits[:, :-1]``."""
    node = strip_reshapes(ce.args[0])
    shift = 0
    sl = _seq_slice(node)
    if sl is not None:
        base, start, stop = sl
        if start != 0 or stop != -1:
            raise _fail(ce, f"the logits are sliced [{start}:{stop}] along the sequence; only "
                            "[:-1] (a shift by one) is understood")
        node, shift = strip_reshapes(base), 1
    val = example(node)
    if val is None or val.dim() != 3 or not _is_seq(ctx, val.shape[1]):
        raise _fail(ce, "its input is not the model's [1, N, vocab] logits")
    return node, shift


def _match_target(ctx: GraphContext, ce: fx.Node, logits_shift: int):
    node = strip_reshapes(ce.args[1])
    sl = _seq_slice(node)
    if sl is None or sl[1] != 1 or sl[2] is not None:
        raise _fail(ce, "its target is not the labels shifted by one ([..., 1:])")
    base = strip_reshapes(sl[0])
    if is_call(base, F.pad, torch._C._nn.pad):
        pad = base.args[1] if len(base.args) > 1 else base.kwargs.get("pad")
        value = base.kwargs.get("value", base.args[3] if len(base.args) > 3 else 0)
        if tuple(pad) != (0, 1) or value != _ignore_index(ce):
            raise _fail(ce, f"its labels are padded by {pad} with {value!r}; expected (0, 1) "
                            "with the ignore index")
        if logits_shift != 0:
            raise _fail(ce, "both the logits and the padded labels are shifted: a shift of two")
        base = strip_reshapes(base.args[0])
    elif logits_shift != 1:
        raise _fail(ce, "the labels are shifted by one but the logits are not cut to [:-1]: "
                        "the positions do not line up")
    val = example(base)
    if val is None or val.dim() != 2 or not _is_seq(ctx, val.shape[1]):
        raise _fail(ce, "its target is not built from the batch's [1, N] labels or input_ids")
    return base


def _is_seq(ctx: GraphContext, size) -> bool:
    from ..graph import same_size

    return same_size(size, ctx.seq_len)


def _ignore_index(ce: fx.Node):
    return ce.kwargs.get("ignore_index", ce.args[4] if len(ce.args) > 4 else -100)


def _reduction(ce: fx.Node) -> str:
    red = ce.kwargs.get("reduction", ce.args[7] if len(ce.args) > 7 else "mean")
    if red not in ("mean", "sum"):
        raise _fail(ce, f"reduction={red!r}; only 'mean' and 'sum' have a per-sequence meaning")
    for name, pos, ok in (("weight", 2, None), ("label_smoothing", 8, 0.0)):
        v = ce.kwargs.get(name, ce.args[pos] if len(ce.args) > pos else ok)
        if v != ok:
            raise _fail(ce, f"{name}={v!r} is not supported yet")
    if _ignore_index(ce) != -100:
        raise _fail(ce, f"ignore_index={_ignore_index(ce)}; a TreeBatch marks untrained labels "
                        "with -100")
    return red


def projection_only_for(logits: fx.Node, ce: fx.Node):
    """(h, weight, bias) if ``logits = linear(h, weight, bias)`` feeds nothing but this
    cross-entropy (through reshapes, casts and the [:-1] cut), else None."""
    if not is_call(logits, *LINEAR):
        return None
    node = logits
    while node is not ce:
        if len(node.users) != 1:
            return None
        (node,) = node.users
        if node is not ce and not (is_call(node, *_RESHAPE_FUNCS, methods=_RESHAPES)
                                   or is_call(node, operator.getitem)):
            return None
    h, weight = logits.args[:2]
    bias = logits.args[2] if len(logits.args) > 2 else logits.kwargs.get("bias")
    return h, weight, bias


def _check_result_use(ce: fx.Node) -> None:
    """The CE value may only be scaled by constants on its way out: ``loss * c``, ``c * loss``,
    ``loss / c`` (and casts, copies). A computed value on the other side (dividing a sum by a
    token count computed from the batch, say) has no per-sequence meaning on a tree, and
    neither has dividing by the loss."""
    frontier = [ce]
    seen = set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output" or is_call(user, operator.getitem) or user.op == "call_function" \
                    and user.target in (tuple, list):
                continue
            operands = list(user.args) + list(user.kwargs.values())
            if is_call(user, operator.mul, torch.mul, methods=("mul",)):
                operands.remove(node)  # the loss on either side; the other must be a constant
            elif is_call(user, operator.truediv, torch.div, methods=("div",)):
                if not user.args or user.args[0] is not node:
                    raise _fail(ce, f"its value is the divisor in `{describe(user)}`; only a "
                                    "division of the loss by a constant is understood")
                if user.kwargs.get("rounding_mode") is not None:
                    raise _fail(ce, f"its value is rounded in `{describe(user)}`")
                operands.remove(node)
            elif is_call(user, methods=("float", "to", "clone")):
                operands.remove(node)
            elif is_call(user, operator.add, operator.iadd, torch.add, operator.sub,
                         operator.isub, torch.sub, methods=("add", "add_", "sub", "sub_")):
                raise _fail(ce, f"another loss is added to it in `{describe(user)}` (an "
                                "auxiliary loss, e.g. an MoE load-balancing loss with "
                                "output_router_logits=True?). That term is computed over the "
                                "tree's DFS row, where each shared token counts once, not per "
                                "sequence: return the cross-entropy alone and add such terms "
                                "outside the step")
            else:
                raise _fail(ce, f"its value feeds `{describe(user)}`")
            if any(isinstance(a, fx.Node) for a in operands):
                raise _fail(ce, f"its value is combined with a computed tensor in "
                                f"`{describe(user)}`")
            frontier.append(user)


def sites(ctx: GraphContext):
    """Every cross-entropy of a training step's graph (none outside steps), each checked and
    yielded in turn (lowered before the next is looked at)."""
    if not ctx.is_step:
        return
    for ce in [n for n in ctx.graph.nodes if is_call(n, *_CE)]:
        red = _reduction(ce)
        logits, shift = _match_logits(ctx, ce)
        _match_target(ctx, ce, shift)
        _check_result_use(ce)
        yield LossSite(ce, red, logits, projection_only_for(logits, ce))
