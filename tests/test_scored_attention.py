"""Attention whose scores the model transforms itself: logit softcapping (Gemma 2), attention
sinks as an extra softmax column (gpt-oss, MiMo-V2-Flash) or as ``sigmoid(lse - sink)``
(Granite-SWA), a row maximum subtracted before the softmax. Exact against the per-branch
oracle on the eager backend (values and every gradient) and, forward only, on the FlexAttention
path (score_mod + log-sum-exp) run eagerly on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import VOCAB, check_against_oracle
from trees import check_forward, odd_forest

import treefx
from treefx.models import enable_activation_checkpointing
from treefx.ops.attention import sink_rescale

transformers = pytest.importorskip("transformers")

_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, sliding_window=3)
CONFIGS = {
    # A cap of 0.5 makes the tanh far from linear at these score sizes.
    "gemma2": dict(_SMALL, intermediate_size=64, attn_logit_softcapping=0.5,
                   final_logit_softcapping=None),
    "gpt_oss": dict(_SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "granite_swa": dict(_SMALL, intermediate_size=64),
}


def scored_model(name: str, dtype=torch.float32) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(name, vocab_size=VOCAB, **CONFIGS[name])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    with torch.no_grad():  # large enough weights that the softcap and the sinks matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def attention_notes(tm) -> list[str]:
    return [r.note for r in tm.contexts[0].log if r.pass_name == "attention"
            and "not attention" not in r.note]


@pytest.mark.parametrize("name,form", [
    ("gemma2", "score_mod"),
    # the same model, trees and check as tests/test_family_gpt_oss_sinks.py's, which CI runs
    pytest.param("gpt_oss", "sink", marks=pytest.mark.slow),
    ("granite_swa", "log-sum-exp")])
def test_scored_attention_matches_oracle(name, form):
    tm = treefx.compile(scored_model(name), backend="eager")
    check_against_oracle(tm, odd_forest(5, VOCAB))
    notes = attention_notes(tm)
    assert len(notes) == 2 and all("eager-scored" in n for n in notes), notes
    if form != "score_mod":
        assert all(form in n for n in notes), notes


@pytest.mark.parametrize("name,interleave", [("gemma2", None), ("gpt_oss", None),
                                            ("gpt_oss", True), ("granite_swa", True)])
def test_scored_attention_flex_forward_matches_oracle(name, interleave):
    """The inductor backend's form (the score ops as a FlexAttention score_mod, or only a
    constant scale folded into FlexAttention's; sinks from its log-sum-exp, also with the KV
    heads interleaved along the row), run eagerly: forward only (no FlexAttention backward on
    the CPU)."""
    from treefx.ops.attention import TreeFlexAttention

    # gpt-oss's grouped expert matmul has no float64 kernel.
    dtype = torch.float32 if name == "gpt_oss" else torch.float64
    tm = treefx.compile(scored_model(name, dtype), backend="flex-eager", verify=False,
                        interleave_heads=interleave)
    # The models take their softmax in float32 even for a float64 model.
    check_forward(tm, odd_forest(6, VOCAB), atol=1e-4 if dtype == torch.float32 else 1e-5,
                  pad_to_multiple=16)
    notes = attention_notes(tm)
    if name == "gemma2":  # the tanh needs a score_mod
        assert all("score ops as the score_mod" in n for n in notes), notes
    else:  # a scale and a mask: FlexAttention's own scale and mask_mod
        assert all("scores scaled by FlexAttention" in n for n in notes), notes
    sites = [n.target for n in tm.contexts[0].gm.graph.nodes
             if isinstance(n.target, TreeFlexAttention)]
    want = "interleaved" if interleave and name != "gemma2" else "standard"
    assert sites and all(s.layouts == {want} for s in sites)


def test_softcap_matters():
    """Guard against a pass that drops the score ops: without the softcap the result differs."""
    capped, plain = scored_model("gemma2"), scored_model("gemma2")
    plain.config.attn_logit_softcapping = None
    for layer in plain.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    trees = odd_forest(7, VOCAB)
    outs = []
    for model in (capped, plain):
        tm = treefx.compile(model, backend="eager", verify=False)
        with torch.no_grad():
            outs.append(tm(treefx.pack(trees)).token_logprobs)
    assert (outs[0] - outs[1]).abs().max() > 1e-2


def test_sink_rescale_is_the_softmax_with_one_more_column():
    torch.manual_seed(0)
    s, v, sink = torch.randn(2, 3, 5, 5), torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 1)
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    ref = F.softmax(torch.cat([s, sink], -1), -1)[..., :-1] @ v
    out = sink_rescale(F.softmax(s, -1) @ v, torch.logsumexp(s, -1), sink)
    torch.testing.assert_close(out, ref)


class _TwoColumns(torch.nn.Module):
    """Scores concatenated with two extra columns: not a sink treefx knows."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        q, k, v = self.qkv(self.emb(input_ids)).chunk(3, dim=-1)
        n = q.shape[1]
        s = q @ k.transpose(-2, -1) / 4
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        s = torch.cat([s, s.new_zeros(*s.shape[:-1], 2)], dim=-1)
        p = s.softmax(-1)[..., :-2]
        return self.head(p @ v)


def test_unknown_extra_columns_are_refused():
    tm = treefx.compile(_TwoColumns(), backend="eager", verify=False)
    with pytest.raises(treefx.UnmatchedAttentionError, match="not in a pattern treefx recognises"):
        tm(treefx.pack(odd_forest(1, VOCAB)))


def test_sinks_inside_activation_checkpointing_match_oracle():
    """gpt-oss with HF gradient checkpointing: the sink attention sits inside a checkpointed
    body, where the row maximum's unused indices are a node of their own."""
    model = scored_model("gpt_oss")
    enable_activation_checkpointing(model, use_reentrant=False)
    model.train()
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, odd_forest(8, VOCAB))
