"""Position-dependent attention a model builds from tables and from the attention mask:
GPT-Neo's local-attention table and MPT's ALiBi table, each cut to the token count; Falcon's
ALiBi and Llama 4's chunked attention, both from a ``cumsum`` of the all-ones attention mask.
The positions pass reads them at path positions (each query at its own prefix length), so the
attention pass lifts them like any mask or bias built from index grids. Exact against the
per-branch oracle on the eager backend (values and every gradient) and, forward only, on the
FlexAttention path run eagerly."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB, check_against_oracle
from trees import check_forward, odd_forest

import treefx
from treefx.models import enable_activation_checkpointing

transformers = pytest.importorskip("transformers")

# Windows and chunks of 3 and 4 positions: shorter than most of the probe sequences.
CONFIGS = {
    # Tables (GPT-Neo, MPT) longer than the trees: Dynamo traces the cut on the whole DFS row.
    "gpt_neo": dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                    attention_types=[[["global", "local"], 1]], window_size=3,
                    max_position_embeddings=256),
    "mpt": dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=256),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                   new_decoder_architecture=False, multi_query=False),
    "llama4_text": dict(hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, num_local_experts=2, attention_chunk_size=4,
                        no_rope_layers=[1, 0], moe_layers=[1]),
}
# What the passes must have done for each (a note of the positions pass).
NOTES = {"gpt_neo": "a table cut to the token count", "mpt": "a table cut to the token count",
         "falcon": "cumsum of the all-ones attention mask",
         "llama4_text": "cumsum of the all-ones attention mask"}


def model_of(name: str, dtype=torch.float32, **overrides) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(name, vocab_size=VOCAB,
                                            **{**CONFIGS[name], **overrides})
    cfg._attn_implementation = "eager"
    for k in ("attn_pdrop", "resid_pdrop", "embed_dropout", "attention_dropout",
              "hidden_dropout"):
        if hasattr(cfg, k):
            setattr(cfg, k, 0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():  # weights large enough that a bias or a window changes the output
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def positions_notes(tm) -> list[str]:
    return [r.note for c in tm.contexts for r in c.log if r.pass_name == "positions"]


# GPT-Neo's and MPT's tables: the same models, trees and checks are
# tests/test_family_position_tables.py's, which CI runs; here with -m slow.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in ("gpt_neo", "mpt") else n for n in CONFIGS])
def test_matches_oracle(name):
    tm = treefx.compile(model_of(name), backend="eager")
    check_against_oracle(tm, odd_forest(3, VOCAB))
    assert NOTES[name] in positions_notes(tm)


@pytest.mark.parametrize("name,impl", [("gpt_neo", "eager"), ("mpt", "eager"),
                                       ("llama4_text", "eager"), ("falcon", "eager"),
                                       ("falcon", "sdpa")])
def test_flex_forward_matches_oracle(name, impl):
    """The inductor backend's form, run eagerly (forward only: no FlexAttention backward on
    the CPU): the window, the bias and the chunks evaluated per query and key position.
    Falcon's ALiBi goes through a [B * H, 1, N] reshape the lifter cannot follow per index:
    the score_mod reads the model's own bias tensor at the query's and key's rows (with SDPA,
    inside the additive mask it passes)."""
    model = model_of(name, torch.float64)
    model.set_attn_implementation(impl)
    tm = treefx.compile(model, backend="flex-eager", verify=False)
    check_forward(tm, odd_forest(4, VOCAB), atol=1e-5, pad_to_multiple=16)


@pytest.mark.parametrize("name,neutral", [("gpt_neo", dict(window_size=64)),
                                          ("llama4_text", dict(attention_chunk_size=64))])
def test_the_window_matters(name, neutral):
    """Guard against a rewrite that drops the model's own mask: with a window (chunk) longer
    than every sequence the outputs differ."""
    trees = odd_forest(5, VOCAB)
    outs = []
    for model in (model_of(name), model_of(name, **neutral)):
        tm = treefx.compile(model, backend="eager", verify=False)
        with torch.no_grad():
            outs.append(tm(treefx.pack(trees)).token_logprobs)
    assert (outs[0] - outs[1]).abs().max() > 1e-2


def test_alibi_matters():
    """Guard: MPT without its ALiBi table (zeros in its place) gives other log-probs."""
    trees = odd_forest(5, VOCAB)
    outs = []
    for alibi in (True, False):
        model = model_of("mpt")
        if not alibi:
            table = model.transformer.build_mpt_alibi_tensor(4, 256)
            model.transformer.build_mpt_alibi_tensor = lambda *a, **k: torch.zeros_like(table)
        tm = treefx.compile(model, backend="eager", verify=False)
        with torch.no_grad():
            outs.append(tm(treefx.pack(trees)).token_logprobs)
    assert (outs[0] - outs[1]).abs().max() > 1e-2


class HalfTable(torch.nn.Module):
    """Reads the second half of a table cut to the token count: not the ``start(N) + i`` form
    of a per-token read (N - N // 2 entries), so it must stay refused."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.table = torch.nn.Buffer(torch.randn(64, 8))
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids):
        n = input_ids.shape[1]
        x = self.emb(input_ids)
        x = x + self.table[n // 2: n].mean(0)
        return self.head(x)


def test_other_cuts_stay_refused():
    tm = treefx.compile(HalfTable(), backend="eager", verify=False)
    with pytest.raises(treefx.TreeCompileError, match="token"):
        tm(treefx.pack(odd_forest(0, VOCAB)))


class LeftPadding(torch.nn.Module):
    """Counts left padding as Llama 4's chunked mask does, with ``==`` spelled both ways (torch
    2.11's Dynamo records ``__eq__`` as a method call), and adds the count to the logits."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:  # the oracle's call
            attention_mask = torch.ones_like(input_ids)
        c = attention_mask.cumsum(dim=-1)
        left = (c == torch.zeros_like(attention_mask)).sum(-1) + c.__eq__(
            torch.zeros_like(attention_mask)).sum(-1)
        return self.head(self.emb(input_ids)) + left[:, None, None]


def test_left_padding_count_is_folded():
    tm = treefx.compile(LeftPadding(), backend="eager")
    check_against_oracle(tm, odd_forest(1, VOCAB))
    notes = positions_notes(tm)
    assert notes.count("a position + 1 is never 0") == 2, notes


def test_a_tree_longer_than_the_table_is_a_clear_error():
    """Every sequence fits GPT-Neo's 48-position table, the tree's row does not: Dynamo traces
    the cut on the row and fails; the error says why and what to do."""
    model = model_of("gpt_neo", max_position_embeddings=48)
    trees = [treefx.Tree.from_sequences([[1 + (i + j) % 60 for j in range(30)] for i in range(4)])]
    assert max(len(s) for s in trees[0].sequences) <= 48 < trees[0].num_tokens
    tm = treefx.compile(model, backend="eager", verify=False)
    with pytest.raises(treefx.TreeCompileError, match=r"row of \d+ tokens.*table's length"):
        tm(treefx.pack(trees))


@pytest.mark.parametrize("name", ["gpt_neo", "mpt"])
def test_table_cut_inside_activation_checkpointing(name):
    """A checkpointed layer takes the table as an operand of its body: the cut is read at path
    positions there too (the table's taint is its caller's, a buffer), not refused."""
    model = model_of(name)
    enable_activation_checkpointing(model)
    model.train()
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, odd_forest(6, VOCAB))
    assert sum("table cut" in n for n in positions_notes(tm)) == 2


class SortedExperts(torch.nn.Module):
    """A decoder whose MLP sorts its tokens by a routing score computed from their data and
    runs each token's expert in that order, as Hugging Face's grouped experts do (transformers
    5.5): ``arange(N)[perm]`` picks the tokens, ``inv_perm[perm] = arange(N)`` undoes the sort.
    Those grids are token indices on the DFS row, not positions."""

    def __init__(self, vocab=VOCAB, dim=16, experts=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.router = torch.nn.Linear(dim, experts)
        self.experts = torch.nn.Parameter(torch.randn(experts, dim, dim) * 0.3)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids):
        h = self.embed(input_ids)[0]  # [N, D]
        n = h.shape[0]
        q, k, v = self.qkv(h).chunk(3, -1)
        att = torch.nn.functional.scaled_dot_product_attention(
            q[None, None], k[None, None], v[None, None], is_causal=True)[0, 0]
        h = h + att
        expert = self.router(h).argmax(-1)  # [N]
        token_idx = torch.arange(n, device=h.device)
        perm = torch.argsort(expert, stable=True)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(n, device=h.device)
        picked = h[token_idx[perm]]  # tokens in expert order
        out = torch.einsum("nd,nde->ne", picked, self.experts[expert[perm]])
        h = h + out[inv_perm]
        return self.head(h)[None]


def test_token_index_grids_a_model_permutes_are_not_positions():
    """An ``arange`` over the tokens that the model gathers by a data-dependent permutation is
    a table of DFS indices: left as it is (rewritten to positions it would pick other tokens,
    a wrong loss with no error), while positions elsewhere are still rewritten."""
    torch.manual_seed(0)
    model = SortedExperts().double()
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, odd_forest(3, VOCAB))
