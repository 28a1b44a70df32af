"""gpt-oss's attention sinks, an extra softmax column (:mod:`treefx.families.gpt_oss_sinks`):
applied from the tree attention's log-sum-exp. A model built from a config with random
weights; exact against the per-branch oracle (values and every gradient)."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB, check_against_oracle
from trees import odd_forest

import treefx

transformers = pytest.importorskip("transformers")


def gpt_oss() -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "gpt_oss", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=3, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # large enough weights that the sinks matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def test_sinks_match_oracle():
    tm = treefx.compile(gpt_oss(), backend="eager")
    check_against_oracle(tm, odd_forest(5, VOCAB))
    notes = [r.note for r in tm.contexts[0].log if r.pass_name == "attention"
             and "not attention" not in r.note]
    assert len(notes) == 2 and all("sink from the log-sum-exp" in n for n in notes), notes
    # the scored-attention form (tests/test_scored_attention.py runs this same model there
    # with -m slow)
    assert all("eager-scored" in n for n in notes), notes
