"""Twins (``treefx.run.model.twin``): a model of the same architecture as a compiled one (TRL's
reference model beside the policy) runs that one's no-grad regional graph with its own
parameters, under its own first-call check, instead of capturing and compiling its own."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB, hf_model
from trees import check_forward, odd_forest

import treefx
from treefx.run.model import twin, twin_difference

transformers = pytest.importorskip("transformers")


def _policy_and_reference(seed: int = 1):
    """A policy in training mode with transformers' input-grad hook (what gradient
    checkpointing leaves on it) and a reference of other weights in eval mode."""
    policy = hf_model("qwen3", "sdpa").train()
    policy.enable_input_require_grads()
    reference = hf_model("qwen3", "sdpa").eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return policy, reference


def _compiled_policy(policy, verify=True):
    # (the suite turns the first-call check off by default: TREEFX_VERIFY=0 in conftest.py)
    tm = treefx.compile(policy, backend="eager", regional=True, verify=verify)
    check_forward(tm, odd_forest(3, VOCAB), atol=1e-4)  # its no-grad graph
    assert tm.num_compilations == 1
    return tm


def test_a_twin_runs_the_no_grad_graph_with_its_own_parameters():
    policy, reference = _policy_and_reference()
    assert twin_difference(policy, reference) is None  # modes and hooks may differ
    tm = _compiled_policy(policy)
    ref_tm = twin(tm, reference)
    assert ref_tm is not None and ref_tm.model is reference
    trees = odd_forest(5, VOCAB)
    out = check_forward(ref_tm, trees, atol=1e-4)  # the reference's own log-probs
    assert ref_tm.num_compilations == 0 and tm.num_compilations == 1  # nothing captured
    assert ref_tm.verification.passed  # its first-call check ran on the shared graph
    assert ref_tm.engine.twin_used
    with torch.no_grad():
        theirs = tm(treefx.pack(trees))
    assert not torch.allclose(out.token_logprobs, theirs.token_logprobs)  # other weights


def test_a_twin_captures_its_own_graph_for_gradients():
    policy, reference = _policy_and_reference()
    ref_tm = twin(_compiled_policy(policy), reference)
    check_forward(ref_tm, odd_forest(3, VOCAB), atol=1e-4)
    assert ref_tm.num_compilations == 0
    check_forward(ref_tm, odd_forest(4, VOCAB), atol=1e-4, grad=True)
    assert ref_tm.num_compilations == 1


def test_a_twin_the_shared_graph_is_wrong_for_captures_its_own(caplog):
    """A hook on the reference (inside a layer: traced into the graph) that changes its values:
    the shared graph fails the reference's first-call check, which says so and captures the
    reference's own graph, exact."""
    policy, reference = _policy_and_reference()
    reference.model.layers[1].mlp.register_forward_hook(lambda m, args, out: out * 1.5)
    ref_tm = twin(_compiled_policy(policy), reference)
    assert ref_tm is not None  # the architecture is the same
    with caplog.at_level("WARNING", logger="treefx"):
        check_forward(ref_tm, odd_forest(5, VOCAB), atol=1e-4)
    assert "failed this model's first-call check" in caplog.text
    assert ref_tm.num_compilations == 1 and ref_tm.verification.passed
    assert not ref_tm.engine.twin_used
    check_forward(ref_tm, odd_forest(6, VOCAB), atol=1e-4)  # and keeps its own


def test_not_twins(monkeypatch):
    policy, reference = _policy_and_reference()
    tm = _compiled_policy(policy)
    other = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=32,
                                          intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8))
    assert twin_difference(policy, other) is not None and twin(tm, other) is None
    eps = hf_model("qwen3", "sdpa")
    eps.config.rms_norm_eps = 1e-3
    assert twin_difference(policy, eps) == "another config"
    # without the first-call check nothing says the shared graph is right for the reference
    assert twin(_compiled_policy(hf_model("qwen3", "sdpa").train(), verify=False),
                reference) is None
    monkeypatch.setenv("TREEFX_SHARE_TWINS", "0")
    assert twin(tm, reference) is None
    # not run regionally: nothing to share
    monkeypatch.delenv("TREEFX_SHARE_TWINS")
    whole = treefx.compile(hf_model("qwen3", "sdpa"), backend="eager", verify=True)
    assert twin(whole, reference) is None
