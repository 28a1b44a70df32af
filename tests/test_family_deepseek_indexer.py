"""Key selection (DeepSeek Sparse Attention's indexer): a top-k over the keys of each query's
score row, scattered into the attention mask. On the tree the row must hold the query's
ancestors only (the selection pass ANDs the tree mask into the top-k's mask), and the
selection may only reach tree attention; anything else is refused, naming the node."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import check_against_oracle
from trees import check_forward, odd_forest

import treefx

VOCAB = 64


class IndexerLM(torch.nn.Module):
    """Two layers of attention, each over the ``topk`` keys an indexer scores highest among
    the causal ones (DeepSeek-V3.2's form: relu'd per-head dot products, weighted per query,
    summed over the heads). ``how``: how the indexer masks its scores ("blocked":
    ``masked_fill(~causal, -inf)``, "allowed": ``where(causal, s, -inf)``, "additive":
    ``s + mask`` with the attention's additive mask, as Hugging Face's eager path has it).
    ``misuse``: the selection used in a way treefx refuses.

    The indexer reads learned position embeddings and has 16 heads, as a real indexer's keys
    carry RoPE: scores that tie exactly (the same token twice, every head's relu at zero)
    make the top-k pick by its implementation, which the sequence alone and the tree row
    need not share (see treefx.families.deepseek_indexer)."""

    def __init__(self, topk=3, how="blocked", misuse=None, heads=4, dim=32, iheads=16):
        super().__init__()
        self.topk, self.how, self.misuse = topk, how, misuse
        self.heads, self.iheads = heads, iheads
        self.emb = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Embedding(64, dim)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(2))
        self.iq = torch.nn.ModuleList(torch.nn.Linear(dim, iheads * 8) for _ in range(2))
        self.ik = torch.nn.ModuleList(torch.nn.Linear(dim, 8) for _ in range(2))
        self.iw = torch.nn.ModuleList(torch.nn.Linear(dim, iheads) for _ in range(2))
        self.out = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))
        self.head = torch.nn.Linear(dim, VOCAB)

    def select(self, i, x, causal, additive):
        b, n, _ = x.shape
        q = self.iq[i](x).view(b, n, self.iheads, 8)
        k = self.ik[i](x)
        s = F.relu(torch.einsum("bqhd,bkd->bqhk", q, k))
        scores = (self.iw[i](x).unsqueeze(-2) @ s).squeeze(-2)  # [B, N, N]
        if self.misuse == "unmasked":
            pass
        elif self.how == "blocked":
            scores = scores.masked_fill(~causal, float("-inf"))
        elif self.how == "allowed":
            scores = torch.where(causal, scores, float("-inf"))
        else:
            scores = scores + additive[:, 0]
        top = scores.topk(min(self.topk, n), dim=-1)
        if self.misuse == "values":
            return top.indices, top.values
        return top.indices, None

    def layer(self, i, x, causal, additive):
        b, n, d = x.shape
        h = self.heads
        idx, values = self.select(i, x, causal, additive)
        dropped = idx.new_ones((b, n, n), dtype=torch.bool).scatter(-1, idx.long(), False)
        q, k, v = (t.view(b, n, h, d // h).transpose(1, 2) for t in self.qkv[i](x).chunk(3, -1))
        if self.how == "additive":
            mask = additive.masked_fill(dropped[:, None], torch.finfo(x.dtype).min)
        else:
            mask = causal[:, None] & ~dropped[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out[i](o.transpose(1, 2).reshape(b, n, d))
        if values is not None:
            x = x + values.mean(-1, keepdim=True)
        if self.misuse == "gather":  # the selected keys' inputs, gathered
            x = x + x[0, idx[0, :, 0]].unsqueeze(0)
        if self.misuse == "first":  # whether the first key was dropped, into the hidden state
            x = x + dropped[:, :, :1].float()
        return x

    def forward(self, input_ids):
        n = input_ids.shape[1]
        pos = torch.arange(n, device=input_ids.device)
        x = self.emb(input_ids) + self.pos(pos)
        causal = (pos[None, :] <= pos[:, None])[None]  # [1, N, N]
        additive = torch.zeros(1, 1, n, n, dtype=x.dtype, device=x.device).masked_fill(
            ~causal[:, None], torch.finfo(x.dtype).min)
        for i in range(2):
            x = self.layer(i, x, causal, additive)
        return self.head(x)


def selections(tm) -> list:
    return [r for c in tm.contexts for r in c.log if r.pass_name == "selection"]


@pytest.mark.parametrize("how, topk", [
    ("blocked", 2), ("allowed", 3), ("additive", 2),
    pytest.param("blocked", 1, marks=pytest.mark.slow),
])
def test_hand_written_indexer_matches_oracle(how, topk):
    torch.manual_seed(topk)
    tm = treefx.compile(IndexerLM(topk=topk, how=how), backend="eager", verify=False)
    check_against_oracle(tm, odd_forest(4, VOCAB))
    assert len(selections(tm)) == 2


def test_a_topk_wider_than_every_sequence_keeps_every_ancestor():
    """k above every sequence's length: the sequence alone keeps all its keys; on the tree a
    query's row has fewer finite scores than k, and the rest of its k are other branches'
    keys, which the tree attention masks out."""
    torch.manual_seed(1)
    tm = treefx.compile(IndexerLM(topk=40), backend="eager", verify=False)
    check_against_oracle(tm, odd_forest(2, VOCAB))


def test_without_the_tree_mask_the_selection_is_wrong():
    """The rewrite is what makes it exact: with the selection pass's tree mask taken out, the
    same model on the same trees differs from the oracle."""
    import treefx.compiler.pipeline as passes
    from treefx.families import deepseek_indexer as selection

    def mark_only(ctx):  # the selection's checks and marks, without the tree mask
        for node in list(ctx.graph.nodes):
            if selection.is_call(node, torch.topk, methods=("topk",)):
                selection._check_uses(ctx, node)
        return 0

    torch.manual_seed(3)
    model = IndexerLM(topk=2)
    trees = odd_forest(4, VOCAB)
    saved = passes.PASSES
    passes.PASSES = tuple((n, mark_only if n == "selection" else f) for n, f in saved)
    try:
        tm = treefx.compile(model, backend="eager", verify=False)
        report = treefx.verify(tm, trees, params="all", raise_on_failure=False)
    finally:
        passes.PASSES = saved
    assert not report.passed


@pytest.mark.parametrize("misuse, match", [
    ("values", "values read"),
    ("unmasked", "does not mask"),
    ("gather", "indices used by"),
    ("first", "not only a tree attention"),
])
def test_a_selection_used_otherwise_is_refused(misuse, match):
    torch.manual_seed(0)
    tm = treefx.compile(IndexerLM(misuse=misuse), backend="eager", verify=False)
    with pytest.raises(treefx.TreeCompileError, match=match) as err:
        tm(treefx.pack(odd_forest(1, VOCAB)))
    assert "layer" not in str(err.value) or "graph node" in str(err.value)


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name, attn", [
    ("deepseek_v32", None),
    pytest.param("glm_moe_dsa", "eager", marks=pytest.mark.slow),
])
def test_hf_sparse_attention_matches_oracle(name, attn):
    from treefx.tools.zoo import all_model_types, build_model

    if name not in all_model_types():
        pytest.skip(f"{name} is not in this transformers")
    torch.manual_seed(0)
    model = build_model(name, attn_implementation=attn) if attn else build_model(name)
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, odd_forest(3, model.config.vocab_size))
    assert selections(tm)


@pytest.mark.parametrize("how", ["blocked", "additive"])
def test_flex_form_matches_oracle(how):
    """The inductor backend's graph run eagerly (forward only: FlexAttention has no backward
    on the CPU): the selection is data, so FlexAttention's score_mod reads the model's mask at
    the query's and key's rows, inside the tree's blocks."""
    torch.manual_seed(0)
    model = IndexerLM(topk=3, how=how).double()
    tm = treefx.compile(model, backend="flex-eager", verify=False)
    check_forward(tm, odd_forest(4, VOCAB), atol=1e-9, pad_to_multiple=16)
    notes = [r.note for c in tm.contexts for r in c.log if r.pass_name == "attention"]
    assert len(notes) == 2 and all("score_mod" in n for n in notes), notes


@pytest.mark.slow
def test_a_layer_reusing_the_previous_selection_matches_oracle_and_checkpointing_refuses():
    """GLM-MoE-DSA's "shared" indexer layers reuse the previous layer's top-k: exact; under
    activation checkpointing the indices would leave the checkpointed layer's graph, which
    treefx does not follow: a clear error."""
    from treefx.tools.zoo import all_model_types, build_model

    if "glm_moe_dsa" not in all_model_types():
        pytest.skip("glm_moe_dsa is not in this transformers")
    model = build_model("glm_moe_dsa", indexer_types=["full", "shared"])
    tm = treefx.compile(model, backend="eager", verify=False)
    check_against_oracle(tm, odd_forest(3, model.config.vocab_size))
    model = build_model("glm_moe_dsa", indexer_types=["full", "shared"], checkpointing=True)
    tm = treefx.compile(model, backend="eager", verify=False)
    with pytest.raises(treefx.TreeCompileError, match="handed out of the region"):
        tm(treefx.pack(odd_forest(1, model.config.vocab_size)))
