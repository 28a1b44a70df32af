"""The row's leading chain on a dense causal kernel (:mod:`treefx.ops.attention.trunk`): the op
against plain causal attention, the row count on the host and on the device, and models
through the FlexAttention sites with the split, whole and in parts, against the per-branch
oracle. On the CPU the split is taken only where ``TREEFX_TRUNK_ATTENTION=1`` asks (the op then
runs plain torch; cuDNN's kernel is checked on the GPU by ``benchmarks.gpu_check --cases
trunk``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import check_against_oracle, hf_model
from trees import odd_forest

import treefx
from treefx.ops.attention import TreeFlexAttention, trunk
from treefx.tools.synth import random_parent_row

transformers = pytest.importorskip("transformers")

VOCAB = 64


def comb(seed: int, trunk_len: int = 70) -> treefx.Tree:
    """A trunk of ``trunk_len`` tokens with leaves off it, the trunk itself a sequence and a
    prefix of it another (the layout puts the trunk first: the row starts with it)."""
    rng = np.random.default_rng(seed)
    t = rng.integers(0, VOCAB, trunk_len).tolist()
    leaf = rng.integers(0, VOCAB, 10).tolist()
    seqs = [t[:40] + leaf[:9], t[:60] + leaf[9:], t, t[:20], t[:41]]
    return treefx.Tree.from_sequences(seqs)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("offset", [0, 5])
def test_the_host_and_the_device_count_the_same_rows(seed, offset):
    """``trunk_rows`` (the op, on the host) and ``trunk_blocks`` (the FlexAttention site, on
    the device) agree, and the rows they give are a chain: each row's predecessor the row
    before, the first a root (or, in a part, the last of the context rows it sees)."""
    par = random_parent_row(seed, roots=1 + seed % 2)
    if offset:  # a part's rows: predecessors counted from where its own rows start
        par = np.where(par >= 0, par + offset, par)
    row = torch.from_numpy(par)
    for context in (False, True):
        for block in (1, 4, 16, 128):
            t0, k = trunk.trunk_rows(row, offset, block, context)
            assert int(trunk.trunk_blocks(row, offset, block, context)) * block == t0
            assert t0 % block == 0 and k == 0  # a random row starts at a root
            if t0:
                assert par[0] == -1 and (par[1:t0] == offset + np.arange(t0 - 1)).all()
            t, _ = trunk._chain(par, offset, context)
            assert t0 == t // block * block
            assert t == len(par) or par[t] != offset + t - 1


def test_a_part_row_starting_under_its_context_sees_all_of_it():
    """A part's first row is a child of the last context row: its chain sees the whole
    context (the path to it); a whole tree's row never starts so."""
    row = torch.tensor([3, 4, 5, 6, 7, 8, 2])  # own rows after 4 context rows (0..3)
    assert trunk.trunk_rows(row, 4, 1, context=True) == (6, 4)
    assert int(trunk.trunk_blocks(row, 4, 1, context=True)) == 6
    assert trunk.trunk_rows(row, 4, 1) == (0, 0)
    assert int(trunk.trunk_blocks(row, 4, 1)) == 0


def test_the_op_over_a_context_is_attention_over_the_context_and_the_chain():
    torch.manual_seed(0)
    a, hq, hk, d = 4, 4, 2, 8
    par = torch.tensor([2, a + 0, a + 1, a + 2, a + 3, a + 4, 1, a + 6])  # 3 real context rows
    n = par.numel()
    q = torch.randn(1, hq, n, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, hk, n, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    kc, vc = (torch.randn(1, hk, a, d, dtype=torch.float64, requires_grad=True)
              for _ in range(2))
    out = trunk.trunk_attention(q, k, v, par, a, None, 2, kc, vc)
    t0, seen = 6, 3
    keys = torch.cat([kc[:, :, :seen], k[:, :, :t0]], 2).repeat_interleave(2, 1)
    values = torch.cat([vc[:, :, :seen], v[:, :, :t0]], 2).repeat_interleave(2, 1)
    mask = torch.ones(t0, seen + t0, dtype=torch.bool)
    mask[:, seen:] = torch.ones(t0, t0, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q[:, :, :t0], keys, values, attn_mask=mask)
    torch.testing.assert_close(out[:, :, :t0], ref, atol=1e-13, rtol=0)
    assert out[:, :, t0:].abs().max() == 0
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, kc, vc), g)
    want = torch.autograd.grad(ref, (q, k, v, kc, vc), g[:, :, :t0])
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)
    torch.library.opcheck(torch.ops.treefx.trunk_causal_attention.default,
                          (q, k, v, kc, vc, par, a, 0.3, 2))


@pytest.mark.parametrize("group", [1, 2, 4])
def test_the_op_is_causal_attention_of_the_trunk_and_zero_after(group):
    torch.manual_seed(group)
    par = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6, 7, 2, 9, -1, 11])  # a chain of 9 rows
    n, hk, d = par.numel(), 2, 8
    q = torch.randn(1, hk * group, n, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, hk, n, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = trunk.trunk_attention(q, k, v, par, block=4)  # 8 rows: whole blocks of 4
    t0 = 8
    ref = F.scaled_dot_product_attention(q[:, :, :t0], k[:, :, :t0].repeat_interleave(group, 1),
                                         v[:, :, :t0].repeat_interleave(group, 1),
                                         is_causal=True)
    torch.testing.assert_close(out[:, :, :t0], ref, atol=1e-13, rtol=0)
    assert out[:, :, t0:].abs().max() == 0
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g[:, :, :t0])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    torch.library.opcheck(torch.ops.treefx.trunk_causal_attention.default,
                          (q, k, v, None, None, par, 0, 0.3, 4))


def test_wanted_on_the_gpu_in_half_precision_unless_switched(monkeypatch):
    x = torch.zeros(1, 4, 8, 16)
    monkeypatch.delenv(trunk.SWITCH, raising=False)
    assert not trunk.wanted(x, x[:, :2], x[:, :2])  # the CPU in float32: FlexAttention alone
    monkeypatch.setenv(trunk.SWITCH, "1")
    assert trunk.wanted(x, x[:, :2], x[:, :2])
    assert not trunk.wanted(x, x[:, :3], x[:, :3])  # heads that do not group
    monkeypatch.setenv(trunk.SWITCH, "0")
    assert not trunk.wanted(x, x[:, :2], x[:, :2])


def _split_sites(tm) -> list:
    return [r.note for c in tm.contexts for r in c.log
            if r.pass_name == "attention" and "dense causal kernel" in r.note]


@pytest.mark.parametrize("backend", ["flex-eager", "aot-eager"])
def test_whole_trees_with_the_split_match_the_oracle(backend, monkeypatch):
    """Qwen3 (float64) through the FlexAttention sites with the leading chain split off:
    log-probs and every gradient equal each sequence alone, on a comb whose trunk spans
    several blocks, on odd forests (whose first chains are short), and on both together."""
    monkeypatch.setenv(trunk.SWITCH, "1")
    tm = treefx.compile(hf_model("qwen3", "sdpa", torch.float64), backend=backend,
                        block_size=16)
    assert trunk.trunk_rows(treefx.pack([comb(0)]).parent_token, 0, 16) == (64, 0)
    for trees in ([comb(0)], odd_forest(3, VOCAB), [comb(1)] + odd_forest(1, VOCAB)):
        check_against_oracle(tm, trees, atol=1e-9, rtol=1e-6)
    assert len(_split_sites(tm)) == 2  # both layers' sites


def test_the_split_changes_nothing_at_the_site(monkeypatch):
    """The site's output with its first blocks skipped plus the op's rows is the site's
    output without the split (float64, both layouts)."""
    torch.manual_seed(0)
    from treefx.mask import tree_block_tensors

    batch = treefx.pack([comb(2)] + odd_forest(4, VOCAB))
    n, bs = batch.num_tokens, 16
    se, pos, par = batch.subtree_end, batch.position_ids[0], batch.parent_token
    q = torch.randn(1, 4, n, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for _ in range(2))
    blocks = tree_block_tensors(se, bs)
    pos_pad = F.pad(pos, (0, blocks[-1].numel() - n))
    skip = trunk.trunk_blocks(par, 0, bs)
    assert int(skip) == 4
    for inter in (False, True):
        site = TreeFlexAttention(block_size=bs, interleave_heads=inter)
        whole = site(q, k, v, *blocks, pos_pad)
        part = site(q, k, v, *blocks, pos_pad, skip_blocks=skip)
        assert part[:, :, :int(skip) * bs].abs().max() == 0
        split = part + trunk.trunk_attention(q, k, v, par, block=bs)
        torch.testing.assert_close(split, whole, atol=1e-13, rtol=0)


def test_parts_with_the_split_match_the_oracle(monkeypatch):
    """The inductor backend's part graph run op by op (as tests/test_parts.py does): a part
    that starts a tree takes its leading chain's rows on the causal kernel, a part under a
    context takes none; gradients and loss equal each sequence alone."""
    from test_parts import _check, comb_tree

    from treefx.run.parts import runners

    monkeypatch.setattr(treefx.run.backends, "compile_graph",
                        lambda backend, gm, ex, options=None: gm.forward)
    monkeypatch.setenv("TREEFX_INDUCTOR_ON_CPU", "1")
    monkeypatch.setenv(trunk.SWITCH, "1")
    seen = []  # (chain rows, context rows) of every call that computed rows
    pieces = trunk._pieces

    def recording(q, k, v, k_ctx, v_ctx, t0, kc):
        seen.append((t0, kc))
        return pieces(q, k, v, k_ctx, v_ctx, t0, kc)

    monkeypatch.setattr(trunk, "_pieces", recording)
    tm = treefx.compile(hf_model("qwen3", "sdpa", torch.float64), backend="inductor",
                        verify=False, block_size=16)
    for budget in (200, 48, 20):
        _check(tm, [comb(0)], budget, rtol=1e-6)
    # the parts that start a tree split their chain off; those under a context do not
    assert (64, 0) in seen and not any(kc for _, kc in seen)
    _check(tm, [comb_tree(3, calls=12, trunk=(5, 20))], 40, rtol=1e-6)
    notes = [r.note for r in runners(tm)[0].engine.contexts[-1].log
             if r.pass_name == "attention"]
    assert notes and all("dense causal kernel" in n for n in notes)


@pytest.mark.parametrize("model_type,checkpointing", [
    ("gpt2", False), ("falcon", False), ("deepseek_v3", False), ("exaone4", False),
    ("mixtral", False), ("exaone4", True), ("qwen3", True)])
def test_families_with_the_split_match_the_oracle(model_type, checkpointing, monkeypatch):
    """A sample of ``benchmarks.trunk_zoo`` (28 families, all exact): other families' attention
    (learned positions, ALiBi-free Falcon, MLA, sliding-window layers beside full ones, MoE)
    through the split, against each sequence alone; a windowed layer keeps FlexAttention.
    With activation checkpointing the sites are in the checkpointed bodies."""
    from benchmarks.trunk_zoo import run

    monkeypatch.setenv(trunk.SWITCH, "1")
    r = run(model_type, checkpointing)
    assert r["status"] == "exact", r
    assert r["split_sites"] == (1 if model_type == "exaone4" else 2), r


def test_a_step_with_the_split_matches_the_oracle(monkeypatch):
    """``@treefx.step`` (Hugging Face's ``labels=`` loss, fused with the output projection)
    lowers its attention the same way: loss and every gradient equal the per-sequence run."""
    from test_step import check_step, hf_labels_step

    monkeypatch.setenv(trunk.SWITCH, "1")
    model = hf_model("qwen3", "sdpa", torch.float64)
    step = treefx.step(hf_labels_step, backend="flex-eager", block_size=16)
    check_step(step, model, [comb(0)] + odd_forest(5, VOCAB), "mean", rtol=1e-6)
    notes = [r.note for c in step.contexts for r in c.log if r.pass_name == "attention"]
    assert notes and all("dense causal kernel" in n for n in notes)


def test_the_skipped_block_counts_are_an_opaque_op():
    """The first query blocks' key-block counts are zeroed by ``treefx::skip_query_blocks``, an
    op of its own (a fixed-layout buffer for Inductor; as a pointwise ``where`` the counts
    reached FlexAttention's template unrealized in a forward without autograd, and Inductor
    failed to lower it on the GPU): its values are the rows from ``skip`` on, and a traced
    site computes both counts (partial and full blocks) with it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from treefx.mask import skip_query_blocks, tree_block_tensors

    num = torch.arange(1, 8, dtype=torch.int32).reshape(1, 1, 7)
    out = skip_query_blocks(num, torch.tensor(3))
    assert out.tolist() == [[[0, 0, 0, 4, 5, 6, 7]]] and num.tolist() == [[[1, 2, 3, 4, 5, 6, 7]]]
    batch = treefx.pack([comb(2)])
    n, bs = batch.num_tokens, 16
    blocks = tree_block_tensors(batch.subtree_end, bs)
    pos_pad = F.pad(batch.position_ids[0], (0, blocks[-1].numel() - n))
    skip = trunk.trunk_blocks(batch.parent_token, 0, bs)
    q = torch.randn(1, 4, n, 8)
    k, v = (torch.randn(1, 2, n, 8) for _ in range(2))
    site = TreeFlexAttention(block_size=bs, interleave_heads=False)
    with torch.no_grad():
        gm = make_fx(lambda *a: site(*a, skip_blocks=skip))(q, k, v, *blocks, pos_pad)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.treefx.skip_query_blocks.default) == 2  # kv and full counts
