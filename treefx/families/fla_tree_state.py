"""Gated DeltaNet's state pass over a whole tree in one kernel launch (forward and backward).

fla's state pass (``chunk_gated_delta_rule_fwd_h``, ``..._bwd_dhu``) runs one program per
(sequence, head, block of value columns), each walking its sequence's chunks of 64 tokens in
order. A tree's node starts from its parent node's final state, so :mod:`.fla_tree` ran that
pass once per depth: its latency is the sum over depths of the depth's longest node (102 chunk
steps on the benchmarks' 36-node tree against 68 on its longest root-to-leaf path), plus a
launch, a gather of the parents' states and fla's Python per depth and per pass.

Here every (node, head, value block) is one program of a single launch, and a node's program
waits for its parent's (forward) or its children's (backward) before its own walk. Programs
take their work in the order they start, from a counter (a ticket), not from their grid
index: the forward hands out nodes in DFS order (a parent before its children), the backward
in reverse DFS order (children before the parent), so a program only ever waits for work
handed out before its own, to programs that are already running. Nothing waits on a program
that is not yet resident, so the launch cannot deadlock however the GPU schedules it.

Handing a state over: the producer stores it, all its threads meet at a barrier, and one
thread raises the flag with release semantics at GPU scope; the consumer's thread reads the
flag with acquire semantics, its threads meet at a barrier, and they read the state past the
L1 cache (``.cg``). The per-node arithmetic is fla 0.4.2's (the same products, in the same
dtypes and order), so a node's results are those of fla's kernel with that initial state.
The backward sums a node's children's state gradients in DFS order, then adds the gradient of
the node's own final state where it leaves the op: a fixed order, so the result is
deterministic.

The layout is fla's variable-length one over the nodes in DFS order (``cu_seqlens`` and chunk
offsets): the chunk states ``h`` [1, chunks, H, K, V] are what fla's state pass gives for
these nodes, for the chunk-local stages around it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..options import Options, current

__all__ = ["ENV", "TreeTables", "available", "tables", "tree_bwd_dhu", "tree_fwd_h"]

# 0: the state pass depth by depth (fla's kernel per depth)
ENV = Options.env_name("fla_tree_state")
BT = 64

try:  # Triton is optional: the CPU build of torch comes without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = tl = None


def available(key_dim: int) -> bool:
    """Whether the one-launch state pass runs: Triton importable, key heads of 64 or 128
    (two 64-wide halves at most, as fla's kernel holds them), and not turned off by ``ENV``."""
    if not current().fla_tree_state:
        return False
    return triton is not None and key_dim in (64, 128)


def _config() -> tuple[int, int, int]:
    """(BV, num_warps, num_stages): value columns per program and the launch's settings.
    ``TREEFX_FLA_TREE_STATE_CONFIG=BV,warps,stages`` sets them (for timing variants)."""
    return current().fla_tree_state_config


class TreeTables:
    """Per-tree index tables of the one-launch state pass, on the device (int32 unless said):

    - ``parent`` [n]: the parent node (DFS index), -1 for a root;
    - ``root_row`` [n]: a root's row of the roots' initial states (roots in DFS order), -1
      for other nodes;
    - ``fin_slot`` [n]: a node's row of the forward's final-state buffer, -1 where no child
      and no output needs its final state;
    - ``keep_row`` [n]: a node's row of the op's final-state output (and of its gradient), -1
      where it does not leave the op;
    - ``child_ptr`` [n + 1], ``child_idx``: each node's children in DFS order (CSR);
    - ``choff`` [n + 1] (int64): each node's first chunk (fla's chunk offsets);
    - ``keep_slots`` (int64): the final-state buffer's rows of the kept nodes, in their order.
    """

    __slots__ = ("n", "slots", "chunks", "parent", "root_row", "fin_slot", "keep_row",
                 "child_ptr", "child_idx", "choff", "keep_slots", "roots")


def tables(parents: np.ndarray, lengths: np.ndarray, keep_nodes: list[int]):
    """The host arrays of :class:`TreeTables` for nodes in DFS order (``parents``: DFS
    indices, -1 for roots; ``keep_nodes``: the nodes whose final states leave the op, in the
    output's order), and its sizes: ({name: array}, {"n", "slots", "chunks"})."""
    n = len(parents)
    parents = np.asarray(parents, dtype=np.int64)
    has_child = np.zeros(n, dtype=bool)
    has_child[parents[parents >= 0]] = True
    keep_row = np.full(n, -1, dtype=np.int64)
    keep_row[np.asarray(keep_nodes, dtype=np.int64)] = np.arange(len(keep_nodes))
    need = has_child | (keep_row >= 0)
    fin_slot = np.where(need, np.cumsum(need) - 1, -1)
    roots = np.flatnonzero(parents < 0)
    root_row = np.full(n, -1, dtype=np.int64)
    root_row[roots] = np.arange(len(roots))
    kids = np.flatnonzero(parents >= 0)  # ascending DFS index: each node's children in order
    by_parent = kids[np.argsort(parents[kids], kind="stable")]
    child_ptr = np.concatenate([[0], np.cumsum(np.bincount(parents[kids], minlength=n))])
    nch = -(-np.asarray(lengths, dtype=np.int64) // BT)
    choff = np.concatenate([[0], np.cumsum(nch)])
    i32 = {name: a.astype(np.int32) for name, a in (
        ("parent", parents), ("root_row", root_row), ("fin_slot", fin_slot),
        ("keep_row", keep_row), ("child_ptr", child_ptr), ("child_idx", by_parent))}
    return {**i32, "choff": choff, "roots": roots,
            "keep_slots": fin_slot[np.asarray(keep_nodes, dtype=np.int64)]}, dict(
        n=n, slots=int(need.sum()), chunks=int(choff[-1]))


if triton is not None:
    @triton.jit
    def _wait(flag):
        """Spin until ``*flag`` is set (acquire, GPU scope), then meet the program's threads."""
        f = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        while f == 0:
            f = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _signal(flag):
        """Meet the program's threads (their stores done), then set ``*flag`` (release)."""
        tl.debug_barrier()
        tl.atomic_xchg(flag, 1, sem="release", scope="gpu")

    @triton.jit
    def _take_work(counter, cu, choff, N, H: tl.constexpr, NV: tl.constexpr,
                   BT: tl.constexpr, REVERSE: tl.constexpr):
        """This program's ticket, in the order programs start: its node (DFS order, or reverse
        DFS order with ``REVERSE``), head and value block, and the node's first token, token
        count, chunk count and first chunk."""
        ticket = tl.atomic_add(counter, 1)
        i_n = ticket // (H * NV)
        if REVERSE:
            i_n = N - 1 - i_n
        i_h = (ticket // NV) % H
        i_v = ticket % NV
        bos = tl.load(cu + i_n).to(tl.int64)
        T = (tl.load(cu + i_n + 1) - bos).to(tl.int32)
        return i_n, i_h, i_v, bos, T, tl.cdiv(T, BT), tl.load(choff + i_n).to(tl.int64)

    @triton.jit
    def _load_state(src, i_v, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                    CACHE: tl.constexpr):
        """Value block ``i_v`` of the [K, V] state at ``src`` as two float32 halves of 64 key
        rows (the second zeros where K is 64); ``CACHE``: ".cg" for a state another program
        wrote (read past L1), "" otherwise."""
        p = tl.make_block_ptr(src, (K, V), (V, 1), (0, i_v * BV), (64, BV), (1, 0))
        b1 = tl.load(p, boundary_check=(0, 1), cache_modifier=CACHE).to(tl.float32)
        b2 = tl.zeros([64, BV], dtype=tl.float32)
        if K > 64:
            p = tl.make_block_ptr(src, (K, V), (V, 1), (64, i_v * BV), (64, BV), (1, 0))
            b2 = tl.load(p, boundary_check=(0, 1), cache_modifier=CACHE).to(tl.float32)
        return b1, b2

    @triton.jit
    def _rows_by_state(x, T, i_t, b1, b2, H: tl.constexpr, K: tl.constexpr,
                       BT: tl.constexpr):
        """Chunk ``i_t``'s rows of ``x`` [T, K] (a token's K channels at stride H * K) times the
        state whose halves are ``b1``, ``b2`` (cast to ``x``'s dtype): [BT, BV] in float32."""
        p = tl.make_block_ptr(x, (T, K), (H * K, 1), (i_t * BT, 0), (BT, 64), (1, 0))
        b_x = tl.load(p, boundary_check=(0, 1))
        out = tl.dot(b_x, b1.to(b_x.dtype))
        if K > 64:
            p = tl.make_block_ptr(x, (T, K), (H * K, 1), (i_t * BT, 64), (BT, 64), (1, 0))
            b_x = tl.load(p, boundary_check=(0, 1))
            out += tl.dot(b_x, b2.to(b_x.dtype))
        return out

    @triton.jit
    def _state_grad_step(q, w, b_dh, b_do, b_dv, b_g_last_exp, b_g_exp, scale, T, i_t, k0,
                         H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
        """The state gradient's half at key rows ``k0 .. k0 + 64`` one chunk back: decayed, plus
        chunk ``i_t``'s (gated) queries times the output gradient, minus its ``w`` times the
        values' gradient."""
        p_q = tl.make_block_ptr(q, (K, T), (1, H * K), (k0, i_t * BT), (64, BT), (0, 1))
        p_w = tl.make_block_ptr(w, (K, T), (1, H * K), (k0, i_t * BT), (64, BT), (0, 1))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_w = tl.load(p_w, boundary_check=(0, 1))
        b_dh *= b_g_last_exp
        b_q = b_q * b_g_exp[None, :]
        b_dh += tl.dot(b_q, b_do.to(b_q.dtype)) * scale - tl.dot(b_w, b_dv.to(b_w.dtype))
        return b_dh

    @triton.jit
    def _store_state(dst, b1, b2, i_v, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
        """The two halves of :func:`_load_state` into value block ``i_v`` of the [K, V] state
        at ``dst``, in its dtype."""
        p = tl.make_block_ptr(dst, (K, V), (V, 1), (0, i_v * BV), (64, BV), (1, 0))
        tl.store(p, b1.to(p.dtype.element_ty), boundary_check=(0, 1))
        if K > 64:
            p = tl.make_block_ptr(dst, (K, V), (V, 1), (64, i_v * BV), (64, BV), (1, 0))
            tl.store(p, b2.to(p.dtype.element_ty), boundary_check=(0, 1))

    @triton.jit
    def _tree_fwd_h_kernel(k, u, w, v_new, g, h, h0, fin, flags, counter,
                           cu, choff, parent, root_row, fin_slot,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                           USE_H0: tl.constexpr):
        # forward: nodes in DFS order, a parent before its children
        i_n, i_h, i_v, bos, T, NT, boh = _take_work(counter, cu, choff, 0, H, NV, BT, False)
        par = tl.load(parent + i_n)

        b_h1 = tl.zeros([64, BV], dtype=tl.float32)
        b_h2 = tl.zeros([64, BV], dtype=tl.float32)
        if par >= 0:
            _wait(flags + (par * H + i_h) * NV + i_v)
            src = fin + (tl.load(fin_slot + par).to(tl.int64) * H + i_h) * K * V
            b_h1, b_h2 = _load_state(src, i_v, K, V, BV, ".cg")
        elif USE_H0:
            src = h0 + (tl.load(root_row + i_n).to(tl.int64) * H + i_h) * K * V
            b_h1, b_h2 = _load_state(src, i_v, K, V, BV, "")

        k += (bos * H + i_h) * K
        w += (bos * H + i_h) * K
        u += (bos * H + i_h) * V
        v_new += (bos * H + i_h) * V
        g += bos * H + i_h
        h_t = h + (boh * H + i_h) * K * V
        for i_t in range(NT):
            _store_state(h_t, b_h1, b_h2, i_v, K, V, BV)
            # the new values: u - w h
            b_v = _rows_by_state(w, T, i_t, b_h1, b_h2, H, K, BT)
            p_u = tl.make_block_ptr(u, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
            b_v = tl.load(p_u, boundary_check=(0, 1)) - b_v
            p_vn = tl.make_block_ptr(v_new, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV),
                                     (1, 0))
            tl.store(p_vn, b_v.to(p_vn.dtype.element_ty), boundary_check=(0, 1))
            # the gate: decay the state to the chunk's end, the values to it
            last = tl.minimum((i_t + 1) * BT, T) - 1
            m_t = (i_t * BT + tl.arange(0, BT)) < T
            b_g_last = tl.load(g + last * H).to(tl.float32)
            p_g = tl.make_block_ptr(g, (T,), (H,), (i_t * BT,), (BT,), (0,))
            b_g = tl.load(p_g, boundary_check=(0,)).to(tl.float32)
            b_v = b_v * tl.where(m_t, tl.exp(b_g_last - b_g), 0)[:, None]
            b_g_last = tl.exp(b_g_last)
            b_h1 *= b_g_last
            if K > 64:
                b_h2 *= b_g_last
            b_v = b_v.to(k.dtype.element_ty)
            p_k = tl.make_block_ptr(k, (K, T), (1, H * K), (0, i_t * BT), (64, BT), (0, 1))
            b_h1 += tl.dot(tl.load(p_k, boundary_check=(0, 1)), b_v)
            if K > 64:
                p_k = tl.make_block_ptr(k, (K, T), (1, H * K), (64, i_t * BT), (64, BT), (0, 1))
                b_h2 += tl.dot(tl.load(p_k, boundary_check=(0, 1)), b_v)
            h_t += H * K * V

        slot = tl.load(fin_slot + i_n)
        if slot >= 0:
            _store_state(fin + (slot.to(tl.int64) * H + i_h) * K * V, b_h1, b_h2, i_v, K, V, BV)
            _signal(flags + (i_n * H + i_h) * NV + i_v)

    @triton.jit
    def _tree_bwd_dhu_kernel(q, k, w, g, dht, dh0, do, dh, dv, dv2, flags, counter,
                             cu, choff, parent, root_row, keep_row, child_ptr, child_idx,
                             scale, N,
                             H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                             BT: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                             USE_H0: tl.constexpr, USE_DHT: tl.constexpr):
        # reverse DFS order: children before the parent
        i_n, i_h, i_v, bos, T, NT, boh = _take_work(counter, cu, choff, N, H, NV, BT, True)

        # the gradient of the node's final state: its children's initial states', in DFS
        # order, then its own where it leaves the op
        b_dh1 = tl.zeros([64, BV], dtype=tl.float32)
        b_dh2 = tl.zeros([64, BV], dtype=tl.float32)
        c0 = tl.load(child_ptr + i_n)
        c1 = tl.load(child_ptr + i_n + 1)
        for c in range(c0, c1):
            child = tl.load(child_idx + c)
            _wait(flags + (child * H + i_h) * NV + i_v)
            d1, d2 = _load_state(dh0 + (child.to(tl.int64) * H + i_h) * K * V, i_v, K, V, BV,
                                 ".cg")
            b_dh1 += d1
            b_dh2 += d2
        if USE_DHT:
            row = tl.load(keep_row + i_n)
            if row >= 0:
                d1, d2 = _load_state(dht + (row.to(tl.int64) * H + i_h) * K * V, i_v, K, V, BV,
                                     "")
                b_dh1 += d1
                b_dh2 += d2

        q += (bos * H + i_h) * K
        k += (bos * H + i_h) * K
        w += (bos * H + i_h) * K
        do += (bos * H + i_h) * V
        dv += (bos * H + i_h) * V
        dv2 += (bos * H + i_h) * V
        g += bos * H + i_h
        dh_t = dh + ((boh + NT - 1) * H + i_h) * K * V
        for i_s in range(NT):
            i_t = NT - 1 - i_s
            _store_state(dh_t, b_dh1, b_dh2, i_v, K, V, BV)
            last = tl.minimum((i_t + 1) * BT, T) - 1
            b_g_last = tl.load(g + last * H).to(tl.float32)
            p_g = tl.make_block_ptr(g, (T,), (H,), (i_t * BT,), (BT,), (0,))
            b_g = tl.load(p_g, boundary_check=(0,)).to(tl.float32)
            b_g_last_exp = tl.exp(b_g_last)
            b_g_exp = tl.exp(b_g)
            p_do = tl.make_block_ptr(do, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV),
                                     (1, 0))
            b_do = tl.load(p_do, boundary_check=(0, 1))
            # the values' gradient through the state: k dh, decayed, plus the local one
            b_dv = _rows_by_state(k, T, i_t, b_dh1, b_dh2, H, K, BT)
            m_t = (i_t * BT + tl.arange(0, BT)) < T
            b_dv *= tl.where(m_t, tl.exp(b_g_last - b_g), 0)[:, None]
            p_dv = tl.make_block_ptr(dv, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV),
                                     (1, 0))
            b_dv += tl.load(p_dv, boundary_check=(0, 1))
            p_dv2 = tl.make_block_ptr(dv2, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV),
                                      (1, 0))
            tl.store(p_dv2, b_dv.to(p_dv2.dtype.element_ty), boundary_check=(0, 1))
            # the state's gradient one chunk back
            b_dh1 = _state_grad_step(q, w, b_dh1, b_do, b_dv, b_g_last_exp, b_g_exp, scale, T,
                                     i_t, 0, H, K, BT)
            if K > 64:
                b_dh2 = _state_grad_step(q, w, b_dh2, b_do, b_dv, b_g_last_exp, b_g_exp, scale,
                                         T, i_t, 64, H, K, BT)
            dh_t -= H * K * V

        # the gradient of the node's initial state: to its parent, or out for a root
        out = tl.load(parent + i_n) >= 0
        if USE_H0:
            out = i_n >= 0
        if out:
            _store_state(dh0 + (i_n.to(tl.int64) * H + i_h) * K * V, b_dh1, b_dh2, i_v, K, V, BV)
            _signal(flags + (i_n * H + i_h) * NV + i_v)


def _launch_settings(V: int, n: int, H: int):
    bv, warps, stages = _config()
    nv = -(-V // bv)
    return bv, nv, (n * H * nv,), dict(num_warps=warps, num_stages=stages)


def tree_fwd_h(t, k, w, u, g, h0, cu):
    """The forward state pass over the tree of tables ``t`` (:class:`TreeTables`): ``k``,
    ``w`` [1, N, H, K], ``u`` [1, N, H, V], ``g`` [1, N, H] (the gate's chunk-local cumulative
    sum), ``h0`` the roots' initial states [roots, H, K, V] or None, ``cu`` the nodes' token
    offsets. Returns (chunk states h [1, chunks, H, K, V] in ``k``'s dtype, new values
    [1, N, H, V], final states [slots, H, K, V] float32 by ``t.fin_slot``)."""
    H, K = k.shape[-2:]
    V = u.shape[-1]
    bv, nv, grid, launch = _launch_settings(V, t.n, H)
    h = k.new_empty(1, t.chunks, H, K, V)
    v_new = torch.empty_like(u)
    fin = k.new_empty(max(t.slots, 1), H, K, V, dtype=torch.float32)
    flags = torch.zeros(t.n * H * nv, dtype=torch.int32, device=k.device)
    counter = torch.zeros(1, dtype=torch.int32, device=k.device)
    _tree_fwd_h_kernel[grid](k, u, w, v_new, g, h, h0, fin, flags, counter,
                             cu, t.choff, t.parent, t.root_row, t.fin_slot,
                             H=H, K=K, V=V, BT=BT, BV=bv, NV=nv, USE_H0=h0 is not None,
                             **launch)
    return h, v_new, fin


def tree_bwd_dhu(t, q, k, w, g, do, dv, dfinal, scale: float, with_h0: bool, cu):
    """The backward state pass over the tree of tables ``t``: the chunk states' gradient dh
    [1, chunks, H, K, V], each node's initial state's gradient [n, H, K, V] float32 (rows of
    roots only where ``with_h0``; a root's row is garbage otherwise) and the values' gradient
    dv2 [1, N, H, V] (``dv``, the chunk-local part, plus the part through the states).
    ``dfinal``: the gradient of the op's final-state output (rows by ``t.keep_row``) or None."""
    H, K = q.shape[-2:]
    V = do.shape[-1]
    bv, nv, grid, launch = _launch_settings(V, t.n, H)
    dh = q.new_empty(1, t.chunks, H, K, V)
    dh0 = q.new_empty(t.n, H, K, V, dtype=torch.float32)
    dv2 = torch.empty_like(dv)
    flags = torch.zeros(t.n * H * nv, dtype=torch.int32, device=q.device)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    _tree_bwd_dhu_kernel[grid](q, k, w, g, dfinal, dh0, do, dh, dv, dv2, flags, counter,
                               cu, t.choff, t.parent, t.root_row, t.keep_row, t.child_ptr,
                               t.child_idx, scale, t.n,
                               H=H, K=K, V=V, BT=BT, BV=bv, NV=nv, USE_H0=with_h0,
                               USE_DHT=dfinal is not None, **launch)
    return dh, dh0, dv2


# ----------------------------------------------------------------------------- reference

def _walk_chunks(a: int, b: int):
    return [(t0, min(t0 + BT, b)) for t0 in range(a, b, BT)]


def reference_fwd_h(host: dict, sizes: dict, cu, k, w, u, g, h0):
    """:func:`tree_fwd_h` in float64 torch, node by node in DFS order (``host``, ``sizes``:
    :func:`tables`' arrays and sizes; ``cu`` the nodes' token offsets, a sequence). The
    reference of the kernel's arithmetic, for the checks."""
    k, w, u, g = (x[0].double() for x in (k, w, u, g))
    H, K, V = k.shape[1], k.shape[2], u.shape[2]
    h = k.new_zeros(sizes["chunks"], H, K, V)
    v_new = torch.zeros_like(u)
    fin: dict[int, torch.Tensor] = {}  # slot -> final state (no in-place writes: autograd)
    for i in range(sizes["n"]):
        par = int(host["parent"][i])
        if par >= 0:
            s = fin[int(host["fin_slot"][par])]
        elif h0 is not None:
            s = h0[int(host["root_row"][i])].double()
        else:
            s = k.new_zeros(H, K, V)
        for c, (t0, t1) in enumerate(_walk_chunks(int(cu[i]), int(cu[i + 1]))):
            h[int(host["choff"][i]) + c] = s
            vn = u[t0:t1] - torch.einsum("thk,hkv->thv", w[t0:t1], s)
            v_new[t0:t1] = vn
            gl = g[t1 - 1]
            vd = vn * torch.exp(gl[None] - g[t0:t1])[..., None]
            s = s * torch.exp(gl)[:, None, None] + torch.einsum("thk,thv->hkv", k[t0:t1], vd)
        if host["fin_slot"][i] >= 0:
            fin[int(host["fin_slot"][i])] = s
    zero = k.new_zeros(H, K, V)
    return h[None], v_new[None], torch.stack([fin.get(j, zero)
                                              for j in range(max(sizes["slots"], 1))])


def reference_bwd_dhu(host: dict, sizes: dict, cu, q, k, w, g, do, dv, dfinal, scale: float,
                      with_h0: bool):
    """:func:`tree_bwd_dhu` in float64 torch, node by node in reverse DFS order: ``dh[c]``
    is the gradient of the state after chunk ``c`` (the chunk's own output term excluded),
    ``dh0[i]`` of node ``i``'s initial state, ``dv2`` of the new values."""
    q, k, w, g, do, dv = (x[0].double() for x in (q, k, w, g, do, dv))
    H, K, V = k.shape[1], k.shape[2], do.shape[2]
    dh = k.new_zeros(sizes["chunks"], H, K, V)
    dh0 = k.new_zeros(sizes["n"], H, K, V)
    dv2 = torch.zeros_like(dv)
    for i in reversed(range(sizes["n"])):
        b = k.new_zeros(H, K, V)
        for c in host["child_idx"][host["child_ptr"][i]:host["child_ptr"][i + 1]]:
            b = b + dh0[int(c)]
        if dfinal is not None and host["keep_row"][i] >= 0:
            b = b + dfinal[int(host["keep_row"][i])].double()
        chunks = _walk_chunks(int(cu[i]), int(cu[i + 1]))
        for c in reversed(range(len(chunks))):
            t0, t1 = chunks[c]
            dh[int(host["choff"][i]) + c] = b
            gl = g[t1 - 1]
            dvc = torch.einsum("thk,hkv->thv", k[t0:t1], b) * \
                torch.exp(gl[None] - g[t0:t1])[..., None] + dv[t0:t1]
            dv2[t0:t1] = dvc
            qg = q[t0:t1] * torch.exp(g[t0:t1])[..., None]
            b = (b * torch.exp(gl)[:, None, None]
                 + scale * torch.einsum("thk,thv->hkv", qg, do[t0:t1])
                 - torch.einsum("thk,thv->hkv", w[t0:t1], dvc))
        if host["parent"][i] >= 0 or with_h0:
            dh0[i] = b
    return dh[None], dh0, dv2[None]
