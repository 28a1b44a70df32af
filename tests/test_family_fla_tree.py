"""Gated DeltaNet over a whole tree on fla in one pass per stage (treefx.families.fla_tree):
the depth-ordered layout it plans on the host, and where it steps aside. fla's kernels need a
GPU or Triton's interpreter: the values and gradients are checked by
``benchmarks/fla_check.py --cases exact`` (GPU; on the CPU under the interpreter by
``benchmarks/fla_tree_interpret.py``, removed in issue 67, its findings in BENCHMARKS.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treefx.families import fla_tree
from treefx.ops.recurrence.reference import _tree_nodes
from treefx.tools.synth import random_parent_row


def _random_row(seed: int) -> np.ndarray:
    """A DFS row of a forest of two random trees, node lengths across 64-token chunks and of
    one token, up to four depths."""
    return random_parent_row(seed, lengths=(1, 3, 17, 64, 65, 129))


def _chunks(lengths) -> list[tuple[int, int]]:
    return [(i, c) for i, n in enumerate(lengths) for c in range(-(-n // 64))]


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_lays_the_tree_out_depth_by_depth(seed):
    row = _random_row(seed)
    assert seed or max(_tree_nodes(row)[3]) >= 2  # a tree whose DFS and depth orders differ
    nodes = _tree_nodes(row)
    starts, lengths, parents, depth = nodes
    keep = tuple(sorted({0, len(starts) - 1, len(starts) // 2}))
    p = fla_tree.plan(nodes, keep, heads=4, device="cpu")
    order = sorted(range(len(starts)), key=lambda i: (depth[i], i))
    tokens = [t for i in order for t in range(starts[i], starts[i] + lengths[i])]
    if order == list(range(len(starts))):
        assert p.perm is None and p.inv is None
    else:
        assert p.perm.tolist() == tokens
        assert p.inv[p.perm].tolist() == list(range(len(row)))
    cu = np.concatenate([[0], np.cumsum([lengths[i] for i in order])])
    assert p.cu.tolist() == cu.tolist()
    assert [tuple(x) for x in p.ci.tolist()] == _chunks([lengths[i] for i in order])
    at, kept = 0, []
    for d, lv in enumerate(p.levels):
        mine = [i for i in order if depth[i] == d]
        assert (lv.a, lv.b, lv.n) == (int(cu[at]), int(cu[at + len(mine)]), len(mine))
        assert lv.cu.tolist() == (cu[at:at + len(mine) + 1] - cu[at]).tolist()
        assert [tuple(x) for x in lv.ci.tolist()] == _chunks([lengths[i] for i in mine])
        if d == 0:
            assert lv.parent_rows is None
        else:  # each node's row among the depth above's nodes is its parent's
            above = [i for i in order if depth[i] == d - 1]
            assert [above[r] for r in lv.parent_rows.tolist()] == [parents[i] for i in mine]
        has_children = any(parents[j] in mine for j in range(len(starts)))
        assert lv.final == (has_children or any(i in keep for i in mine))
        rows = [] if lv.keep_rows is None else lv.keep_rows.tolist()
        assert [mine[r] for r in rows] == [i for i in mine if i in keep]
        assert lv.keep_at == len(kept)
        kept += [mine[r] for r in rows]
        at += len(mine)
    assert p.keep_nodes == kept and sorted(kept) == list(keep)


def test_a_tree_past_cudas_grid_takes_the_depth_by_depth_path():
    # 40,000 one-token roots x 2 heads: one state pass would launch 80,000 blocks on an axis
    row = np.full(40_000, -1)
    assert fla_tree.plan(_tree_nodes(row), (), heads=2, device="cpu") is None
    assert fla_tree.plan(_tree_nodes(row[:1000]), (), heads=2, device="cpu") is not None


def test_the_one_pass_path_steps_aside_without_fla_0_4_2_or_when_turned_off(monkeypatch):
    row = _random_row(0)
    nodes = _tree_nodes(row)
    n = len(row)
    seq = {name: torch.zeros(1, n, 2, 8) for name in ("query", "key", "value")}
    seq.update(g=torch.zeros(1, n, 2), beta=torch.zeros(1, n, 2))
    monkeypatch.setitem(fla_tree._KERNELS, "k", None)  # fla missing or another version
    assert fla_tree.tree_gated_delta_rule(seq, {}, nodes, None, ()) is None
    monkeypatch.setenv(fla_tree.ENV, "0")
    monkeypatch.setitem(fla_tree._KERNELS, "k", {"not": "used"})
    assert fla_tree.tree_gated_delta_rule(seq, {}, nodes, None, ()) is None


def test_a_row_of_separate_sequences_runs_flas_own_entry_point(monkeypatch):
    """Roots alone (separate sequences, packing's layout) step aside to fla's own
    variable-length call: no plan is made, no stage of this path runs."""
    row = np.concatenate([np.r_[-1, np.arange(n - 1)] + s for s, n in ((0, 5), (5, 70), (75, 1))])
    row[[0, 5, 75]] = -1
    nodes = _tree_nodes(row)
    assert max(nodes[3]) == 0 and len(nodes[0]) == 3
    n = len(row)
    seq = {name: torch.zeros(1, n, 2, 8) for name in ("query", "key", "value")}
    seq.update(g=torch.zeros(1, n, 2), beta=torch.zeros(1, n, 2))
    monkeypatch.delenv(fla_tree.ENV, raising=False)
    monkeypatch.setitem(fla_tree._KERNELS, "k", {"not": "used"})
    monkeypatch.setattr(fla_tree, "plan", lambda *a, **k: pytest.fail("planned"))
    assert fla_tree.tree_gated_delta_rule(seq, {}, nodes, None, ()) is None


def test_the_checked_fla_is_the_gates_known_good_one():
    from treefx.families import fla

    for version in fla_tree.CHECKED_FLA:
        ok, _ = fla.gate("gated_delta_rule", version, "3.6.0", (9, 0), False, 128)
        assert ok


def test_run_tree_hands_the_whole_tree_to_tree_varlen():
    """run_tree gives a recurrence's ``tree_varlen`` the DFS row, the nodes, the depth-0
    nodes' initial states (zeros where ``root_state`` gives none; None where it gives none at
    all) and the nodes whose final states it must hand back, and returns its result as is."""
    import dataclasses

    from treefx.compiler.recurrences import recurrence
    from treefx.ops.recurrence import kernel_runs
    from treefx.ops.recurrence.reference import run_tree

    row = _random_row(1)
    nodes = _tree_nodes(row)
    starts, _, _, depth = nodes
    n = len(row)
    seen = []
    out = torch.randn(1, n, 2, 8)
    fin = {3: torch.randn(2, 8, 8)}

    def whole(seq, static, got_nodes, root_init, keep):
        seen.append((seq, static, got_nodes, root_init, keep))
        return out, fin

    rec = dataclasses.replace(recurrence("qwen3_next_gated_delta_rule"), tree_varlen=whole,
                              varlen_devices=("cpu",), varlen_check=None)
    x = [torch.randn(1, n, 2, 8) for _ in range(3)]
    roots = [i for i, d in enumerate(depth) if d == 0]
    state = torch.randn(2, 8, 8)
    kwargs = dict(g=torch.zeros(1, n, 2), beta=torch.zeros(1, n, 2), use_qk_l2norm_in_kernel=True)
    before = kernel_runs().get((rec.name, "tree"), 0)
    got = run_tree(rec, torch.from_numpy(row), tuple(x), kwargs, nodes=nodes, keep=[3],
                   root_state=lambda t: state if t == starts[roots[1]] else None)
    assert got[0] is out and got[1] is fin and got[2] == nodes
    assert kernel_runs()[(rec.name, "tree")] == before + 1
    seq, static, got_nodes, root_init, keep = seen[0]
    assert seq["query"] is x[0] and static["use_qk_l2norm_in_kernel"] and keep == (3,)
    assert got_nodes == nodes and root_init.shape == (len(roots), 2, 8, 8)
    assert torch.equal(root_init[1], state) and not root_init[0].any()
    run_tree(rec, torch.from_numpy(row), tuple(x), kwargs, nodes=nodes)
    assert seen[1][3] is None and seen[1][4] == ()


def test_a_plan_made_under_inference_mode_serves_a_later_step_with_autograd():
    """Log-probabilities under torch.inference_mode(), then a training step on the same tree:
    the plan is reused, so its index tensors must not be inference tensors (autograd saves
    them)."""
    nodes = _tree_nodes(_random_row(0))
    with torch.inference_mode():
        p = fla_tree.plan(nodes, (0,), heads=2, device="cpu")
    x = torch.randn(len(p.perm), 3, requires_grad=True)
    x.index_select(0, p.perm).sum().backward()
    assert not p.perm.is_inference() and not p.levels[1].parent_rows.is_inference()
