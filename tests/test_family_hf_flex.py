"""The Hugging Face flex-attention family (:mod:`treefx.families.hf_flex`): within treefx's
calls a model built with ``attn_implementation="flex_attention"`` says ``eager`` (its configs
and sub-configs, for the call only), and the oracle runs it that way on the CPU, where
FlexAttention has no backward. Configs only: no forward runs here (tests/test_flex_models.py
checks such models against the oracle end to end)."""

from __future__ import annotations

import pytest
import torch
from support import hf_model

import treefx
from treefx.families.hf_flex import eager_attention, eager_attention_on_cpu

transformers = pytest.importorskip("transformers")


def test_eager_attention_switches_flex_configs_for_the_block_only():
    model = hf_model("llama", "flex_attention")
    assert model.config._attn_implementation == "flex_attention"
    with eager_attention(model):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "flex_attention"
    with pytest.raises(RuntimeError, match="inside"), eager_attention(model):
        raise RuntimeError("inside")
    assert model.config._attn_implementation == "flex_attention"  # restored on an error too


def test_eager_attention_leaves_other_implementations_and_no_model_alone():
    model = hf_model("llama", "sdpa")
    with eager_attention(model):
        assert model.config._attn_implementation == "sdpa"
    with eager_attention(None):
        pass
    # The implementation is read on every call: switched to flex after a first call, the
    # model is switched to eager on the next.
    with eager_attention(model):
        pass
    model.set_attn_implementation("flex_attention")
    with eager_attention(model):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "flex_attention"


def test_the_oracle_runs_a_flex_model_on_the_cpu_through_its_eager_attention():
    """Registered into the oracle when the family is imported; on another device (here the
    meta device) the model runs as it is."""
    model = hf_model("llama", "flex_attention")
    with treefx.reference.oracle_attention(model):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "flex_attention"
    with eager_attention_on_cpu(model.to(torch.device("meta"))):
        assert model.config._attn_implementation == "flex_attention"
