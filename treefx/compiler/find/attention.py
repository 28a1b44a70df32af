"""Attention recogniser: every attention in the graph as a
:class:`treefx.compiler.sites.AttentionSite` (lowered by :mod:`treefx.compiler.lower` into tree
attention over ``subtree_end``).

Matched forms:

- ``scaled_dot_product_attention`` (``is_causal``, a mask the model built, ``scale``, GQA);
- the eager pattern ``matmul(q, k^T) -> scale -> (+ mask) -> softmax (float32) ->
  (dropout p=0) -> matmul(., v)`` as Hugging Face's ``eager`` attention and hand-written models
  write it.

A mask the model built is kept, ANDed with the tree: the positions pass has already replaced
its index grids by path positions, so it is the model's mask (causal, sliding window, ...)
evaluated per sequence. For the eager backend it stays a dense tensor; for the inductor backend
it is lifted out of the graph into a FlexAttention ``mask_mod`` (see
:mod:`treefx.compiler.mask_lift`).

Whatever still looks like attention afterwards (a softmax over the last dim feeding a matmul)
is an :class:`UnmatchedAttentionError` naming the node and its module: running it over the DFS
row as it is would be silently wrong training.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import (
    GraphContext,
    UnmatchedAttentionError,
    arg,
    attention_error,
    describe,
    example,
    is_call,
    same_size,
)
from ..patterns import (
    CASTS,
    DROPOUT,
    MATMUL,
    MAX,
    SCALINGS,
    SDPA,
    SOFTMAX,
    apply_scale,
    feeds_matmul,
    same_shape_view,
    scale_step,
    score_source,
)
from ..registry import score_columns
from ..sites import AttentionSite, ScoreChain

__all__ = ["sites"]

_fail = attention_error


def _check_dropout(anchor: fx.Node, p, training=True) -> None:
    if isinstance(p, (int, float)) and (p == 0 or training is False):
        return
    raise _fail(anchor, f"attention dropout p={p!r} is on; tree attention applies none, so set "
                        "the attention dropout to 0 (or call model.eval())")


def _sdpa_site(node: fx.Node) -> AttentionSite:
    q, k, v = node.args[:3]
    _check_dropout(node, arg(node, 4, "dropout_p", 0.0))
    scale = arg(node, 6, "scale", None)
    if scale is not None and not isinstance(scale, (int, float)):
        raise _fail(node, "its scale is computed in the graph, not a constant")
    return AttentionSite(node, node, q, k, v, arg(node, 3, "attn_mask"), scale,
                 bool(arg(node, 7, "enable_gqa", False)), "sdpa")


def _strip_casts(node):
    while is_call(node, methods=CASTS) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _untranspose(node: fx.Node):
    """``k`` for ``k^T`` written as ``transpose(-2, -1)`` (any spelling) or ``.mT``."""
    val = example(node)
    if val is None:
        return None
    nd = val.dim()
    if is_call(node, torch.transpose, methods=("transpose",)):
        dims = {d % nd for d in node.args[1:3]}
        if dims == {nd - 2, nd - 1}:
            return node.args[0]
    if node.op == "call_function" and node.target is getattr and node.args[1] == "mT":
        return node.args[0]
    if is_call(node, torch.permute, methods=("permute",)):
        perm = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        perm = [p % nd for p in perm]
        if perm == [*range(nd - 2), nd - 1, nd - 2]:
            return node.args[0]
    return None


def _eager_site(softmax: fx.Node) -> AttentionSite | None:
    """Match matmul -> scale -> (+mask) -> softmax -> (cast, dropout) -> matmul, or None if
    this softmax is not followed by a matmul (not attention)."""
    val = example(softmax)
    dim = arg(softmax, 1, "dim", None)
    # Forward: softmax -> casts / dropout (/ the sink column dropped) -> matmul(attn, v).
    cur = softmax
    drop_last = False
    while True:
        if len(cur.users) != 1:
            if any(is_call(u, *MATMUL, methods=("matmul",)) for u in cur.users):
                raise _fail(softmax, "its attention weights are also used elsewhere (is the "
                                     "model returning attentions? set output_attentions=False)")
            return None
        (user,) = cur.users
        if is_call(user, methods=CASTS):
            cur = user
        elif is_call(user, *DROPOUT):
            _check_dropout(softmax, arg(user, 1, "p", 0.5), arg(user, 2, "training", True))
            cur = user
        elif same_shape_view(user):
            cur = user
        elif _drops_last_column(user) and not drop_last:
            drop_last = True
            cur = user
        elif is_call(user, *MATMUL, methods=("matmul",)) and user.args[0] is cur:
            out, v = user, user.args[1]
            break
        else:
            return None
    if val is None or dim is None or dim % val.dim() != val.dim() - 1:
        raise _fail(softmax, f"its softmax runs over dim {dim}, not the key dimension (last)")
    if drop_last or len(_strip_casts(softmax.args[0]).users) > 1 or _is_max_shift(
            _strip_casts(softmax.args[0])) is not None:
        # A sink column, a max subtracted, the scores read elsewhere (a log-sum-exp): the
        # general form.
        return _scored_site(softmax, out, v, drop_last)
    try:
        return _simple_site(softmax, out, v)
    except UnmatchedAttentionError as simple:
        try:
            return _scored_site(softmax, out, v, drop_last)
        except UnmatchedAttentionError:
            raise simple from None


def _simple_site(softmax: fx.Node, out: fx.Node, v: fx.Node) -> AttentionSite:
    """``softmax(scale * q @ k^T (+ mask))``: SDPA's own form."""
    # Backward: softmax input -> mask -> scale -> matmul(q, k^T).
    cur = _strip_casts(softmax.args[0])
    mask = None
    if is_call(cur, torch.add, operator.add, methods=("add",)):
        a, b = cur.args[:2]
        # The scores are the operand that reaches the q.k matmul; the other is the mask.
        mask, cur = (b, a) if _reaches_matmul(a) else (a, b)
    elif is_call(cur, torch.masked_fill, methods=("masked_fill",)):
        cond = cur.args[1]
        mask = ("not", cond)
        cur = cur.args[0]
    elif is_call(cur, torch.where) and _reaches_matmul(cur.args[1]):
        mask = ("keep", cur.args[0])
        cur = cur.args[1]
    scale = 1.0
    cur = _strip_casts(cur)
    while is_call(cur, *SCALINGS, methods=("mul", "div")):
        step = scale_step(cur)
        if step is None:
            raise _fail(softmax, f"its scores are scaled by a computed value ({describe(cur)})")
        scale = apply_scale(scale, step)
        cur = _strip_casts(step[2])
    if not is_call(cur, *MATMUL, methods=("matmul",)):
        raise _fail(softmax, f"the softmax input does not come from a q @ k^T matmul "
                             f"(found `{describe(cur)}`)")
    q, kt = cur.args[:2]
    k = _untranspose(kt)
    return AttentionSite(out, softmax, q, k if k is not None else kt, v, mask, scale, False,
                 "eager" if k is not None else "eager-kT")


def _drops_last_column(node: fx.Node) -> bool:
    """``x[..., :-1]`` (any spelling that keeps every other dim whole)."""
    if not is_call(node, operator.getitem):
        return False
    key = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    val, src = example(node), example(node.args[0])
    if not key or val is None or src is None or key[-1] != slice(None, -1, None):
        return False
    if not all(k is Ellipsis or k == slice(None) for k in key[:-1]):
        return False
    return Ellipsis in key or len(key) == src.dim()


def _is_max_shift(node) -> fx.Node | None:
    """``x`` when ``node`` is ``x - x.max(dim=-1, keepdim=True)`` (``.values``, ``[0]`` or
    ``amax``): a shift a softmax does not see (it subtracts its row's maximum itself)."""
    if not is_call(node, torch.sub, operator.sub, methods=("sub",)) or len(node.args) < 2:
        return None
    x, m = node.args[:2]
    if m.op == "call_function" and m.target in (getattr, operator.getitem) and (
            m.args[1] in ("values", 0)):
        m = m.args[0]
    if not is_call(m, *MAX, methods=("max", "amax")) or m.args[0] is not x:
        return None
    val = example(x)
    dim = arg(m, 1, "dim", None)
    keep = arg(m, 2, "keepdim", False)
    if val is None or not isinstance(dim, int) or dim % val.dim() != val.dim() - 1 or not keep:
        return None
    return x


def _scored_site(softmax: fx.Node, out: fx.Node, v: fx.Node, drop_last: bool) -> AttentionSite:
    """The general form: ``softmax(f(q @ k^T, masks...) [, sink])`` with any elementwise
    ``f`` (a ``tanh`` softcap, a bias, several masks), a subtracted row maximum, a sink
    column, and the model's own log-sum-exp of the same scores."""
    between = {softmax}  # nodes from the chain's end to the softmax
    x = softmax.args[0]
    while True:
        between.add(x)
        if is_call(x, methods=CASTS):
            x = x.args[0]
            continue
        shifted = _is_max_shift(x)
        if shifted is None:
            break
        between.update({x, *x.all_input_nodes, *x.args[1].all_input_nodes})
        x = shifted
    sink = None
    if is_call(x, torch.cat):
        column = next((c for c in (f(x) for f in score_columns()) if c is not None), None)
        if column is None:
            raise _fail(softmax, f"its scores are concatenated with `{describe(x)}`; treefx "
                                 "knows one extra column only (an attention sink)")
        between.add(x)
        sink, x = column
    between.add(x)
    if (sink is not None) != drop_last:
        raise _fail(softmax, "it adds a column to the scores (an attention sink?) but does not "
                             "drop it after the softmax, or drops one it did not add")
    memo: dict = {}
    scores = score_source(x, memo)
    if scores is None:
        raise _fail(softmax, f"the softmax input `{describe(x)}` is not computed from one "
                             "q @ k^T matmul by elementwise ops")
    chain, cur = [], x
    while cur is not scores:
        chain.append(cur)
        on = [a for a in cur.all_input_nodes if score_source(a, memo) is scores]
        if len(on) != 1:
            raise _fail(softmax, f"`{describe(cur)}` combines the scores with themselves")
        cur = on[0]
    chain.reverse()
    sv = example(scores)
    for n in chain:
        nv = example(n)
        if nv is None or nv.dim() != sv.dim() or not all(
                same_size(a, b) for a, b in zip(nv.shape, sv.shape)):
            raise _fail(softmax, f"`{describe(n)}` changes the shape of the scores")
    for n in chain[:-1] + ([scores] if chain else []):
        if len(n.users) != 1:
            raise _fail(softmax, f"the scores `{n.name}` are also used outside the attention")
    lse = [u for u in x.users if u not in between and is_call(u, torch.logsumexp,
                                                                methods=("logsumexp",))]
    for n in lse:
        if arg(n, 1, "dim", None) not in (-1, sv.dim() - 1) or arg(n, 2, "keepdim", False):
            raise _fail(n, "its log-sum-exp of the scores is not over the keys (last dim)")
    for n in between - {softmax}:
        # (An unused read, the indices of a max inside a checkpointed body, is dead code.)
        extra = [u for u in n.users if u not in between and u not in lse and u.users]
        if extra:
            raise _fail(softmax, f"its scores are also read by `{describe(extra[0])}`")
    q, kt = scores.args[:2]
    k = _untranspose(kt)
    return AttentionSite(out, softmax, q, k if k is not None else kt, v, None, 1.0, False,
                 "eager-scored" if k is not None else "eager-scored-kT",
                 scored=ScoreChain(scores, chain, sink, lse))


def _reaches_matmul(node, depth: int = 6) -> bool:
    """Whether ``node`` is (a scaled/cast form of) a matmul, within a few steps."""
    for _ in range(depth):
        if not isinstance(node, fx.Node):
            return False
        if is_call(node, *MATMUL, methods=("matmul",)):
            return True
        if is_call(node, methods=CASTS) or is_call(
            node, torch.mul, operator.mul, torch.div, operator.truediv, methods=("mul", "div")
        ):
            node = node.args[0] if isinstance(node.args[0], fx.Node) else node.args[1]
            continue
        return False
    return False


def sites(ctx: GraphContext) -> list[AttentionSite]:
    """Every attention of ``ctx``'s graph, found before any is lowered (a softmax that is
    not attention is recorded as kept)."""
    found = []
    for node in list(ctx.graph.nodes):
        if is_call(node, *SDPA):
            found.append(_sdpa_site(node))
        elif is_call(node, *SOFTMAX, methods=("softmax",)):
            site = _eager_site(node)
            if site is not None:
                found.append(site)
            elif not feeds_matmul(node):
                ctx.keep("attention", node, "a softmax that feeds no matmul with values: not "
                                            "attention (e.g. a router), correct per token as is")
    return found
