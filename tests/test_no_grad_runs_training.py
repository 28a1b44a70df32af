"""A compiled model in training mode with trainable parameters captures one regional graph, for
training, and its calls without gradients run that graph's forward
(``TreeEngine.captures_training``, ``TREEFX_SHARE_NO_GRAD``): an RL step's old log-probs and
its loss share one capture. Against the oracle, and the cases that keep their own graph."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB, hf_model
from trees import check_forward, odd_forest

import treefx
from treefx.families.hf_hooks import checkpointing_restored, checkpointing_state
from treefx.models import enable_activation_checkpointing

transformers = pytest.importorskip("transformers")


def _keys(tm):
    return [k for k, graphs in tm.engine._regional.items() for _ in graphs]


def _no_checkpointing(model):
    """Checkpointing off, as TRL's ``disable_gradient_checkpointing`` turns it off."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


@pytest.mark.parametrize("backend", [
    "eager", pytest.param("aot-eager", marks=pytest.mark.slow)])  # AOTAutograd: the GPU's path
def test_a_no_grad_call_runs_the_training_graph(backend):
    """The first call has no gradients: its first-call check compares gradients (the graph is
    the training one), the call captures once, and the training call after it captures
    nothing; the no-grad log-probs equal the training call's bit for bit (one compiled
    forward, as eager mode computes both), and both equal the oracle's."""
    model = hf_model("qwen3", "sdpa").train()
    tm = treefx.compile(model, backend=backend, regional=True, verify=True)
    trees = odd_forest(3, VOCAB)
    out = check_forward(tm, trees, atol=1e-4)
    assert tm.verification.passed and tm.verification.compared_params > 0
    ((backend, _, grad, *_),) = _keys(tm)
    assert grad  # compiled for training
    with torch.enable_grad():
        trained = tm(treefx.pack(trees))
    assert trained.token_logprobs.requires_grad
    assert torch.equal(out.token_logprobs, trained.token_logprobs.detach())
    report = treefx.verify(tm, odd_forest(7, VOCAB), reduction="sum", params="all")
    assert report.passed and report.compared_params == report.total_params > 0
    assert tm.num_compilations == 1


def test_the_training_call_keeps_its_checkpointing():
    """A no-grad call with checkpointing off (TRL's pattern) captures a graph without it; the
    training call with checkpointing on does not run that one (its memory is not the
    checkpointed one) but captures its own, checkpointed. With the training's checkpointing
    put back around the no-grad call (what TreeGRPOTrainer does), one graph serves both."""
    model = hf_model("qwen3", "sdpa").train()
    enable_activation_checkpointing(model, use_reentrant=False)
    training = checkpointing_state(model)
    tm = treefx.compile(model, backend="eager", regional=True, verify=False)
    trees = odd_forest(4, VOCAB)

    _no_checkpointing(model)
    check_forward(tm, trees, atol=1e-4)
    with checkpointing_restored(training):
        check_forward(tm, trees, atol=1e-4, grad=True)
    keys = _keys(tm)
    assert len(keys) == 2 and [any(k[-1]) for k in keys] == [False, True]
    checkpointed = [g for g in tm.engine._regional[keys[1]]][0]
    assert any("checkpoint" in str(n.target) for p in checkpointed.pieces
               for n in p.gm.graph.nodes)

    tm = treefx.compile(model, backend="eager", regional=True, verify=False)
    with checkpointing_restored(training):
        check_forward(tm, trees, atol=1e-4)
        check_forward(tm, trees, atol=1e-4, grad=True)
    (key,) = _keys(tm)
    assert key[2] and any(key[-1])
    assert not any(m.gradient_checkpointing for m, _, _ in training)  # restored after


def test_models_that_do_not_train_keep_a_no_grad_graph(monkeypatch):
    """A model in eval mode, a model without trainable parameters, a call in inference mode and
    ``TREEFX_SHARE_NO_GRAD=0`` capture a no-grad graph of their own."""
    trees = odd_forest(5, VOCAB)
    model = hf_model("qwen3", "sdpa")
    cases = {"eval": lambda: model.eval(), "frozen": lambda: model.requires_grad_(False),
             "inference mode": None, "switched off": None}
    for name, prepare in cases.items():
        model.train().requires_grad_(True)
        if prepare is not None:
            prepare()
        with monkeypatch.context() as env:
            if name == "switched off":
                env.setenv("TREEFX_SHARE_NO_GRAD", "0")
            tm = treefx.compile(model, backend="eager", regional=True, verify=False)
        with torch.inference_mode() if name == "inference mode" else torch.no_grad():
            tm(treefx.pack(trees))
        ((_, _, grad, *_),) = _keys(tm)
        assert not grad, name
    model.train().requires_grad_(True)
    check_forward(tm, trees, atol=1e-4, grad=True)  # (TREEFX_SHARE_NO_GRAD=0) its own
    assert len(_keys(tm)) == 2


def test_a_model_that_computes_otherwise_without_gradients_keeps_a_no_grad_graph(caplog):
    """A layer whose values depend on the grad mode (a hook inside it, traced into the graph,
    that scales its output only without gradients): the first-call check runs the training
    graph without gradients against the model run without them too, finds the difference,
    says so, and calls without gradients capture a graph of their own, exact; the training
    call keeps the training graph."""
    model = hf_model("qwen3", "sdpa").train()
    model.model.layers[1].mlp.register_forward_hook(
        lambda m, args, out: out if torch.is_grad_enabled() else out * 1.5)
    tm = treefx.compile(model, backend="eager", regional=True, verify=True)
    trees = odd_forest(6, VOCAB)
    with caplog.at_level("WARNING", logger="treefx"):
        check_forward(tm, trees, atol=1e-4)
    assert "differs from the model run without them" in caplog.text
    assert tm.verification.compared_params > 0
    assert sorted(k[2] for k in _keys(tm)) == [False, True]
    # (the training graph's gradients were compared by the check); the no-grad graph again:
    check_forward(tm, odd_forest(7, VOCAB), atol=1e-4)
    assert len(_keys(tm)) == 2
