"""Attention over merged batch·head rows (``bmm``/``baddbmm`` on [B·H, N, D]): Bloom (with its
ALiBi as the ``baddbmm`` bias), the BART-style decoders MVP, TrOCR and XGLM, GPT-NeoX-Japanese,
and a hand-written module. The merged-heads pass puts each in the [B, H, N, D] form the
attention pass matches; exact against the per-branch oracle (values and every gradient). A
region whose attention weights leave it is not rewritten, and the attention pass refuses it."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB, check_against_oracle
from trees import check_forward, odd_forest

import treefx
from treefx.tools.zoo import build_model

transformers = pytest.importorskip("transformers")


def heads_log(tm) -> list:
    return [r for c in tm.contexts for r in c.log if r.pass_name == "heads"]


def zoo_model(name: str, dtype=torch.float32):
    model = build_model(name, dtype)
    with torch.no_grad():  # weights large enough that the bias and the masks matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("name", [
    "bloom",
    pytest.param("xglm", marks=pytest.mark.slow),
    pytest.param("mvp", marks=pytest.mark.slow),
    pytest.param("trocr", marks=pytest.mark.slow),
    pytest.param("gpt_neox_japanese", marks=pytest.mark.slow),
])
def test_hf_merged_heads_attention_matches_oracle(name):
    model = zoo_model(name)
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, odd_forest(3, model.config.vocab_size))
    assert any(r.after for r in heads_log(tm))


@pytest.mark.parametrize("name", ["bloom", pytest.param("mvp", marks=pytest.mark.slow)])
def test_flex_forward_matches_oracle(name):
    """The inductor backend's form, run eagerly (forward only: no FlexAttention backward on the
    CPU). Bloom's ALiBi, split back to [B, H, 1, N], is read by the score_mod per key."""
    model = zoo_model(name, torch.float64)
    tm = treefx.compile(model, backend="flex-eager", verify=False)
    check_forward(tm, odd_forest(4, model.config.vocab_size), atol=1e-5, pad_to_multiple=16)


class MergedHeadsLM(torch.nn.Module):
    """Two layers of attention over [B·H, N, D] rows, written the way Bloom writes it: a
    per-head ALiBi bias through ``baddbmm``, a causal mask on the [B, H, N, N] view, the
    softmax back on the merged rows, ``bmm`` with the values."""

    def __init__(self, heads=4, dim=32, layers=2, reads_weights=False):
        super().__init__()
        self.heads, self.dim, self.reads_weights = heads, dim, reads_weights
        self.emb = torch.nn.Embedding(VOCAB, dim)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, VOCAB)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32))

    def attention(self, i, x):
        b, n, _ = x.shape
        h, d = self.heads, self.dim // self.heads
        q, k, v = (t.view(b, n, h, d).transpose(1, 2).reshape(b * h, n, d)
                   for t in self.qkv[i](x).chunk(3, dim=-1))
        pos = torch.arange(n, device=x.device)
        alibi = (self.slopes[:, None, None] * pos).repeat(b, 1, 1)  # [B·H, 1, N]
        s = alibi.baddbmm(q, k.transpose(-1, -2), beta=1.0, alpha=d ** -0.5)
        causal = pos[None, :] <= pos[:, None]
        s = s.view(b, h, n, n).masked_fill(~causal, torch.finfo(s.dtype).min)
        p = torch.softmax(s.view(b * h, n, n), dim=-1)
        o = torch.bmm(p, v).view(b, h, n, d).transpose(1, 2).reshape(b, n, h * d)
        x = x + self.out[i](o)
        if self.reads_weights:  # the largest weight of each query, read by the next layer
            x = x + p.view(b, h, n, n).amax(-1).mean(1)[..., None]
        return x

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for i in range(len(self.qkv)):
            x = self.attention(i, x)
        return self.head(x)


def test_hand_written_merged_heads_matches_oracle():
    torch.manual_seed(0)
    tm = treefx.compile(MergedHeadsLM(), backend="eager")
    check_against_oracle(tm, odd_forest(5, VOCAB))
    assert sum(bool(r.after) for r in heads_log(tm)) == 2


def test_attention_weights_read_outside_are_refused():
    """The model reads its attention weights elsewhere: the region is not closed, so it is
    not rewritten, and the attention left over the DFS row is refused with its node named."""
    torch.manual_seed(0)
    tm = treefx.compile(MergedHeadsLM(reads_weights=True), backend="eager", verify=False)
    with pytest.raises(treefx.TreeCompileError, match="softmax") as err:
        tm(treefx.pack(odd_forest(1, VOCAB)))
    assert "attention" in str(err.value)
    assert any("not rewritten" in r.note for r in heads_log(tm))
