"""Log-probs without autograd (TRL's GRPO: old and reference log-probs) on batches on both
sides of one block captured once: the whole tree's FlexAttention site pads its usual layout's
query row by one block, so Inductor's choice of its decoding kernel for rows of fewer than 128
queries (read off the query length even where treefx forces the standard kernel) puts no
guard on the token count. Checked on the CPU as test_parts_captures checks the part sites:
every query length FlexAttention is traced with is statically 128 or more; one capture for
the long batch and the short one, in either order; log-probs the oracle's."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from support import VOCAB, hf_model
from test_parts_captures import _query_lengths, recaptures_logged
from trees import check_forward

import treefx

transformers = pytest.importorskip("transformers")


def _forest(seed: int, sequences: int, length: tuple[int, int]) -> list[treefx.Tree]:
    """Prompts each with a few completions."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(sequences):
        prompt = rng.integers(1, VOCAB, rng.integers(*length)).tolist()
        seqs += [prompt + rng.integers(1, VOCAB, rng.integers(*length)).tolist()
                 for _ in range(2)]
    return [treefx.Tree.from_sequences(seqs)]


LONG = _forest(0, 6, (10, 30))  # 150 tokens or more
SHORT = _forest(1, 2, (8, 14))  # under one block


def _graphs(tm):
    return [g for gs in tm.engine._regional.values() for g in gs]


@pytest.mark.parametrize("order", ["long first", "short first"])
@pytest.mark.parametrize("backend,regional", [("flex-eager", None), ("aot-eager", True)])
def test_no_grad_log_probs_capture_once_on_both_sides_of_a_block(backend, regional, order,
                                                                 monkeypatch):
    """A compiled model run without autograd on a forest of more than one block and one of
    fewer than 128 tokens (either order): one capture (the engine's count, no regional
    capture again), every query length FlexAttention is traced with statically 128 or more,
    and the log-probs the oracle's."""
    assert treefx.pack(LONG).num_tokens > 128 > treefx.pack(SHORT).num_tokens
    forests = (LONG, SHORT) if order == "long first" else (SHORT, LONG)
    # in eval mode: its no-grad graph (in training mode its no-grad calls would run the
    # training graph, tests/test_no_grad_runs_training.py)
    model = hf_model("qwen3", "sdpa").eval()
    queries = _query_lengths(monkeypatch)
    with recaptures_logged() as recaptures:
        tm = treefx.compile(model, backend=backend, regional=regional, verify=False)
        for trees in (*forests, *forests):
            check_forward(tm, trees, atol=1e-5)
            assert tm.engine.num_compilations == 1
    assert recaptures.seen and not recaptures.lines, recaptures.lines
    if regional:
        assert len(_graphs(tm)) == 1
    # the site's usual layout (the default without autograd), its query row a block longer
    sites = {s for ctx in tm.contexts for s in _flex_sites(ctx)}
    # (regionally, layers alike share one compiled piece: the others' sites never run)
    assert set().union(*(s.layouts for s in sites)) == {"standard"}
    assert all(ok for _, ok in queries), queries
    if regional:  # the pieces traced through AOTAutograd (the eager backend runs the site)
        assert queries and {grad for grad, _ in queries} == {False}


def _flex_sites(ctx):
    from treefx.ops.attention.flex import TreeFlexAttention

    return [n.target for scope in ctx.scopes() for n in scope.graph.nodes
            if isinstance(n.target, TreeFlexAttention)]


def test_rows_guaranteed_safe_keeps_the_row_as_it_is():
    """With ROWS_GUARANTEED_SAFE (no row sees no key) the usual layout is not padded: the
    query row FlexAttention gets is the tokens', and the values are the same."""
    from treefx.mask import tree_block_tensors
    from treefx.ops.attention import TreeFlexAttention

    batch = treefx.pack(SHORT)
    se, pos = batch.subtree_end, batch.position_ids[0]
    n = se.shape[0]
    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, 128)
    from treefx.mask import pad_to_block

    pos_pad = pad_to_block(pos, 128)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 8) for _ in range(3))
    lengths = []
    outs = []
    for options in (None, {"ROWS_GUARANTEED_SAFE": True}):
        site = TreeFlexAttention(kernel_options=options, interleave_heads=False)
        call = site._call_flex

        def recording(q_, *args, call=call):
            lengths.append(q_.shape[-2])
            return call(q_, *args)

        site._call_flex = recording
        with torch.no_grad():
            outs.append(site(q, k, v, kv_num, kv_idx, full_num, full_idx, se_pad, pos_pad))
    assert lengths == [n + 128, n]
    assert outs[0].shape == q.shape
    torch.testing.assert_close(outs[0], outs[1])
