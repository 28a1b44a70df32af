"""The token-axis check refuses, naming the node, every way a model can move data along the
tokens that no pass rewrote; and positions the model computes itself (an arange, a cumsum, a
triu/tril band) are evaluated per path, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from trees import check_forward, odd_forest, odd_tree

import treefx
from treefx.compiler import SpecializedGraphError, TokenAxisError

transformers = pytest.importorskip("transformers")

VOCAB = 64


class TokenModel(torch.nn.Module):
    """Embedding -> ``mix`` along the tokens -> head."""

    def __init__(self, mix):
        super().__init__()
        self.mix = mix
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        self.register_buffer("table", torch.arange(512)[None], persistent=False)

    def forward(self, input_ids):
        return self.head(self.mix(self, self.emb(input_ids)))


def _positions_shift(m, x):
    pos = torch.arange(x.shape[1])
    return x + x[:, (pos - 1).clamp(min=0)]


def _loop(m, x):
    outs, h = [], torch.zeros_like(x[:, 0])
    for i in range(x.shape[1]):  # unrolled by Dynamo: the graph is specialized to N
        h = 0.5 * h + x[:, i]
        outs.append(h)
    return torch.stack(outs, 1)


REFUSED = {
    "token shift by pad": (lambda m, x: x + F.pad(x, (0, 0, 1, -1)), "pads the token axis"),
    "shift by slice and cat": (lambda m, x: torch.cat([x[:, :1] * 0, x[:, :-1]], 1),
                               "token axis of size N - 1"),
    "roll": (lambda m, x: x + torch.roll(x, 1, dims=1), "`roll` runs over the token axis"),
    "mean over the sequence": (lambda m, x: x - x.mean(1, keepdim=True),
                               "`mean` runs over the token axis"),
    "softmax over the tokens": (lambda m, x: x * x.softmax(1), "`softmax` runs over the token"),
    "index by positions": (_positions_shift, "indexes the token axis .* by positions"),
    # Read at N + i: what token i sees depends on the sequence's length (not a decoder).
    "table cut from the token count": (
        lambda m, x: x + m.table[:, x.shape[1]:2 * x.shape[1], None].float(),
        "cuts a table to the token count"),
    "python loop over the tokens": (_loop, "specialized to"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_moving_data_along_the_tokens_is_refused(case):
    mix, message = REFUSED[case]
    tm = treefx.compile(TokenModel(mix), backend="eager")
    with pytest.raises((TokenAxisError, SpecializedGraphError), match=message):
        tm(treefx.pack(odd_tree(1, VOCAB)))


def test_a_table_cut_to_the_tokens_is_read_at_positions():
    """``table[:, :N]`` (learned positions sliced by the length) reads entry i at the i-th
    token of a sequence: on the tree, at each token's position."""
    tm = treefx.compile(TokenModel(lambda m, x: x + m.table[:, :x.shape[1], None].float()),
                        backend="eager")
    check_forward(tm, odd_forest(2, VOCAB), atol=1e-5)
    notes = [r.note for r in tm.contexts[0].log if r.pass_name == "positions"]
    assert "a table cut to the token count" in notes


def test_per_token_ops_and_routing_pass():
    """Per-token math, a sort of the tokens (a permutation, as MoE routing does) and tensor
    indexing by data are not mixing."""

    def route(m, x):
        key = x[..., 0]
        order = key.argsort(dim=1)
        back = order.argsort(dim=1)
        y = torch.tanh(x[:, order[0]]) * 2
        return y[:, back[0]] + x.norm(dim=-1, keepdim=True)

    torch.manual_seed(0)
    tm = treefx.compile(TokenModel(route), backend="eager")
    check_forward(tm, odd_forest(2, VOCAB), atol=1e-5)


class BandAttention(torch.nn.Module):
    """Hand-written attention whose causal sliding-window mask is a triu/tril band of -inf:
    a band in the DFS row is not a band in positions, so the pass rewrites it."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        n = x.shape[1]
        full = torch.full((n, n), float("-inf"))
        mask = torch.triu(full, diagonal=1) + torch.tril(full, diagonal=-self.window)
        att = (q @ k.transpose(-2, -1) / 4 + mask).softmax(-1)
        return self.head(att @ v)


def test_triu_tril_band_is_evaluated_in_positions():
    torch.manual_seed(0)
    tm = treefx.compile(BandAttention(window=3), backend="eager")
    check_forward(tm, odd_forest(3, VOCAB), atol=1e-5)
    notes = {r.note for r in tm.contexts[0].log if r.pass_name == "positions"}
    assert notes == {"triu", "tril"}


def _hf(model_type: str, **cfg):
    cfg = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, **cfg)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def test_roberta_positions_from_a_cumsum_are_exact():
    """RoBERTa numbers its tokens from padding_idx + 1 with a cumsum of the non-padding mask:
    the model's own code, evaluated per path (0-based position_ids would be wrong here)."""
    model = _hf("roberta", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, is_decoder=True, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, max_position_embeddings=80)
    tm = treefx.compile(model, backend="eager")
    report = treefx.verify(tm, odd_forest(4, VOCAB))
    assert report.passed and report.compared_params == report.total_params
    assert any(r.note == "cumulative sum along each path" for r in tm.contexts[0].log)
