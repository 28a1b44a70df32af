"""The FlexAttention sites' data layout: KV heads shared natively (the model's repeat undone)
and the KV heads interleaved along the row (``interleave_heads``). Same values as the dense
tree attention and the per-branch oracle; the interleaved block mask checked element by element
against the dense tree mask, as the GPU kernel reads it (full blocks unmasked, partial blocks
through the mask_mod, unlisted blocks never)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from trees import check_forward, odd_forest

import treefx
from treefx.mask import dense_tree_mask, tree_block_tensors
from treefx.ops.attention import (
    TreeFlexAttention,
    heads_to_row,
    interleave_block_tensors,
    interleaved_block_mask,
    row_to_heads,
)
from treefx.compiler.patterns import repeated_heads_source as _repeated_heads_source

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _row(seed=0):
    batch = treefx.pack(odd_forest(seed, VOCAB))
    return batch.subtree_end, batch.position_ids[0]


def _listed(num, idx, rows, cols):
    """[rows, cols] bool: block (r, c) listed in a BlockMask's (num, indices)."""
    out = torch.zeros(rows, cols, dtype=torch.bool)
    for r in range(rows):
        out[r, idx[0, 0, r, : num[0, 0, r]].long()] = True
    return out


@pytest.mark.parametrize("kv_heads,group,bs", [(2, 2, 16), (3, 1, 16), (4, 2, 32), (1, 3, 16)])
def test_interleaved_block_mask_is_the_tree_mask_per_head(kv_heads, group, bs):
    se, _ = _row()
    n = se.numel()
    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, bs)
    nb = kv_num.shape[-1]
    partial = _listed(*interleave_block_tensors(kv_num, kv_idx, kv_heads), nb * kv_heads,
                      nb * kv_heads)
    full = _listed(*interleave_block_tensors(full_num, full_idx, kv_heads), nb * kv_heads,
                   nb * kv_heads)
    assert not (partial & full).any()
    length = nb * kv_heads * bs
    mask_mod = TreeFlexAttention(block_size=bs, interleave_heads=True)._interleaved_mask_mod(
        kv_heads, group)
    qi, ki = torch.arange(length)[:, None], torch.arange(length)[None, :]
    pos = torch.zeros_like(se_pad)
    truth = dense_tree_mask(se)
    for h in range(group):
        elem = mask_mod(0, torch.tensor(h), qi, ki, se_pad, pos)
        grow = lambda m: m.repeat_interleave(bs, 0).repeat_interleave(bs, 1)  # noqa: E731
        seen = grow(full) | (grow(partial) & elem)
        # Back to [head, row position] coordinates: every real query row sees exactly its
        # tree keys in its own KV head and nothing in another head.
        as_heads = seen.view(nb, kv_heads, bs, nb, kv_heads, bs)
        for g in range(kv_heads):
            for g2 in range(kv_heads):
                blockwise = as_heads[:, g, :, :, g2, :].reshape(nb * bs, nb * bs)[:n, :n]
                expect = truth if g == g2 else torch.zeros_like(truth)
                assert torch.equal(blockwise, expect), (g, g2)
        # Padded keys are seen by no query row at all (their values are zeros).
        key_pad = (torch.arange(length) // (bs * kv_heads)) * bs + torch.arange(length) % bs >= n
        assert not seen[:, key_pad].any()
    # The backward's side (query blocks per kv block) is the transpose of the forward's, for
    # the partial and the full blocks, and no index tensor is wider than the usual row's.
    from torch.nn.attention.flex_attention import BlockMask

    std = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=bs,
                                   seq_lengths=(n, n))
    bm = interleaved_block_mask(std, kv_heads, length, mask_mod)
    rows = nb * kv_heads
    assert torch.equal(_listed(bm.kv_num_blocks, bm.kv_indices, rows, rows), partial)
    assert torch.equal(_listed(bm.full_kv_num_blocks, bm.full_kv_indices, rows, rows), full)
    assert torch.equal(_listed(bm.q_num_blocks, bm.q_indices, rows, rows), partial.T)
    assert torch.equal(_listed(bm.full_q_num_blocks, bm.full_q_indices, rows, rows), full.T)
    for t in (bm.kv_indices, bm.full_kv_indices, bm.q_indices, bm.full_q_indices):
        assert t.shape[-1] == nb


def test_row_permutation_round_trip():
    x = torch.randn(1, 6, 37, 4)
    for kv_heads in (1, 2, 3, 6):
        row = heads_to_row(x, kv_heads, nb=3, block=16)
        assert row.shape == (1, 6 // kv_heads, 3 * kv_heads * 16, 4)
        assert torch.equal(row_to_heads(row, kv_heads, 3, 16, 37), x)
    # Block b of KV head g sits at row block b * kv_heads + g.
    row = heads_to_row(x, 3, nb=3, block=16)
    torch.testing.assert_close(row[0, 1, (2 * 3 + 1) * 16:(2 * 3 + 1) * 16 + 5],
                               x[0, 1 * 2 + 1, 32:37])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3), (6, 2), (2, 1)])
def test_interleaved_op_matches_dense_tree_attention(heads, kv_heads):
    """Values and the model's own mask (a window of 2 + h positions for query head h, read
    at path positions, so the head index must come back right) through the op."""
    torch.manual_seed(0)
    se, pos = _row(1)
    n = se.numel()
    q, k, v = (torch.randn(1, h, n, 8, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    head = torch.arange(heads)[:, None, None]
    window = (pos[None, :, None] - pos[None, None, :]) < 2 + head
    dense = dense_tree_mask(se)[None] & window
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[None], enable_gqa=True)

    def model_mask(b, h, qp, kp):
        return qp - kp < 2 + h

    bs = 16
    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, bs, full=False)
    pos_pad = F.pad(pos, (0, se_pad.numel() - n))
    for inter in (False, True):
        op = TreeFlexAttention(block_size=bs, model_mask=model_mask, interleave_heads=inter)
        out = op(q, k, v, kv_num, kv_idx, full_num, full_idx, se_pad, pos_pad)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def _hf(impl, dtype=torch.float64, **over):
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, **over)
    config = transformers.AutoConfig.for_model(over.pop("model_type", "qwen3"), **cfg)
    config._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("interleave", [False, True])
def test_flex_sites_share_kv_heads_and_match_the_oracle(impl, interleave):
    """Hugging Face repeats the KV heads before its attention; at a FlexAttention site treefx
    takes the model's own KV heads instead (the note says so), with or without interleaving,
    and the log-probs still equal each sequence run alone."""
    model = _hf(impl)
    tm = treefx.compile(model, backend="flex-eager", interleave_heads=interleave)
    check_forward(tm, odd_forest(2, VOCAB), atol=1e-6)
    ctx = tm.contexts[0]
    sites = [n for n in ctx.gm.graph.nodes if isinstance(n.target, TreeFlexAttention)]
    assert len(sites) == 2
    for s in sites:
        assert s.target.interleave_heads is interleave
        q, k, v = (a.meta["example_value"] for a in s.args[:3])
        assert (q.shape[1], k.shape[1], v.shape[1]) == (4, 2, 2)
    notes = [r.note for r in ctx.log if r.pass_name == "attention"]
    assert all("KV heads shared" in n for n in notes), notes
    assert all(("interleaved along the row" in n) is interleave for n in notes), notes


class _Tiled(torch.nn.Module):
    """Attention whose KV heads are *tiled* (head j uses KV head j % 2), written with the same
    expand + reshape as a repeat but on another dim: not GQA's grouping, must not be undone."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.q = torch.nn.Linear(16, 16)
        self.kv = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, 2, 4).permute(2, 0, 3, 1, 4)
        k = k[:, None].expand(b, 2, 2, t, 4).reshape(b, 4, t, 4)
        v = v[:, None].expand(b, 2, 2, t, 4).reshape(b, 4, t, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, 16))


def test_tiled_kv_heads_are_not_mistaken_for_gqa():
    torch.manual_seed(0)
    model = _Tiled().double()
    tm = treefx.compile(model, backend="flex-eager")
    check_forward(tm, odd_forest(3, VOCAB), atol=1e-9)
    (site,) = [n for n in tm.contexts[0].gm.graph.nodes if isinstance(n.target, TreeFlexAttention)]
    assert site.args[1].meta["example_value"].shape[1] == 4
    assert not any("KV heads shared" in r.note for r in tm.contexts[0].log)


def _traced(fn, *shapes):
    """``fn`` traced to FX with example values on every node (as Dynamo leaves them)."""
    gm = fx.symbolic_trace(fn)

    class Record(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["example_value"] = out
            return out

    Record(gm).run(*(torch.randn(*s) for s in shapes))
    return gm


@pytest.mark.parametrize("fn,found", [
    (lambda x: x[:, :, None, :, :].expand(1, 2, 3, 5, 4).reshape(1, 6, 5, 4), True),
    (lambda x: x.unsqueeze(2).expand(1, 2, 3, 5, 4).reshape(1, 6, 5, 4), True),
    (lambda x: torch.repeat_interleave(x, 3, dim=1), True),
    (lambda x: x.repeat_interleave(3, 1), True),
    (lambda x: x[:, None].expand(1, 3, 2, 5, 4).reshape(1, 6, 5, 4), False),  # tiled
    (lambda x: x.repeat(1, 3, 1, 1), False),  # tiled
    (lambda x: x[:, :, :, None].expand(1, 2, 5, 3, 4).reshape(1, 2, 15, 4), False),
    (lambda x: torch.repeat_interleave(x, 3, dim=2), False),
    (lambda x: x[:, :, None, :, :].expand(1, 2, 1, 5, 4).reshape(1, 2, 5, 4), False),
])
def test_repeated_heads_source(fn, found):
    gm = _traced(fn, (1, 2, 5, 4))
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    x = [n for n in gm.graph.nodes if n.op == "placeholder"][0]
    assert (_repeated_heads_source(out) is x) is found


@pytest.mark.parametrize("backend", [pytest.param("aot-eager", marks=pytest.mark.slow),
                                     "flex-eager"])
def test_default_interleaves_where_gradients_flow(backend):
    """``interleave_heads=None`` (the default): interleaved in a graph that computes gradients
    (the backward is what gains), the usual layout without autograd; exact either way."""
    model = _hf("sdpa")
    for grad, layout in ((False, "standard"), (True, "interleaved")):
        tm = treefx.compile(model, backend=backend)
        check_forward(tm, odd_forest(4, VOCAB), atol=1e-9, grad=grad)
        sites = [n.target for n in tm.contexts[0].gm.graph.nodes
                 if isinstance(n.target, TreeFlexAttention)]
        assert len(sites) == 2 and all(s.layouts == {layout} for s in sites), grad
    # ROWS_GUARANTEED_SAFE rules the interleaved row out: the default becomes the usual one.
    safe = treefx.compile(model, kernel_options={"ROWS_GUARANTEED_SAFE": True})
    assert safe.engine.interleave_heads is False


@pytest.mark.parametrize("bad,err,match", [
    ("yes", TypeError, "True, False or None"),
    (1, TypeError, "True, False or None"),
])
def test_interleave_heads_refused(bad, err, match):
    with pytest.raises(err, match=match):
        treefx.compile(_hf("sdpa"), interleave_heads=bad)


def test_interleave_heads_refuses_rows_guaranteed_safe():
    with pytest.raises(ValueError, match="ROWS_GUARANTEED_SAFE"):
        treefx.compile(_hf("sdpa"), interleave_heads=True,
                       kernel_options={"ROWS_GUARANTEED_SAFE": True})
    with pytest.raises(ValueError, match="ROWS_GUARANTEED_SAFE"):
        treefx.step(lambda m, b: m(**b).loss, interleave_heads=True,
                    kernel_options={"ROWS_GUARANTEED_SAFE": True})


@pytest.mark.parametrize("grad", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_one_graph_for_rows_of_one_block_and_more(grad):
    """Rows shorter than a block, of exactly one block and of several share one graph (traced
    by AOTAutograd: the usual layout without autograd, the interleaved one with it). Without
    the spare block a one-block row was a graph of its own (a size that may be 1 is guarded),
    and so was a row of whole blocks (its padding then has length 0)."""
    model = _hf("sdpa", dtype=torch.float32)
    tm = treefx.compile(model, backend="aot-eager")
    for n in (50, 128, 200, 256):
        a, b = n // 2, n - n // 2 - n // 4
        tree = treefx.Tree.from_sequences([[3] * a + [4] * b, [3] * a + [5] * (n - a - b)])
        out = check_forward(tm, [tree], atol=1e-5, grad=grad)
        assert out.token_logprobs.shape[-1] == n
    assert tm.num_compilations == 1
