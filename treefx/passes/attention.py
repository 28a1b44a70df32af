"""Attention pass: every attention in the graph becomes tree attention over ``subtree_end``.

Matched forms:

- ``scaled_dot_product_attention`` (``is_causal``, a mask the model built, ``scale``, GQA);
- the eager pattern ``matmul(q, k^T) -> scale -> (+ mask) -> softmax (float32) ->
  (dropout p=0) -> matmul(., v)`` as Hugging Face's ``eager`` attention and hand-written models
  write it.

A mask the model built is kept, ANDed with the tree: the positions pass has already replaced
its index grids by path positions, so it is the model's mask (causal, sliding window, ...)
evaluated per sequence. For the eager backend it stays a dense tensor; for the inductor backend
it is lifted out of the graph into a FlexAttention ``mask_mod`` (see :mod:`.mask_lift`).

Whatever still looks like attention afterwards (a softmax over the last dim feeding a matmul)
is an :class:`UnmatchedAttentionError` naming the node and its module: running it over the DFS
row as it is would be silently wrong training.
"""

from __future__ import annotations


import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..mask import dense_tree_mask, tree_block_tensors
from ..ops.attention import (
    TreeFlexAttention,
    TreePartAttention,
    TreePartFlexAttention,
    TreeScoredAttention,
    ones_for_positions,
    sink_rescale,
    tree_attention_dense,
)
from .common import (
    KEY_SELECTION,
    GraphContext,
    UnmatchedAttentionError,
    arg,
    describe,
    example,
    is_call,
    module_path,
    same_size,
    set_example,
)
from .mask_lift import (
    _is_all_ones_input,
    LiftedScore,
    MaskLiftError,
    implied_by_tree,
    lift_mask,
    mask_applications,
    window_of,
    dense_side,
    lift_value,
)

__all__ = ["attention_pass", "check_no_attention_left"]

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_SOFTMAX = (torch.softmax, F.softmax, torch.nn.functional.softmax, torch.special.softmax)
_MATMUL = (torch.matmul, operator.matmul, torch.bmm)
_DROPOUT = (F.dropout, torch.dropout, torch.nn.functional.dropout)
_CASTS = ("to", "float", "type", "type_as", "half", "bfloat16", "double")
_OTHER_ATTENTION = (
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    F.multi_head_attention_forward,
)


@dataclass
class _Site:
    """One attention to rewrite: ``out`` is replaced by attention(q, k, v) with the tree."""

    out: fx.Node
    anchor: fx.Node  # the node that names the site in reports (sdpa call or softmax)
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None  # model mask, boolean or additive
    scale: float | None
    enable_gqa: bool
    kind: str
    scored: _Scored | None = None  # scores the model transforms itself (softcap, sink, ...)


@dataclass
class _Scored:
    """What a model does to its scores between ``q @ k^T`` and the softmax, and around it.

    ``chain``: the elementwise ops from the matmul ``scores`` to the softmax input, in order,
    each reading the previous one and ``sides`` (masks, biases: tensors that do not depend on
    the scores). ``sink``: a [B, H, N, 1] logit concatenated as one more key and dropped
    after the softmax. ``lse``: the model's own ``logsumexp`` over the same scores (a sink
    applied as ``sigmoid(lse - sink)``)."""

    scores: fx.Node
    chain: list[fx.Node]
    sink: fx.Node | None
    lse: list[fx.Node]



def _fail(node: fx.Node, why: str) -> UnmatchedAttentionError:
    return UnmatchedAttentionError(
        f"treefx cannot rewrite the attention at {module_path(node)} (graph node "
        f"`{describe(node)}`): {why}. Running it unchanged over the tree's DFS row would mix "
        "sequences, so compilation stops here.",
        node=node,
    )


def _check_dropout(anchor: fx.Node, p, training=True) -> None:
    if isinstance(p, (int, float)) and (p == 0 or training is False):
        return
    raise _fail(anchor, f"attention dropout p={p!r} is on; tree attention applies none, so set "
                        "the attention dropout to 0 (or call model.eval())")


def _sdpa_site(node: fx.Node) -> _Site:
    q, k, v = node.args[:3]
    _check_dropout(node, arg(node, 4, "dropout_p", 0.0))
    scale = arg(node, 6, "scale", None)
    if scale is not None and not isinstance(scale, (int, float)):
        raise _fail(node, "its scale is computed in the graph, not a constant")
    return _Site(node, node, q, k, v, arg(node, 3, "attn_mask"), scale,
                 bool(arg(node, 7, "enable_gqa", False)), "sdpa")


def _constant(node) -> float | None:
    """A Python number, or a 0-d tensor made by ``torch.full([], c)`` / ``torch.tensor(c)``."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if is_call(node, torch.full) and tuple(arg(node, 0, "size")) == ():
        return _constant(arg(node, 1, "fill_value"))
    if is_call(node, torch.tensor, torch.scalar_tensor):
        return _constant(node.args[0])
    if is_call(node, methods=_CASTS):
        return _constant(node.args[0])
    return None


def _strip_casts(node):
    while is_call(node, methods=_CASTS) and isinstance(node.args[0], fx.Node):
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


def _eager_site(softmax: fx.Node) -> _Site | None:
    """Match matmul -> scale -> (+mask) -> softmax -> (cast, dropout) -> matmul, or None if
    this softmax is not followed by a matmul (not attention)."""
    val = example(softmax)
    dim = arg(softmax, 1, "dim", None)
    # Forward: softmax -> casts / dropout (/ the sink column dropped) -> matmul(attn, v).
    cur = softmax
    drop_last = False
    while True:
        if len(cur.users) != 1:
            if any(is_call(u, *_MATMUL, methods=("matmul",)) for u in cur.users):
                raise _fail(softmax, "its attention weights are also used elsewhere (is the "
                                     "model returning attentions? set output_attentions=False)")
            return None
        (user,) = cur.users
        if is_call(user, methods=_CASTS):
            cur = user
        elif is_call(user, *_DROPOUT):
            _check_dropout(softmax, arg(user, 1, "p", 0.5), arg(user, 2, "training", True))
            cur = user
        elif _same_shape_view(user):
            cur = user
        elif _drops_last_column(user) and not drop_last:
            drop_last = True
            cur = user
        elif is_call(user, *_MATMUL, methods=("matmul",)) and user.args[0] is cur:
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


def _simple_site(softmax: fx.Node, out: fx.Node, v: fx.Node) -> _Site:
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
    while is_call(cur, *_SCALINGS, methods=("mul", "div")):
        step = _scale_step(cur)
        if step is None:
            raise _fail(softmax, f"its scores are scaled by a computed value ({describe(cur)})")
        scale = _apply(scale, step)
        cur = _strip_casts(step[2])
    if not is_call(cur, *_MATMUL, methods=("matmul",)):
        raise _fail(softmax, f"the softmax input does not come from a q @ k^T matmul "
                             f"(found `{describe(cur)}`)")
    q, kt = cur.args[:2]
    k = _untranspose(kt)
    return _Site(out, softmax, q, k if k is not None else kt, v, mask, scale, False,
                 "eager" if k is not None else "eager-kT")


# Elementwise ops a model may apply to its scores before the softmax.
_POINTWISE = (torch.mul, operator.mul, torch.div, operator.truediv, torch.add, operator.add,
              torch.sub, operator.sub, torch.neg, operator.neg, torch.tanh, torch.sigmoid,
              torch.clamp, torch.clip, torch.where, torch.masked_fill, F.tanh, F.sigmoid,
              operator.imul, operator.itruediv, operator.iadd, operator.isub)
# ``x *= c`` on the scores (Falcon): replayed out of place, on the op's own copy of the scores
# (a chain op has one user, so nothing else sees the update).
_OUT_OF_PLACE = {operator.imul: operator.mul, operator.itruediv: operator.truediv,
                 operator.iadd: operator.add, operator.isub: operator.sub}
_POINTWISE_METHODS = ("mul", "div", "add", "sub", "neg", "tanh", "sigmoid", "clamp", "clip",
                      "clamp_min", "clamp_max", "masked_fill", *_CASTS)
_MAX = (torch.max, torch.amax)


def is_pointwise(node) -> bool:
    """An elementwise op a score chain may apply: those above, or the binary maximum
    (``torch.max(scores, floor)``, XGLM's clamp of its masked scores)."""
    if is_call(node, *_POINTWISE, methods=_POINTWISE_METHODS):
        return True
    if is_call(node, torch.maximum, methods=("maximum",)):
        return True
    other = arg(node, 1, "other")
    return is_call(node, torch.max, methods=("max",)) and isinstance(
        example(other), torch.Tensor)


def _same_shape_view(node: fx.Node) -> bool:
    """``x.view(shape of x)`` (Falcon views its attention weights to the shape they have)."""
    if not is_call(node, torch.reshape, methods=("view", "reshape")):
        return False
    a, b = example(node.args[0]), example(node)
    return (a is not None and b is not None and a.dim() == b.dim()
            and all(same_size(x, y) for x, y in zip(a.shape, b.shape)))


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
    if not is_call(m, *_MAX, methods=("max", "amax")) or m.args[0] is not x:
        return None
    val = example(x)
    dim = arg(m, 1, "dim", None)
    keep = arg(m, 2, "keepdim", False)
    if val is None or not isinstance(dim, int) or dim % val.dim() != val.dim() - 1 or not keep:
        return None
    return x


def _score_source(node, memo: dict) -> fx.Node | None:
    """The matmul a value is computed from through elementwise ops only, or None."""
    if not isinstance(node, fx.Node):
        return None
    if node not in memo:
        memo[node] = None  # cycles cannot happen in a DAG, but keep the walk bounded
        if is_call(node, *_MATMUL, methods=("matmul",)):
            memo[node] = node
        elif _same_shape_view(node):
            memo[node] = _score_source(node.args[0], memo)
        elif is_pointwise(node):
            found = {_score_source(a, memo) for a in node.all_input_nodes} - {None}
            memo[node] = found.pop() if len(found) == 1 else None
    return memo[node]


def _scored_site(softmax: fx.Node, out: fx.Node, v: fx.Node, drop_last: bool) -> _Site:
    """The general form: ``softmax(f(q @ k^T, masks...) [, sink])`` with any elementwise
    ``f`` (a ``tanh`` softcap, a bias, several masks), a subtracted row maximum, a sink
    column, and the model's own log-sum-exp of the same scores."""
    between = {softmax}  # nodes from the chain's end to the softmax
    x = softmax.args[0]
    while True:
        between.add(x)
        if is_call(x, methods=_CASTS):
            x = x.args[0]
            continue
        shifted = _is_max_shift(x)
        if shifted is None:
            break
        between.update({x, *x.all_input_nodes, *x.args[1].all_input_nodes})
        x = shifted
    sink = None
    if is_call(x, torch.cat):
        parts, dim = arg(x, 0, "tensors"), arg(x, 1, "dim", 0)
        sv = example(parts[1]) if len(parts) == 2 else None
        if (sv is None or not isinstance(dim, int) or dim % sv.dim() != sv.dim() - 1
                or not same_size(sv.shape[-1], 1) or _score_source(parts[1], {}) is not None):
            raise _fail(softmax, f"its scores are concatenated with `{describe(x)}`; treefx "
                                 "knows one extra column only (an attention sink)")
        between.add(x)
        sink, x = parts[1], parts[0]
    between.add(x)
    if (sink is not None) != drop_last:
        raise _fail(softmax, "it adds a column to the scores (an attention sink?) but does not "
                             "drop it after the softmax, or drops one it did not add")
    memo: dict = {}
    scores = _score_source(x, memo)
    if scores is None:
        raise _fail(softmax, f"the softmax input `{describe(x)}` is not computed from one "
                             "q @ k^T matmul by elementwise ops")
    chain, cur = [], x
    while cur is not scores:
        chain.append(cur)
        on = [a for a in cur.all_input_nodes if _score_source(a, memo) is scores]
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
    return _Site(out, softmax, q, k if k is not None else kt, v, None, 1.0, False,
                 "eager-scored" if k is not None else "eager-scored-kT",
                 scored=_Scored(scores, chain, sink, lse))


def _sides(chain: list[fx.Node], scores: fx.Node) -> list[fx.Node]:
    """The tensors the chain reads besides the scores, in first-use order."""
    on = {scores, *chain}
    out: list[fx.Node] = []
    for n in chain:
        if not _same_shape_view(n):  # its sizes are not tensors the chain reads
            out.extend(a for a in n.all_input_nodes if a not in on and a not in out)
    return out


def _chain_module(chain: list[fx.Node], scores: fx.Node, sides: list[fx.Node]):
    """The chain as a function ``(scores, *sides) -> softmax input``, the model's own ops."""
    g = fx.Graph()
    env = {scores: g.placeholder("scores")}
    for i, side in enumerate(sides):
        env[side] = g.placeholder(f"side_{i}")
    for n in chain:
        env[n] = env[n.args[0]] if _same_shape_view(n) else g.node_copy(n, lambda a: env[a])
        if env[n].op == "call_function" and env[n].target in _OUT_OF_PLACE:
            env[n].target = _OUT_OF_PLACE[env[n].target]
    g.output(env[chain[-1]] if chain else env[scores])
    return fx.GraphModule(torch.nn.Module(), g, class_name="ScoreChain")


def _peel_mask(ctx: GraphContext, chain: list[fx.Node]):
    """(chain without its last op, boolean mask node) when the last op masks the scores
    (``+ where(allowed, 0, -inf)``, ``masked_fill(blocked, -inf)``, ``where(allowed, s,
    -inf)``: :func:`mask_applications`), which a FlexAttention ``mask_mod`` does with block
    sparsity; else (chain, None)."""
    if not chain:
        return chain, None
    last, prev = chain[-1], (chain[-2] if len(chain) > 1 else None)

    def is_prev(a):
        return a is prev if prev is not None else (
            isinstance(a, fx.Node) and is_call(a, *_MATMUL, methods=("matmul",)))

    for scores, how, mask in mask_applications(ctx, last):
        if not is_prev(scores) or how == "additive" and not isinstance(mask, fx.Node):
            continue
        if how == "blocked":
            with ctx.graph.inserting_before(last):
                return chain[:-1], ctx.graph.call_function(torch.logical_not, (mask,))
        return chain[:-1], mask
    return chain, None


def _reaches_matmul(node, depth: int = 6) -> bool:
    """Whether ``node`` is (a scaled/cast form of) a matmul, within a few steps."""
    for _ in range(depth):
        if not isinstance(node, fx.Node):
            return False
        if is_call(node, *_MATMUL, methods=("matmul",)):
            return True
        if is_call(node, methods=_CASTS) or is_call(
            node, torch.mul, operator.mul, torch.div, operator.truediv, methods=("mul", "div")
        ):
            node = node.args[0] if isinstance(node.args[0], fx.Node) else node.args[1]
            continue
        return False
    return False


def _mask_value(ctx: GraphContext, site: _Site):
    """The model mask as a node: boolean (True = may attend) or additive float."""
    m = site.mask
    if isinstance(m, tuple):
        how, cond = m
        if how == "not":
            with ctx.graph.inserting_before(site.out):
                return ctx.graph.call_function(torch.logical_not, (cond,))
        return cond
    return m


def _check_mask_sources(ctx: GraphContext, site: _Site, mask: fx.Node) -> None:
    """A model mask may see the tree only through the positions pass's grids.

    A mask computed from ``position_ids`` some other way (Hugging Face infers packed documents
    from jumps in them) would, on the DFS row, cut a child node off from its parent's tokens.
    """
    stack, seen = [ctx.resolve(mask)], set()
    while stack:
        n = stack.pop()
        if n in seen or ctx.is_tree_input(n, "positions") or n.meta.get(KEY_SELECTION):
            continue  # (a key selection: the keys an indexer picked, per sequence)
        seen.add(n)
        if ctx.is_tree_input(n, "tree_info") or ctx.is_tree_input(n, "tree_weights"):
            from .tokens import DATA, _Taint

            if DATA in _Taint(ctx).of(mask):
                raise _fail(site.anchor, "its attention mask is computed from the tokens' hidden "
                                         "states (a learned or sparse-attention mask: keys chosen "
                                         "by top-k of an indexer's scores, a dynamic mask), which "
                                         "treefx cannot evaluate per sequence yet")
            raise _fail(site.anchor, "its attention mask is computed from the positions in a way "
                                     "other than index grids (packed-sequence detection from "
                                     "position_ids?), which cannot be evaluated per sequence; "
                                     "pass attention_mask to the model")
        stack.extend(ctx.resolve(a) for a in n.all_input_nodes)


def _repeated_heads_source(node) -> fx.Node | None:
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


def _kv_for_flex(site: _Site, k: fx.Node):
    """The key and value FlexAttention reads: the model's own KV heads when it repeated them
    for its query heads (FlexAttention shares a KV head between its query heads itself: no
    repeat copies, and dK/dV come out per KV head instead of being summed over copies)."""
    if k is not site.k:  # a transpose inserted by the pass
        return k, site.v, False
    k0, v0 = _repeated_heads_source(k), _repeated_heads_source(site.v)
    if k0 is None or v0 is None:
        return k, site.v, False
    if not same_size(example(k0).shape[1], example(v0).shape[1]):
        return k, site.v, False
    return k0, v0, True


def _rewrite_scored(ctx: GraphContext, site: _Site) -> fx.Node:
    """The general form: the model's own score ops replayed, the tree mask applied to the
    softmax input, a sink or the model's log-sum-exp from the attention's log-sum-exp."""
    g = ctx.graph
    sc = site.scored
    note = site.kind + ", the model's score ops replayed"
    # Before the first reader: the model's log-sum-exp may be read before its attention.
    order = {n: i for i, n in enumerate(g.nodes)}
    first = min([site.out, *sc.lse], key=order.__getitem__)
    late = [a for a in (sc.scores, site.v, sc.sink) if a is not None and order[a] > order[first]]
    if late:
        raise _fail(site.anchor, f"its log-sum-exp is read before `{late[0].name}` is computed")
    with g.inserting_before(first):
        if ctx.part is not None:
            pair, more = _scored_part(ctx, site)
            note += more
        elif ctx.backend == "eager":
            tree = ctx.shared("dense_tree_mask",
                              lambda c: c.graph.call_function(dense_tree_mask, (c.subtree_end,)))
            sides = _sides(sc.chain, sc.scores)
            fn = TreeScoredAttention(_chain_module(sc.chain, sc.scores, sides),
                                     name=f"tree_scored_attention_{site.anchor.name}")
            pair = g.call_function(fn, (sc.scores, site.v, tree, *sides))
        else:
            pair, more = _scored_flex(ctx, site)
            note += more
        out = g.call_function(operator.getitem, (pair, 0))
        lse = g.call_function(operator.getitem, (pair, 1))
        if sc.sink is not None:
            out = g.call_function(sink_rescale, (out, lse, sc.sink))
            note += ", sink from the log-sum-exp"
        for n in sc.lse:
            n.replace_all_uses_with(g.call_method("to", (lse, example(n).dtype)))
            note += ", the model's log-sum-exp from the attention's"
    out.meta.update({k_: v_ for k_, v_ in site.out.meta.items()
                     if k_ in ("nn_module_stack", "stack_trace", "example_value")})
    ctx.record("attention", site.anchor, describe(pair), note=note)
    site.out.replace_all_uses_with(out)
    return out


def _scored_flex(ctx: GraphContext, site: _Site):
    """FlexAttention for the general form: the score ops as a ``score_mod`` (their masks and
    biases evaluated at path positions), a final mask as the ``mask_mod``."""
    g = ctx.graph
    mods = _score_mods(ctx, site)
    k = site.k
    if site.kind.endswith("-kT"):
        k = g.call_method("transpose", (k, -2, -1))
    blocks = _block_nodes(ctx, full=mods.mask is None, window=mods.window)
    fn = TreeFlexAttention(scale=mods.scale, block_size=ctx.block_size,
                           model_mask=mods.mask, score_mod=mods.score_mod,
                           mask_buffers=len(mods.mask_bufs), return_lse=True,
                           kernel_options=ctx.kernel_options,
                           interleave_heads=ctx.interleave_heads if mods.score_mod is None
                           else False,
                           name=f"tree_flex_attention_{site.anchor.name}")
    k, v, shared_kv = _kv_for_flex(site, k)
    note = mods.note
    if shared_kv:
        note += ", KV heads shared by FlexAttention (the model's repeat undone)"
    bufs = tuple(ctx.local(b) for b in (*mods.mask_bufs, *mods.score_bufs))
    return g.call_function(fn, (site.q, k, v, *blocks, *bufs)), note


def _scored_part(ctx: GraphContext, site: _Site):
    """The general form in a part's graph (:func:`treefx.backward`): FlexAttention over
    ``[context; part]`` keys (its dense eager form on the eager backend), the score ops as a
    ``score_mod`` and a final mask as the ``mask_mod``, both evaluated at the extended row's
    path positions, so a softcap, a bias or a window reads the context's keys as the
    sequence would."""
    g = ctx.graph
    part = ctx.part
    mods = _score_mods(ctx, site, in_part=True)
    k = site.k
    if site.kind.endswith("-kT"):
        k = g.call_method("transpose", (k, -2, -1))
    k, v, shared_kv = _kv_for_flex(site, k)
    ck, cv = _part_context(ctx, site, k, v)
    se, pos = part.ext(ctx, "subtree_end"), part.ext(ctx, "positions")
    fn = TreePartFlexAttention(scale=mods.scale, block_size=ctx.block_size,
                               model_mask=mods.mask, kernel_options=ctx.kernel_options,
                               score_mod=mods.score_mod, mask_buffers=len(mods.mask_bufs),
                               return_lse=True,
                               interleave_heads=ctx.interleave_heads, window=mods.window,
                               name=f"tree_part_flex_attention_{site.anchor.name}")
    bufs = _part_buffers(ctx, (*mods.mask_bufs, *mods.score_bufs))
    note = mods.note + ", keys and values of earlier parts' context"
    return g.call_function(fn, (site.q, k, v, ck, cv, se, pos, *bufs)), note


@dataclass
class _ScoreMods:
    """A scored site's FlexAttention pieces: the scale, the mask_mod and score_mod (lifted
    to path positions) and the buffers each reads; the mask's window, if it has one."""

    scale: float
    mask: object
    mask_bufs: tuple
    score_mod: object
    score_bufs: tuple
    note: str
    window: int | None = None  # the mask's window (:func:`window_of`)


def _score_mods(ctx: GraphContext, site: _Site, in_part: bool = False) -> _ScoreMods:
    sc = site.scored
    chain, mask = _peel_mask(ctx, sc.chain)
    note = ""
    lifted, mask_bufs = None, ()
    if mask is not None:
        _check_mask_sources(ctx, site, mask)
        try:
            lifted, mask_bufs = lift_mask(ctx, mask)
        except MaskLiftError:
            chain, lifted = sc.chain, None  # a bias, not a mask: it stays a score op
        if lifted is not None and implied_by_tree(lifted, mask_bufs):
            lifted, mask_bufs = None, ()
            note += ", model mask implied by the tree"
        elif lifted is not None:
            note += ", model mask kept (evaluated at path positions)"
    scale, rest = _constant_scale(chain)
    if not rest:  # only a constant scale is left: FlexAttention's own, no score_mod
        chain = []
        note += ", scores scaled by FlexAttention"
    sides = _sides(chain, sc.scores)
    lifted_sides, score_bufs = [], []
    for side in sides:
        _check_mask_sources(ctx, site, side)
        try:
            # in parts, a function of positions only: read where the model computed it, a
            # side has no entries for the context's keys
            one, bufs = _side_for_flex(ctx, side, dense=not in_part)
        except MaskLiftError as e:
            where = ("in parts (treefx.backward) at the positions of earlier parts' keys"
                     if in_part else "per query and key position")
            raise _fail(site.anchor, f"its scores read `{describe(side)}`, which cannot be "
                                     f"evaluated {where} ({e}); use "
                                     + ("whole batches" if in_part else "backend='eager'")
                                     + " for this model") from None
        lifted_sides.append((one, len(bufs)))
        score_bufs.extend(bufs)
    score_mod = LiftedScore(_chain_module(chain, sc.scores, sides), lifted_sides) \
        if chain else None
    if score_mod is not None:
        note += ", score ops as the score_mod"
    window, more = _window(lifted)
    return _ScoreMods(scale if chain == [] else 1.0, lifted, tuple(mask_bufs), score_mod,
                      tuple(score_bufs), note + more, window)


def _window(lifted) -> tuple[int | None, str]:
    """The lifted mask's window (:func:`window_of`: key blocks beyond it are left out) and
    the note that says so."""
    window = window_of(lifted)
    return window, "" if window is None else f", key blocks beyond its window ({window}) left out"


def _constant_scale(chain: list[fx.Node]) -> tuple[float, list[fx.Node]]:
    """(scale, remaining ops) when the chain starts with multiplications or divisions of the
    scores by constants (and casts): their product, and the ops after them."""
    scale, i = 1.0, 0
    for n in chain:  # each op reads the one before it (a chain has one score input per op)
        if not is_call(n, methods=_CASTS):
            step = _scale_step(n) if is_call(n, *_SCALINGS, methods=("mul", "div")) else None
            if step is None:
                break
            scale = _apply(scale, step)
        i += 1
    return scale, chain[i:]


_SCALINGS = (torch.mul, operator.mul, torch.div, operator.truediv, operator.imul,
             operator.itruediv)


def _scale_step(node: fx.Node) -> tuple[float, bool, fx.Node] | None:
    """(constant, divides, scores) when ``node`` multiplies or divides the scores by a
    constant (``s * c``, ``c * s``, ``s / c``), else None."""
    a, b = node.args[:2]
    is_div = node.target in (torch.div, operator.truediv, operator.itruediv, "div")
    c, other = (_constant(b), a) if _constant(b) is not None else (_constant(a), b)
    if c is None or (is_div and other is not a):
        return None
    return c, is_div, other


def _apply(scale: float, step: tuple[float, bool, fx.Node]) -> float:
    c, is_div, _ = step
    return scale / c if is_div else scale * c


def _rewrite(ctx: GraphContext, site: _Site) -> fx.Node:
    if site.scored is not None:
        return _rewrite_scored(ctx, site)
    if ctx.part is not None:
        return _rewrite_part(ctx, site)
    g = ctx.graph
    k = site.k
    with g.inserting_before(site.out):
        if site.kind == "eager-kT":
            k = g.call_method("transpose", (k, -2, -1))
        mask = _mask_value(ctx, site) if site.mask is not None else None
        note = site.kind
        lifted, bufs, lift_error = None, (), None
        if mask is not None:
            _check_mask_sources(ctx, site, mask)
            try:
                lifted, bufs = lift_mask(ctx, mask)
            except MaskLiftError as e:
                lift_error = e
            if lifted is not None and implied_by_tree(lifted, bufs):
                # Causal in positions: the tree mask implies it. Dropping it keeps the
                # tree's full blocks (no mask_mod work there) and the dense mask small.
                mask, lifted, bufs = None, None, ()
                note += ", model mask implied by the tree"
            elif mask is not None:
                note += ", model mask kept (evaluated at path positions)"
            bufs = tuple(ctx.local(b) for b in bufs)
        if ctx.backend == "eager":
            tree = ctx.shared("dense_tree_mask",
                              lambda c: c.graph.call_function(dense_tree_mask, (c.subtree_end,)))
            new = g.call_function(
                tree_attention_dense, (site.q, k, site.v, tree, mask),
                {"scale": site.scale, "enable_gqa": site.enable_gqa},
            )
        else:
            score_mod, score_bufs = None, ()
            if mask is not None and lifted is None:
                # An additive mask that carries a bias (Falcon adds its ALiBi into it): the
                # bias at path positions, added to the scores by a score_mod.
                try:
                    value, vbufs = _side_for_flex(ctx, mask)
                except MaskLiftError as e:
                    raise _fail(site.anchor, f"its model-built attention mask cannot be lifted "
                                             f"into a FlexAttention mask_mod ({lift_error}) nor "
                                             f"a score_mod ({e}); use backend='eager' for this "
                                             "model") from None
                score_mod = LiftedScore(_add_bias, [(value, len(vbufs))])
                score_bufs = tuple(ctx.local(b) for b in vbufs)
                note += (", applied to the scores by the score_mod"
                         if example(mask).dtype == torch.bool
                         else ", added to the scores by the score_mod")
            window, more = _window(lifted)
            note += more
            blocks = _block_nodes(ctx, full=lifted is None, window=window)
            fn = TreeFlexAttention(scale=site.scale, block_size=ctx.block_size,
                                   model_mask=lifted, kernel_options=ctx.kernel_options,
                                   interleave_heads=ctx.interleave_heads,
                                   score_mod=score_mod, mask_buffers=len(bufs),
                                   name=f"tree_flex_attention_{site.anchor.name}")
            k, v, shared_kv = _kv_for_flex(site, k)
            if shared_kv:
                note += ", KV heads shared by FlexAttention (the model's repeat undone)"
            kv = example(k)
            if ctx.interleave_heads is not False and (kv is None or kv.shape[1] != 1) and (
                    score_mod is None):
                note += (", KV heads interleaved along the row"
                         + (" where gradients are computed" if ctx.interleave_heads is None
                            else ""))
            new = g.call_function(fn, (site.q, k, v, *blocks, *bufs, *score_bufs))
    new.meta.update({k_: v_ for k_, v_ in site.out.meta.items()
                     if k_ in ("nn_module_stack", "stack_trace", "example_value")})
    ctx.record("attention", site.anchor, describe(new), note=note)
    site.out.replace_all_uses_with(new)
    return new


def _rewrite_part(ctx: GraphContext, site: _Site) -> fx.Node:
    """A site in a part's graph (:func:`treefx.backward`): its queries attend over the
    context's keys and values (from earlier parts) and its own; its own are handed on. The
    model's mask, if any, is lifted and evaluated at the extended row's positions."""
    g = ctx.graph
    part = ctx.part
    with g.inserting_before(site.out):
        k = site.k
        if site.kind == "eager-kT":
            k = g.call_method("transpose", (k, -2, -1))
        mask = _mask_value(ctx, site) if site.mask is not None else None
        note = site.kind + ", keys and values of earlier parts' context"
        lifted, bufs = None, ()
        if mask is not None:
            _check_mask_sources(ctx, site, mask)
            try:
                lifted, bufs = lift_mask(ctx, mask)
            except MaskLiftError as e:
                raise _fail(site.anchor, "in parts (treefx.backward) the model's own mask is "
                                         "evaluated for keys of earlier parts, and this one "
                                         f"cannot be ({e})") from None
            if implied_by_tree(lifted, bufs):
                lifted, bufs = None, ()
                note += ", model mask implied by the tree"
            else:
                note += ", model mask kept (evaluated at path positions)"
                bufs = _part_buffers(ctx, bufs)
        k, v, shared_kv = _kv_for_flex(site, k)
        ck, cv = _part_context(ctx, site, k, v)
        se, pos = part.ext(ctx, "subtree_end"), part.ext(ctx, "positions")
        if ctx.backend == "eager":
            fn = TreePartAttention(scale=site.scale, enable_gqa=site.enable_gqa or shared_kv,
                                   model_mask=lifted,
                                   name=f"tree_part_attention_{site.anchor.name}")
        else:
            window, more = _window(lifted)
            note += more
            fn = TreePartFlexAttention(scale=site.scale, block_size=ctx.block_size,
                                       model_mask=lifted, kernel_options=ctx.kernel_options,
                                       interleave_heads=ctx.interleave_heads, window=window,
                                       name=f"tree_part_flex_attention_{site.anchor.name}")
        new = g.call_function(fn, (site.q, k, v, ck, cv, se, pos, *bufs))
    new.meta.update({k_: v_ for k_, v_ in site.out.meta.items()
                     if k_ in ("nn_module_stack", "stack_trace", "example_value")})
    ctx.record("attention", site.anchor, describe(new), note=note)
    site.out.replace_all_uses_with(new)
    return new


def _part_context(ctx: GraphContext, site: _Site, k: fx.Node, v: fx.Node):
    """The context's keys and values of a part's site [1, heads, A, dim] (``k`` and ``v``
    the part's own, registered to be handed on)."""
    kv, vv = example(k), example(v)
    if kv is None or vv is None or kv.dim() != 4 or not same_size(kv.shape[0], 1):
        raise _fail(site.anchor, "in parts (treefx.backward) keys must be [1, heads, "
                                 "tokens, dim]")
    hk, dk, dv = int(kv.shape[1]), int(kv.shape[3]), int(vv.shape[3])
    return ctx.part.context(ctx, k, hk, dk), ctx.part.context(ctx, v, hk, dv)


def _part_buffers(ctx: GraphContext, bufs) -> tuple:
    """A part's mask and score buffers in ``ctx``'s graph. The all-ones padding mask treefx
    gives the model is read at positions of the extended row, which may pass the part's own
    length: it becomes all ones of that length."""
    pos = ctx.part.ext(ctx, "positions")
    return tuple(ctx.graph.call_function(ones_for_positions, (pos, ctx.local(b)))
                 if _is_all_ones_input(b) else ctx.local(b) for b in bufs)


def _side_for_flex(ctx: GraphContext, node: fx.Node, dense: bool = True):
    """A tensor the scores read, for a score_mod: evaluated per query and key position when
    it is a function of index grids (:func:`lift_value`), else (with ``dense``) read from the
    model's own tensor at the query's and key's rows (:class:`DenseSide`)."""
    try:
        one, bufs = lift_value(ctx, node)
        _try_scalar(one, bufs)
        return one, bufs
    except MaskLiftError as first:
        if not dense:
            raise
        try:
            side = dense_side(ctx, node)
        except MaskLiftError:
            raise first from None
        # Padded along its token axes like the positions: FlexAttention's kernel may read
        # past N in the row's last block (masked out after the score_mod).
        dims = [d - 4 for d in (2, 3) if not side.broadcast[d]]
        padded = ctx.graph.call_function(torch.ops.treefx.pad_rows_to_block.default,
                                         (ctx.local(node), ctx.block_size, dims))
        set_example(padded)
        return side, (padded,)


def _try_scalar(lifted, bufs) -> None:
    """Evaluate a lifted value once for one (b, h, q, kv) on the example values: MaskLiftError
    when it does not give one scalar (an axis it cannot assign to b, h, q or kv)."""
    def meta(v):  # the example value's shape, on the meta device (no data, no guards)
        if not isinstance(v, torch.Tensor):
            return v
        shape = [s if isinstance(s, int) else (s.node.hint or 2) for s in v.shape]
        return torch.empty(shape, dtype=v.dtype, device="meta")

    try:
        vals = [meta(example(b)) for b in bufs]
        zero = torch.zeros(1, dtype=torch.int64, device="meta")  # one (b, h, q, kv) pair
        out = lifted.evaluate(zero, zero, zero, zero, *vals)
    except MaskLiftError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure means: not evaluable per index
        raise MaskLiftError(f"{type(e).__name__}: {e}") from None
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise MaskLiftError("it does not give one value per query and key")


def _add_bias(score, bias):
    if bias.dtype == torch.bool:  # a boolean mask the lifter could not evaluate per index
        return torch.where(bias, score, float("-inf"))
    return score + bias


def _block_nodes(ctx: GraphContext, *, full: bool, window: int | None = None):
    """Shared nodes: the tree's block-mask tensors and the padded tree tensors. ``window``:
    the model's mask admits no pair farther apart (:func:`window_of`), so key blocks beyond
    it are left out."""
    def make(c: GraphContext):
        g = c.graph
        kwargs = {"full": full}
        if window is not None:
            kwargs.update(positions=c.positions, window=window)
        t = g.call_function(tree_block_tensors, (c.subtree_end, c.block_size), kwargs)
        parts = [g.call_function(operator.getitem, (t, i)) for i in range(5)]
        # parts[4]: subtree_end padded to the block tensors' blocks; the positions likewise.
        # (torch.ops.treefx.pad_to_block is registered by importing ..mask)
        pos = g.call_function(torch.ops.treefx.pad_to_block.default,
                              (c.positions, c.block_size))
        return (*parts, pos)

    return ctx.shared(("blocks", full, window), make)


def attention_pass(ctx: GraphContext) -> int:
    """Rewrite every matched attention; returns how many."""
    sites = []
    for node in list(ctx.graph.nodes):
        if is_call(node, *_SDPA):
            sites.append(_sdpa_site(node))
        elif is_call(node, *_SOFTMAX, methods=("softmax",)):
            site = _eager_site(node)
            if site is not None:
                sites.append(site)
            elif not _feeds_matmul(node):
                ctx.keep("attention", node, "a softmax that feeds no matmul with values: not "
                                            "attention (e.g. a router), correct per token as is")
    for site in sites:
        _rewrite(ctx, site)
    return len(sites)


def check_no_attention_left(ctx: GraphContext) -> None:
    """After all passes: anything attention-like that survived is an error."""
    for node in ctx.graph.nodes:
        if node.op == "call_function" and node.target in _OTHER_ATTENTION + _SDPA:
            raise _fail(node, "this attention op is not one treefx can rewrite")
        if node.op == "call_function" and "flex_attention" in str(node.target) and not isinstance(
            node.target, (TreeFlexAttention, TreePartFlexAttention)
        ):
            raise _fail(node, "the model calls flex_attention itself; treefx does not rewrite "
                              "a model's own flex_attention yet")
        if is_call(node, *_SOFTMAX, methods=("softmax",)) and _feeds_matmul(node):
            raise _fail(node, "a softmax feeds a matmul here, but not in a pattern treefx "
                              "recognises as attention")


def _feeds_matmul(node: fx.Node) -> bool:
    return any(is_call(u, *_MATMUL, methods=("matmul", "bmm")) or is_call(u, torch.einsum)
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
