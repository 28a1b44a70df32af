"""GPT-Neo's local-attention table and MPT's ALiBi, cut to the token count
(:mod:`treefx.families.position_tables`): read at path positions, each query at its own prefix
length. Models built from a config with random weights; exact against the per-branch oracle."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB, check_against_oracle
from trees import odd_forest

import treefx

transformers = pytest.importorskip("transformers")

# Tables longer than the trees (Dynamo traces the cut on the whole DFS row), a window of 3.
CONFIGS = {
    "gpt_neo": dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                    attention_types=[[["global", "local"], 1]], window_size=3,
                    max_position_embeddings=256),
    "mpt": dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=256),
}


def model_of(name: str) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(name, vocab_size=VOCAB, **CONFIGS[name])
    cfg._attn_implementation = "eager"
    for k in ("attn_pdrop", "resid_pdrop", "embed_dropout", "attention_dropout",
              "hidden_dropout"):
        if hasattr(cfg, k):
            setattr(cfg, k, 0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # weights large enough that the table changes the output
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_table_read_at_path_positions_matches_oracle(name):
    tm = treefx.compile(model_of(name), backend="eager")
    check_against_oracle(tm, odd_forest(3, VOCAB))
    notes = [r.note for c in tm.contexts for r in c.log if r.pass_name == "positions"]
    assert "a table cut to the token count" in notes, notes
