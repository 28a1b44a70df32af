"""Hugging Face's output-capturing hooks (:mod:`treefx.families.hf_hooks`): installed before
a capture for the modules whose config asks for a captured output (a tiny Mixtral with
``output_router_logits=True``, random weights from its config), as its first forward would;
not for a model that asks for none."""

from __future__ import annotations

import pytest

from treefx.families.hf_hooks import install_output_hooks

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.utils.output_capturing")


def _mixtral(**flags):
    cfg = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
        num_experts_per_tok=1, **flags)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _hooked(model) -> list[str]:
    return [type(m).__name__ for m in model.modules()
            if getattr(m, "_output_capturing_hooks_installed", False)]


def test_hooks_are_installed_where_the_config_asks_for_router_logits():
    model = _mixtral(output_router_logits=True)
    assert _hooked(model) == []  # Hugging Face installs them lazily, on the first forward
    install_output_hooks(model)
    assert _hooked(model)


def test_no_hooks_without_a_captured_output():
    model = _mixtral()
    install_output_hooks(model)
    assert _hooked(model) == []


def test_checkpointing_input_grad_hooks_stay_out_of_tree_calls(monkeypatch):
    """Activation checkpointing installs ``enable_input_require_grads`` (a forward hook on the
    input embeddings calling ``requires_grad_(True)``), at which torch 2.11's Dynamo breaks a
    part's capture. Tree calls run without it (a captured checkpoint is non-reentrant); it is
    back, in its place, after; the checkpointed tree still equals the oracle."""
    import torch
    from support import VOCAB, check_against_oracle, hf_model
    from trees import odd_forest

    import treefx
    from treefx.families import hf_hooks
    from treefx.models import enable_activation_checkpointing

    model = hf_model("qwen3", "sdpa")
    emb = model.get_input_embeddings()
    mine = emb.register_forward_hook(lambda m, a, o: None)  # a user's, before HF's
    enable_activation_checkpointing(model, use_reentrant=False)
    model.train()
    before = list(emb._forward_hooks.items())
    assert len(before) == 2 and model._require_grads_hooks
    during = []
    wrapped = hf_hooks.without_input_grad_hooks

    def spy(m):
        ctx = wrapped(m)

        class Spy:
            def __enter__(self):
                ctx.__enter__()
                during.append(list(emb._forward_hooks))

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)
        return Spy()

    monkeypatch.setattr(treefx.run.capture, "without_input_grad_hooks", spy)
    tm = treefx.compile(model, backend="eager", verify=False)
    check_against_oracle(tm, odd_forest(3, VOCAB))
    assert during and all(keys == [mine.id] for keys in during)
    assert list(emb._forward_hooks.items()) == before
    with torch.no_grad():
        assert emb(torch.tensor([[1, 2]])).requires_grad  # HF's hook still works outside
