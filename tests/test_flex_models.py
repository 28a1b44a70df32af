"""Models built with ``attn_implementation="flex_attention"``: Hugging Face models are captured
and run through their eager attention (the same math, masks, windows and softcaps included),
which the attention pass rewrites like any other; the model keeps its implementation outside
treefx. Exact against the per-branch oracle, values and every gradient (on the CPU the oracle
runs the eager attention too: FlexAttention has no CPU backward). A model that calls
``flex_attention`` in its own code is refused, naming the node."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB, check_against_oracle, hf_model
from trees import odd_forest

import treefx
from treefx.tools.zoo import build_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", [pytest.param("qwen3", marks=pytest.mark.slow), "mistral"])
def test_hf_flex_attention_model_matches_oracle(name):
    """Mistral's window of 3 positions crosses the nodes of the odd forest."""
    model = hf_model(name, "flex_attention")
    tm = treefx.compile(model, backend="eager")  # the first-call check runs too
    check_against_oracle(tm, odd_forest(3, VOCAB))
    assert model.config._attn_implementation == "flex_attention"
    assert [r for c in tm.contexts for r in c.log if r.pass_name == "attention"]


def test_flex_softcap_model_matches_oracle():
    """Gemma 2's flex path softcaps its scores in a score_mod; its eager path does the same,
    and the attention pass lifts it."""
    model = build_model("gemma2", attn_implementation="flex_attention")
    model.set_attn_implementation("flex_attention")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)  # scores large enough for the softcap to act
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, odd_forest(2, model.config.vocab_size))
    assert model.config._attn_implementation == "flex_attention"


class OwnFlex(torch.nn.Module):
    """Calls FlexAttention itself, with its own causal block mask over the row."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        x = self.emb(input_ids)
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, 2, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        mask = create_block_mask(lambda b, h, q, k: k <= q, None, None, n, n, device="cpu")
        o = flex_attention(q, k, v, block_mask=mask)
        return self.head(o.transpose(1, 2).reshape(b, n, 32))


def test_own_flex_attention_call_is_refused():
    tm = treefx.compile(OwnFlex(), backend="eager", verify=False)
    with pytest.raises(treefx.TreeCompileError, match="calls flex_attention itself") as err:
        with torch.no_grad():
            tm(treefx.pack(odd_forest(1, VOCAB)))
    assert "flex_attention" in str(err.value) and "graph node" in str(err.value)
