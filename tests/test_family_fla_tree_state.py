"""Gated DeltaNet's state pass over a whole tree in one launch (treefx.families.fla_tree_state):
the per-tree tables the kernels read, and the float64 reference of their arithmetic, whose
backward is checked here against autograd through its forward. The Triton kernels themselves
run against that reference under Triton's interpreter (``python -m benchmarks.fla_check
--cases interpret-state``, run by the last test where Triton is installed) and on the GPU
(``benchmarks/fla_check.py --cases state``)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from support import run_under_tritons_interpreter

from treefx.families import fla_tree, fla_tree_state
from treefx.ops.recurrence.reference import _tree_nodes
from treefx.tools.synth import random_parent_row


def _random_row(seed: int) -> np.ndarray:
    """A forest of two random trees: nodes of one token and across 64-token chunks, up to four
    depths, some nodes with one child (a sequence that is a prefix of another)."""
    return random_parent_row(seed, lengths=(1, 2, 17, 64, 65, 100))


@pytest.mark.parametrize("seed", range(5))
def test_the_tables_name_each_nodes_parent_children_and_slots(seed):
    starts, lengths, parents, depth = _tree_nodes(_random_row(seed))
    n = len(starts)
    keep = sorted({0, n - 1, n // 2})
    host, sizes = fla_tree_state.tables(np.asarray(parents), np.asarray(lengths), keep)
    assert sizes["n"] == n and sizes["chunks"] == sum(-(-x // 64) for x in lengths)
    assert host["parent"].tolist() == list(parents)
    kids = [[c for c in range(n) if parents[c] == i] for i in range(n)]
    ptr = host["child_ptr"]
    assert [host["child_idx"][ptr[i]:ptr[i + 1]].tolist() for i in range(n)] == kids
    assert all(c > i for i in range(n) for c in kids[i])  # reverse DFS: children first
    # a final state is kept exactly where a child or the output reads it, one slot each
    needs = [bool(kids[i]) or i in keep for i in range(n)]
    assert [s >= 0 for s in host["fin_slot"]] == needs
    assert sorted(s for s in host["fin_slot"] if s >= 0) == list(range(sum(needs)))
    assert [host["keep_row"][i] for i in keep] == list(range(len(keep)))
    assert host["keep_slots"].tolist() == [host["fin_slot"][i] for i in keep]
    roots = [i for i in range(n) if parents[i] < 0]
    assert host["roots"].tolist() == roots
    assert [host["root_row"][r] for r in roots] == list(range(len(roots)))
    assert host["choff"].tolist() == [0, *np.cumsum([-(-x // 64) for x in lengths])]


def _case(seed: int, heads: int = 2, k_dim: int = 8, v_dim: int = 4):
    row = _random_row(seed)
    starts, lengths, parents, _ = _tree_nodes(row)
    n = len(starts)
    keep = sorted({1, n - 1, n // 2})
    host, sizes = fla_tree_state.tables(np.asarray(parents), np.asarray(lengths), keep)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    gen = torch.Generator().manual_seed(seed)
    t = len(row)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * s).requires_grad_()

    # the gate as fla hands it over: a cumulative sum within each 64-token chunk of a node
    g = -torch.rand(t, heads, generator=gen, dtype=torch.float64) * 0.2
    for a, b in zip(cu[:-1], cu[1:]):
        for c0 in range(a, b, 64):
            g[c0:min(c0 + 64, b)] = g[c0:min(c0 + 64, b)].cumsum(0)
    x = dict(k=rand(1, t, heads, k_dim, s=0.3), w=rand(1, t, heads, k_dim, s=0.3),
             u=rand(1, t, heads, v_dim), g=g[None].requires_grad_(),
             h0=rand(len(host["roots"]), heads, k_dim, v_dim))
    return host, sizes, cu, keep, x


@pytest.mark.parametrize("seed", range(4))
def test_the_reference_backward_is_the_adjoint_of_its_forward(seed):
    host, sizes, cu, keep, x = _case(seed)
    h, v_new, fin = fla_tree_state.reference_fwd_h(host, sizes, cu, x["k"], x["w"], x["u"],
                                                   x["g"], x["h0"])
    gen = torch.Generator().manual_seed(100 + seed)
    q = torch.randn(x["k"].shape, generator=gen, dtype=torch.float64)
    do = torch.randn(x["u"].shape, generator=gen, dtype=torch.float64)
    dv = torch.randn(x["u"].shape, generator=gen, dtype=torch.float64)
    dfinal = torch.randn(len(keep), *fin.shape[1:], generator=gen, dtype=torch.float64)
    scale = 0.37
    # the objective the backward pass differentiates: each chunk's output term (its state
    # before it, read by the queries), the new values, the final states handed out
    chunk_of = np.concatenate([np.repeat(np.arange(host["choff"][i], host["choff"][i + 1]),
                                         64)[:cu[i + 1] - cu[i]] for i in range(sizes["n"])])
    qg = q[0] * x["g"][0].exp()[..., None]
    objective = (scale * torch.einsum("thk,thkv,thv->", qg, h[0][chunk_of], do[0])
                 + (v_new * dv).sum()
                 + (fin[torch.as_tensor(host["keep_slots"])] * dfinal).sum())
    du, dk, dh0_ad = torch.autograd.grad(objective, [x["u"], x["k"], x["h0"]])
    dh, dh0, dv2 = fla_tree_state.reference_bwd_dhu(host, sizes, cu, q, x["k"], x["w"],
                                                    x["g"], do, dv, dfinal, scale, True)
    torch.testing.assert_close(dv2, du)  # v_new = u - w h: the new values' gradient is u's
    torch.testing.assert_close(dh0[host["roots"]], dh0_ad)
    # k enters the state after its chunk only: its gradient reads that state's, dh
    vd = torch.zeros_like(v_new[0])
    gl = torch.zeros_like(x["g"][0])
    for i in range(sizes["n"]):
        for c0 in range(cu[i], cu[i + 1], 64):
            c1 = min(c0 + 64, cu[i + 1])
            gl[c0:c1] = x["g"][0, c1 - 1]
    vd = v_new[0] * (gl - x["g"][0]).exp()[..., None]
    torch.testing.assert_close(torch.einsum("thv,thkv->thk", vd, dh[0][chunk_of]), dk[0])


def test_the_one_launch_plan_keeps_dfs_order(monkeypatch):
    row = _random_row(3)
    nodes = _tree_nodes(row)
    starts, lengths, parents, depth = nodes
    keep = (len(starts) - 1, 0)
    monkeypatch.setattr(fla_tree_state, "available", lambda key_dim: key_dim == 128)
    p = fla_tree.plan(nodes, keep, heads=4, device="cpu", key_dim=128)
    assert p.perm is None and p.inv is None and not p.levels
    assert p.cu.tolist() == [0, *np.cumsum(lengths)]
    assert p.keep_nodes == [0, len(starts) - 1]
    assert p.tables.parent.tolist() == list(parents) and p.tables.n == len(starts)
    assert fla_tree.plan(nodes, keep, heads=4, device="cpu", key_dim=96).tables is None


def test_the_one_launch_pass_needs_triton_a_known_key_width_and_is_switchable(monkeypatch):
    monkeypatch.setattr(fla_tree_state, "triton", object())
    assert fla_tree_state.available(128) and fla_tree_state.available(64)
    assert not fla_tree_state.available(96) and not fla_tree_state.available(None)
    monkeypatch.setenv(fla_tree_state.ENV, "0")
    assert not fla_tree_state.available(128)
    monkeypatch.delenv(fla_tree_state.ENV)
    monkeypatch.setattr(fla_tree_state, "triton", None)
    assert not fla_tree_state.available(128)


def test_launch_settings_come_from_the_environment_or_say_what_is_wrong(monkeypatch):
    assert fla_tree_state._config() == (32, 4, 2)
    monkeypatch.setenv(fla_tree_state.ENV + "_CONFIG", "64,4,3")
    assert fla_tree_state._config() == (64, 4, 3)
    for bad in ("64,4", "x,4,2", "48,4,2", "32,3,2"):
        monkeypatch.setenv(fla_tree_state.ENV + "_CONFIG", bad)
        with pytest.raises(ValueError, match="TREEFX_FLA_TREE_STATE_CONFIG"):
            fla_tree_state._config()


def test_the_kernels_equal_the_reference_under_tritons_interpreter():
    out = run_under_tritons_interpreter("benchmarks.fla_check", "--cases",
                                        "interpret-state")
    assert '"case": "state-pass"' in out


@pytest.mark.parametrize("dtype,key_dim", [("bf16", 128), ("fp32", 128), ("bf16", 64)])
def test_the_kernels_compile_for_hopper(dtype, key_dim):
    """Triton's compiler for sm_90 (no GPU needed): the kernels' code generation, type checks
    included, for both dtypes, with and without the roots' states and the final states'
    gradient (the interpreter does not type-check loop-carried values)."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter does not compile")
    from triton.backends.compiler import GPUTarget

    st = fla_tree_state
    ints = {"flags", "counter", "parent", "root_row", "fin_slot", "keep_row", "child_ptr",
            "child_idx"}

    def compile_(kernel, row_ptrs, optional, consts):
        types = {}
        for name in kernel.arg_names:
            if name in row_ptrs:
                types[name] = "*" + dtype
            elif name in optional:
                types[name] = "*fp32" if optional[name] else "constexpr"
            elif name in ("fin", "g", "dh0"):
                types[name] = "*fp32"
            elif name in ints:
                types[name] = "*i32"
            elif name in ("cu", "choff"):
                types[name] = "*i64"
            else:
                types[name] = {"scale": "fp32", "N": "i32"}.get(name, "constexpr")
        consts = {**consts, **{k: None for k, on in optional.items() if not on}}
        src = triton.compiler.ASTSource(
            fn=kernel, signature=types,
            constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=2))

    shape = dict(H=32, K=key_dim, V=128, BT=64, BV=32, NV=4)
    for on in (True, False):
        assert compile_(st._tree_fwd_h_kernel, {"k", "u", "w", "v_new", "h"}, {"h0": on},
                        {**shape, "USE_H0": on}).asm["ptx"]
        assert compile_(st._tree_bwd_dhu_kernel, {"q", "k", "w", "do", "dh", "dv", "dv2"},
                        {"dht": on}, {**shape, "USE_H0": on, "USE_DHT": on}).asm["ptx"]
