"""Gated DeltaNet over a whole tree on fla's kernels, one launch per stage and not per level.

The tree recurrence (:mod:`treefx.ops.recurrence`) runs a tree depth by depth: every node of a
depth in one variable-length call of fla's ``chunk_gated_delta_rule``, whose initial states are
the parent nodes' final states. Each such call launches fla's whole pipeline (about ten Triton
kernels forward and fifteen backward, each with fla's and Triton's Python around it), and a
depth holds few tokens, so a hybrid's step was host-bound: the GPU idled in the gaps between
those launches (BENCHMARKS.md, "Hybrids on fla's kernels").

Only one stage of that pipeline carries the state along a sequence: the state pass
(``chunk_gated_delta_rule_fwd_h`` forward, ``chunk_gated_delta_rule_bwd_dhu`` backward). Every
other stage works chunk by chunk (64 tokens) on its own tokens: the gate's cumulative sum, the
WY representation (``A``, ``w``, ``u``), the output from the chunk states, and their backward.
So here the nodes are laid out depth by depth (each depth's nodes end to end, one
variable-length row of all nodes), the chunk-local stages run once over that row, and only the
state pass runs per depth, on the depth's slice of the row (a view: no copy), with its nodes'
initial states gathered from the depth above. Per depth: one launch forward, two backward (the
state pass recomputed, then its backward), against fla's whole pipeline per depth.

Where treefx's own state pass runs (:mod:`.fla_tree_state`: Triton, key heads of 64 or 128),
the nodes stay in DFS order and the state pass runs over the whole tree in one launch each
way, every node's program waiting for its parent's (children's) state; the chunk-local stages
around it are the same fla functions. ``TREEFX_FLA_TREE_STATE=0``: the state pass per depth.

Each stage is the same fla function, called with the same arguments as fla's own
``chunk_gated_delta_rule_fwd`` / ``_bwd`` call it for these nodes; a node is one sequence of
the variable-length row, so its chunks, its states and therefore its results are those of the
depth-by-depth calls. The internals are fla 0.4.2's: another fla version takes the
depth-by-depth path (:func:`kernels` says None).
"""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import torch

from ..layout import move_tensors
from ..options import Options, current
from . import fla_l2norm, fla_tree_state
from .fla import fla_distribution_version

__all__ = ["CHECKED_FLA", "ENV", "KEEP_ENV", "TreePlan", "kernels", "plan",
           "tree_gated_delta_rule"]

CHECKED_FLA = ("0.4.2",)
# 0: fla depth by depth (its whole pipeline per depth), as before
ENV = Options.env_name("fla_tree")
# 1: the forward's chunk states kept for the backward
KEEP_ENV = Options.env_name("fla_tree_keep_states")
CHUNK = 64
GRID_AXIS = 65_535  # CUDA's limit on a grid's second and third axes (see .fla.GRID_AXIS)

_KERNELS: dict = {}


def kernels() -> dict | None:
    """fla's stage functions by name, or None where the installed fla is not one whose
    internals this module was written and checked against (:data:`CHECKED_FLA`), or lacks
    them."""
    if "k" in _KERNELS:
        return _KERNELS["k"]
    found = None
    if fla_distribution_version() in CHECKED_FLA:
        try:
            from fla.modules.l2norm import l2norm_bwd, l2norm_fwd
            from fla.ops.common.chunk_delta_h import (chunk_gated_delta_rule_bwd_dhu,
                                                      chunk_gated_delta_rule_fwd_h)
            from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o
            from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
            from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
            from fla.ops.utils import chunk_local_cumsum, solve_tril
            found = dict(
                l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd,
                fwd_h=chunk_gated_delta_rule_fwd_h, bwd_dhu=chunk_gated_delta_rule_bwd_dhu,
                fwd_o=chunk_fwd_o, bwd_dv_local=chunk_bwd_dv_local, bwd_dqkwg=chunk_bwd_dqkwg,
                kkt=chunk_scaled_dot_kkt_fwd, wy_bwd=prepare_wy_repr_bwd,
                w_u=recompute_w_u_fwd, cumsum=chunk_local_cumsum, solve_tril=solve_tril)
            if not all("chunk_indices" in inspect.signature(f).parameters
                       for k, f in found.items() if not k.startswith("l2norm")):
                found = None
        except (ImportError, AttributeError, TypeError, ValueError):
            found = None
    _KERNELS["k"] = found
    return found


class _Level:
    """One depth: its token range [a, b) in the depth-ordered row, its nodes' variable-length
    offsets and chunk indices (relative to the range), where its nodes' initial states come
    from (rows of the depth above's final states), whether its final states are computed, and
    which of them leave the op (``keep_rows``, at ``keep_at`` of the op's final-state output)."""

    __slots__ = ("a", "b", "n", "cu", "ci", "parent_rows", "final", "keep_rows", "keep_at")


class TreePlan:
    """The depth-ordered layout of one tree's nodes and its index tensors on the device, made
    once per tree on the host (:func:`plan`)."""

    def __init__(self):
        self.perm = self.inv = None  # depth order <- DFS row, and back (None: the same order)
        self.cu = self.ci = None
        self.levels: list[_Level] = []
        self.keep_nodes: list[int] = []  # DFS node ids, in the order of the final-state output
        self.num_tokens = 0
        self.tables = None  # the one-launch state pass's (fla_tree_state.TreeTables), or None


def _chunk_indices(lengths: np.ndarray) -> np.ndarray:
    """fla's chunk indices of variable-length sequences: (sequence, chunk within it) per chunk
    of 64 tokens, [chunks, 2]."""
    nch = -(-lengths // CHUNK)
    first = np.concatenate([[0], np.cumsum(nch)[:-1]])
    seq = np.repeat(np.arange(len(lengths)), nch)
    return np.stack([seq, np.arange(int(nch.sum())) - np.repeat(first, nch)], 1)


def plan(nodes, keep, heads: int, device, key_dim: int | None = None) -> TreePlan | None:
    """The plan for the tree of ``nodes`` (starts, lengths, parents, depth: DFS order), the
    final states of the nodes ``keep`` handed out, on ``device``; None where one call of a
    stage would launch more blocks on a grid axis than CUDA allows (the depth-by-depth path,
    which splits its calls, runs it). Where the one-launch state pass runs
    (:func:`.fla_tree_state.available` for ``key_dim``), the nodes stay in DFS order and the
    plan carries its tables; otherwise they are laid out depth by depth."""
    if fla_tree_state.available(key_dim):
        return _one_launch_plan(nodes, keep, heads, device)
    starts, lengths, parents, depth = (np.asarray(x, dtype=np.int64) for x in nodes)
    n = len(starts)
    order = np.argsort(depth, kind="stable")  # depth by depth, DFS order within a depth
    len_o = lengths[order]
    cu = np.concatenate([[0], np.cumsum(len_o)])
    ci = _chunk_indices(len_o)
    depth_o = depth[order]
    bounds = np.flatnonzero(np.diff(depth_o)) + 1
    level_first = np.concatenate([[0], bounds, [n]])
    widest = int(np.diff(level_first).max())
    if len(ci) > GRID_AXIS or widest * heads > GRID_AXIS:
        return None
    pos = np.empty(n, dtype=np.int64)  # a node's place in the depth order
    pos[order] = np.arange(n)
    children = np.bincount(parents[parents >= 0], minlength=n)
    keep_set = set(int(k) for k in keep)
    chunk_first = np.concatenate([[0], np.cumsum(-(-len_o // CHUNK))])
    p = TreePlan()
    p.num_tokens = int(cu[-1])
    host = []  # (name or (level, name), int64 array), moved in one copy
    if not np.array_equal(order, np.arange(n)):
        perm = np.repeat(starts[order] - cu[:-1], len_o) + np.arange(cu[-1])
        inv = np.empty_like(perm)
        inv[perm] = np.arange(len(perm))
        host += [("perm", perm), ("inv", inv)]
    host += [("cu", cu), ("ci", ci)]
    keep_count = 0
    for j in range(len(level_first) - 1):
        s, e = int(level_first[j]), int(level_first[j + 1])
        lv = _Level()
        lv.a, lv.b, lv.n = int(cu[s]), int(cu[e]), e - s
        mine = order[s:e]
        kept = [i for i, node in enumerate(mine.tolist()) if node in keep_set]
        lv.final = bool(children[mine].any()) or bool(kept)
        lv.keep_at = keep_count
        lv.parent_rows = lv.keep_rows = None
        keep_count += len(kept)
        p.keep_nodes += [int(mine[i]) for i in kept]
        host += [((j, "cu"), cu[s:e + 1] - cu[s]),
                 ((j, "ci"), ci[chunk_first[s]:chunk_first[e]] - np.array([s, 0]))]
        if j > 0:
            host.append(((j, "parent_rows"), pos[parents[mine]] - level_first[j - 1]))
        if kept:
            host.append(((j, "keep_rows"), np.asarray(kept, dtype=np.int64)))
        p.levels.append(lv)
    # one pinned copy; not inference tensors (a plan made under torch.inference_mode serves
    # a later step of the same tree whose autograd saves them)
    with torch.inference_mode(False):
        moved = move_tensors([torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
                              for _, a in host], torch.device(device))
    for (name, _), t in zip(host, moved):
        if isinstance(name, tuple):
            setattr(p.levels[name[0]], name[1], t)
        else:
            setattr(p, name, t)
    return p


def _one_launch_plan(nodes, keep, heads: int, device) -> TreePlan | None:
    starts, lengths, parents, depth = (np.asarray(x, dtype=np.int64) for x in nodes)
    ci = _chunk_indices(lengths)
    if len(ci) > GRID_AXIS or heads > GRID_AXIS:
        return None
    if not np.array_equal(starts, np.concatenate([[0], np.cumsum(lengths)[:-1]])):
        raise ValueError("tree nodes must tile the row in DFS order")
    p = TreePlan()
    p.num_tokens = int(lengths.sum())
    p.keep_nodes = sorted(int(x) for x in set(int(k) for k in keep))
    host, sizes = fla_tree_state.tables(parents, lengths, p.keep_nodes)
    host = {"cu": np.concatenate([[0], np.cumsum(lengths)]), "ci": ci, **host}
    with torch.inference_mode(False):
        moved = move_tensors([torch.from_numpy(np.ascontiguousarray(a)) for a in host.values()],
                             torch.device(device))
    t = fla_tree_state.TreeTables()
    for name, x in zip(host, moved):
        setattr(p if name in ("cu", "ci") else t, name, x)
    for name, v in sizes.items():
        setattr(t, name, v)
    p.tables = t
    return p


def _state_pass(kn: dict, p: TreePlan, k, w, u, g, h0, *, inits=None, final: bool = True):
    """The state pass depth by depth: (chunk states h, new values, each depth's final states
    (None where not computed), each depth's initial states). With ``inits`` (the backward's
    recomputation) the initial states are those, and no final state is computed."""
    hs, vs, fins, used = [], [], [], []
    prev = None
    for j, lv in enumerate(p.levels):
        sl = slice(lv.a, lv.b)
        if inits is not None:
            init = inits[j]
        elif j == 0:
            init = h0
        else:
            init = prev.index_select(0, lv.parent_rows)
        h, v_new, fin = kn["fwd_h"](k=k[:, sl], w=w[:, sl], u=u[:, sl], g=g[:, sl],
                                    initial_state=init,
                                    output_final_state=final and lv.final,
                                    cu_seqlens=lv.cu, chunk_indices=lv.ci)
        hs.append(h)
        vs.append(v_new)
        fins.append(fin)
        used.append(init)
        prev = fin
    return _cat(hs), _cat(vs), fins, used


def _state_pass_backward(kn: dict, p: TreePlan, q, k, w, g, do, dv, dfinal, inits, scale):
    """The backward state pass depth by depth (deepest first): (dh, dv with the part through
    the states, the roots' initial states' gradient)."""
    dhs, dvs = [None] * len(p.levels), [None] * len(p.levels)
    dh0 = None  # the gradient of the depth below's initial states
    for j in reversed(range(len(p.levels))):
        lv = p.levels[j]
        dht = None
        if dh0 is not None:  # the children's initial states are this depth's finals
            below = p.levels[j + 1]
            dht = dh0.new_zeros((lv.n, *dh0.shape[1:])).index_add_(
                0, below.parent_rows, dh0)
        if lv.keep_rows is not None and dfinal is not None:
            mine = dfinal.narrow(0, lv.keep_at, len(lv.keep_rows)).float()
            if dht is None:
                dht = mine.new_zeros((lv.n, *mine.shape[1:]))
            dht.index_add_(0, lv.keep_rows, mine)
        sl = slice(lv.a, lv.b)
        dhs[j], dh0, dvs[j] = kn["bwd_dhu"](
            q=q[:, sl], k=k[:, sl], w=w[:, sl], g=g[:, sl], h0=inits[j], dht=dht,
            do=do[:, sl], dv=dv[:, sl], scale=scale, cu_seqlens=lv.cu, chunk_indices=lv.ci)
    return _cat(dhs), _cat(dvs), dh0


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    """Per-depth pieces along the token / chunk dim, one piece as it is."""
    return xs[0] if len(xs) == 1 else torch.cat(xs, 1)


def _permute(x: torch.Tensor, index) -> torch.Tensor:
    return x if index is None else x.index_select(1, index)


def _on(device: torch.device):
    """The tensors' GPU as the current device while fla's kernels launch (Triton launches on
    the current device; fla's own entry points do the same)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _TreeGatedDeltaRule(torch.autograd.Function):
    """fla's chunked Gated DeltaNet over a tree's nodes; inputs [1, N, H, D] (query and key
    already expanded to the value heads) in DFS order, ``h0`` the roots' initial states (or
    None: zeros). Returns (output [1, N, H, V] in DFS order, final states of ``plan.keep_nodes``
    [len, H, K, V], float32)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, p: TreePlan, scale: float, l2norm: bool):
        with _on(q.device):
            return _TreeGatedDeltaRule._forward(ctx, q, k, v, g, beta, h0, p, scale, l2norm)

    @staticmethod
    def backward(ctx, do, dfinal):
        with _on(do.device):
            return _TreeGatedDeltaRule._backward(ctx, do, dfinal)

    @staticmethod
    def _forward(ctx, q, k, v, g, beta, h0, p: TreePlan, scale: float, l2norm: bool):
        kn = kernels()
        q, k, v, g, beta = (_permute(x.contiguous(), p.perm) for x in (q, k, v, g, beta))
        q_rstd = k_rstd = None
        ctx.l2norm_bwd = None
        if l2norm:  # fla's kernels, tuned once per head width where fla_l2norm can
            fixed = fla_l2norm.available()
            l2_fwd = fla_l2norm.l2norm_fwd if fixed else kn["l2norm_fwd"]
            ctx.l2norm_bwd = fla_l2norm.l2norm_bwd if fixed else kn["l2norm_bwd"]
            q, q_rstd = l2_fwd(q)
            k, k_rstd = l2_fwd(k)
        g = kn["cumsum"](g, chunk_size=CHUNK, cu_seqlens=p.cu, chunk_indices=p.ci)
        A = kn["kkt"](k=k, g=g, beta=beta, cu_seqlens=p.cu, output_dtype=torch.float32,
                      chunk_indices=p.ci)
        A = kn["solve_tril"](A=A, cu_seqlens=p.cu, output_dtype=k.dtype, chunk_indices=p.ci)
        w, u = kn["w_u"](k=k, v=v, beta=beta, A=A, g=g, cu_seqlens=p.cu, chunk_indices=p.ci)
        if p.tables is not None:  # the state pass in one launch
            h0 = None if h0 is None else h0.contiguous()
            h, v_new, fin = fla_tree_state.tree_fwd_h(p.tables, k, w, u, g, h0, p.cu)
            kept = [fin.index_select(0, p.tables.keep_slots)] if p.keep_nodes else []
            inits = [h0]
        else:
            h, v_new, fins, inits = _state_pass(kn, p, k, w, u, g, h0)
            kept = [fins[j].index_select(0, lv.keep_rows) for j, lv in enumerate(p.levels)
                    if lv.keep_rows is not None]
        o = kn["fwd_o"](q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=p.cu,
                        chunk_indices=p.ci)
        if kept:
            final = kept[0] if len(kept) == 1 else torch.cat(kept)
        else:
            final = k.new_zeros((0, *h.shape[2:]), dtype=torch.float32)
        ctx.p, ctx.scale, ctx.l2norm = p, scale, l2norm
        ctx.h0_dtype = None if h0 is None else h0.dtype
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        ctx.has_init = [x is not None for x in inits]
        # fla recomputes w, the chunk states and the new values in the backward; kept (opt-in),
        # the backward skips that recomputation (its state pass per depth and the w/u stage)
        # for T x H x (K + V) + chunks x H x K x V more memory a layer
        ctx.keep_states = current().fla_tree_keep_states
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A,
                              *([w, h, v_new] if ctx.keep_states else []),
                              *[x for x in inits if x is not None])
        return _permute(o.to(q.dtype), p.inv), final

    @staticmethod
    def _backward(ctx, do, dfinal):
        kn, p, scale = kernels(), ctx.p, ctx.scale
        q, q_rstd, k, k_rstd, v, g, beta, A, *saved = ctx.saved_tensors
        if ctx.keep_states:
            w, h, v_new, *saved = saved
        it = iter(saved)
        inits = [next(it) if has else None for has in ctx.has_init]
        do = _permute(do.contiguous(), p.perm)
        if not ctx.keep_states:
            w, u = kn["w_u"](k=k, v=v, beta=beta, A=A, g=g, cu_seqlens=p.cu,
                             chunk_indices=p.ci)
            if p.tables is not None:
                h, v_new, _ = fla_tree_state.tree_fwd_h(p.tables, k, w, u, g, inits[0], p.cu)
            else:
                h, v_new, _, _ = _state_pass(kn, p, k, w, u, g, None, inits=inits,
                                             final=False)
        dv = kn["bwd_dv_local"](q=q, k=k, g=g, do=do, scale=scale, cu_seqlens=p.cu,
                                chunk_indices=p.ci)
        if p.tables is not None:
            dh, dh0, dv = fla_tree_state.tree_bwd_dhu(
                p.tables, q, k, w, g, do, dv,
                None if dfinal is None or not p.keep_nodes else dfinal.contiguous(), scale,
                inits[0] is not None, p.cu)
            dh0 = None if inits[0] is None else dh0.index_select(0, p.tables.roots)
        else:
            dh, dv, dh0 = _state_pass_backward(kn, p, q, k, w, g, do, dv, dfinal, inits,
                                               scale)
        return _TreeGatedDeltaRule._rest(ctx, kn, p, scale, q, q_rstd, k, k_rstd, v, v_new,
                                         w, g, beta, A, h, do, dh, dv, dh0)

    @staticmethod
    def _rest(ctx, kn, p, scale, q, q_rstd, k, k_rstd, v, v_new, w, g, beta, A, h, do, dh, dv,
              dh0):
        """The chunk-local stages of the backward, after the state pass."""
        dq, dk, dw, dg = kn["bwd_dqkwg"](q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv, do=do, dh=dh,
                                         scale=scale, cu_seqlens=p.cu, chunk_indices=p.ci)
        dk2, dv, db, dg2 = kn["wy_bwd"](k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=dv,
                                        cu_seqlens=p.cu, chunk_indices=p.ci)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = kn["cumsum"](dg, chunk_size=CHUNK, reverse=True, cu_seqlens=p.cu,
                          chunk_indices=p.ci)
        if ctx.l2norm:
            dq = ctx.l2norm_bwd(q, q_rstd, dq)
            dk = ctx.l2norm_bwd(k, k_rstd, dk)
        grads = [_permute(x, p.inv).to(dt)
                 for x, dt in zip((dq, dk, dv, dg, db), ctx.dtypes)]
        dh0_roots = None if ctx.h0_dtype is None or dh0 is None else dh0.to(ctx.h0_dtype)
        return (*grads, dh0_roots, None, None, None)


_LAST: list = [None, None]  # (key, plan): the last tree's plan, reused by its layers


def _plan_for(nodes, keep, heads: int, device, key_dim: int) -> TreePlan | None:
    key = (nodes, tuple(keep), heads, device, key_dim, fla_tree_state.available(key_dim))
    if _LAST[0] != key:
        _LAST[:] = [key, plan(nodes, keep, heads, device, key_dim)]
    return _LAST[1]


def tree_gated_delta_rule(seq: dict, static: dict, nodes, root_init, keep):
    """:class:`treefx.ops.recurrence.Recurrence`'s ``tree_varlen`` for Gated DeltaNet: the
    whole tree (``seq``: the DFS row's query, key, value, g, beta; ``nodes``: starts, lengths,
    parents, depth; ``root_init``: the depth-0 nodes' initial states or None) in one pass per
    stage. Returns (output row, {node: final state} for the nodes ``keep``), or None where this
    path does not apply: an fla other than :data:`CHECKED_FLA`, a tree past CUDA's grid, or a
    row of roots alone (separate sequences, packing's layout), which fla's own variable-length
    entry point runs in one call anyway. Its stages are these, so the gain is small there
    (BENCHMARKS.md, "Hybrids on fla's kernels"), and in
    the one e2e run of packing's layout on this path (z7) both processes stopped
    with an illegal memory access whose cause is not known (packing on fla's own entry point
    stopped so twice before, [fla-12], [fla-16], and ran clean in [fla-20]): such rows run
    what a packing trainer runs."""
    if not current().fla_tree or kernels() is None or max(nodes[3], default=0) == 0:
        return None
    from .fla import expand_heads

    value = seq["value"]
    p = _plan_for(nodes, keep, value.shape[-2], value.device, seq["key"].shape[-1])
    if p is None:
        return None
    q, k = expand_heads(seq["query"], seq["key"], value.shape[-2])
    scale = static.get("scale")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    out, final = _TreeGatedDeltaRule.apply(
        q, k, value, seq["g"], seq["beta"], root_init, p, scale,
        bool(static.get("use_qk_l2norm_in_kernel")))
    return out, dict(zip(p.keep_nodes, final.unbind(0))) if len(p.keep_nodes) else {}
