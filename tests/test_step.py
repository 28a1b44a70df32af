"""@treefx.step: an ordinary training step on a tree returns the per-branch baseline loss,
value and every gradient (float32, CPU), with loss masks that differ between sequences sharing
tokens (tests/trees.py gives every sequence its own random mask and weight)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import VOCAB, grads, hf_model
from trees import odd_forest

import treefx


def hf_labels_step(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 labels=batch["labels"]).loss


def make_hand_step(reduction):
    def hand_step(model, batch):
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                               reduction=reduction)

    return hand_step


def check_step(step_fn, model, trees, reduction, *, rtol=1e-4):
    model.zero_grad(set_to_none=True)
    loss = step_fn(model, treefx.pack(trees))
    loss.backward()
    g_tree = grads(model)
    ref = treefx.reference.sequence_loss(model, trees, reduction=reduction)
    ref.backward()
    g_ref = grads(model)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=rtol)
    assert g_ref and g_tree.keys() == g_ref.keys()
    for name, g in g_ref.items():
        err = (g_tree[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err <= rtol, f"gradient of {name} off by {err:.2e} (relative)"


@pytest.mark.parametrize("impl", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def test_hf_model_with_labels(impl):
    model = hf_model("qwen3", impl)
    step = treefx.step(hf_labels_step, backend="eager")
    check_step(step, model, odd_forest(20, VOCAB), "mean")
    (rewrite,) = [r for r in step.contexts[0].log if r.pass_name == "loss"]
    # The step reads only .loss: the output projection is fused, the logits never built.
    assert rewrite.note == "reduction=mean, fused with the output projection"


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_hand_written_cross_entropy(reduction):
    model = hf_model("llama", "sdpa")
    step = treefx.step(make_hand_step(reduction), backend="eager")
    check_step(step, model, odd_forest(21, VOCAB), reduction)
    # The same compiled step on another tree size: no new compilation.
    check_step(step, model, odd_forest(22, VOCAB), reduction)
    assert step.num_compilations == 1


def test_step_that_also_returns_logits_keeps_them():
    model = hf_model("qwen3", "sdpa")

    def loss_and_logits(model, batch):
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
        return loss, logits

    step = treefx.step(loss_and_logits, backend="eager")
    check_step(lambda m, b: step(m, b)[0], model, odd_forest(26, VOCAB), "mean")
    (rewrite,) = [r for r in step.contexts[0].log if r.pass_name == "loss"]
    assert rewrite.note == "reduction=mean"
    batch = treefx.pack(odd_forest(26, VOCAB))
    assert step(model, batch)[1].shape == (1, batch.num_tokens, VOCAB)


def test_decorator_forms_and_plain_batches():
    model = hf_model("qwen3", "sdpa")

    @treefx.step
    def plain(model, batch):
        return hf_labels_step(model, batch)

    @treefx.step(backend="eager")
    def with_args(model, batch):
        return hf_labels_step(model, batch)

    assert plain.__name__ == "plain" and isinstance(with_args, treefx.TreeStep)
    ids = torch.randint(0, VOCAB, (2, 7))
    ordinary = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    torch.testing.assert_close(plain(model, ordinary), hf_labels_step(model, ordinary))
    check_step(with_args, model, odd_forest(23, VOCAB), "mean")


def test_tree_batch_reads_like_a_collated_batch():
    batch = treefx.pack(odd_forest(24, VOCAB))
    assert set(batch.keys()) == {"input_ids", "labels", "position_ids", "attention_mask"}
    labels = batch["labels"][0]
    trained = batch.loss_weights_for("sum") > 0
    assert torch.equal(labels[trained], batch.input_ids[0][trained])
    assert torch.all(labels[~trained] == -100)
    with pytest.raises(KeyError, match="a TreeBatch provides"):
        batch["pixel_values"]


def _step(body):
    step = treefx.step(body, backend="eager")
    return lambda: step(hf_model("qwen3", "sdpa"), treefx.pack(odd_forest(25, VOCAB)))


def _logits(model, batch):
    return model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _mean_ce(model, batch):
    return F.cross_entropy(_logits(model, batch)[:, :-1].flatten(0, 1),
                           batch["labels"][:, 1:].flatten())


@pytest.mark.parametrize("scaled, factor", [
    (lambda m, b: 0.25 * _mean_ce(m, b), 0.25),   # a constant on the left
    (lambda m, b: _mean_ce(m, b) * 0.25, 0.25),   # on the right
    (lambda m, b: _mean_ce(m, b) / 4, 0.25),
    (lambda m, b: torch.mul(3.0, _mean_ce(m, b)).float() / 2, 1.5),
    (lambda m, b: 2 * (_mean_ce(m, b) * 0.5) * 3, 3.0),
], ids=["const_times_loss", "loss_times_const", "loss_div_const", "torch_mul_then_div",
        "chained"])
def test_loss_scaled_by_a_constant_on_either_side(scaled, factor):
    model = hf_model("qwen3", "sdpa")
    step = treefx.step(scaled, backend="eager")
    check_step(lambda m, b: step(m, b) / factor, model, odd_forest(27, VOCAB), "mean")


@pytest.mark.parametrize("body, message", [
    (lambda m, b: (b["labels"] != -100).sum() * _mean_ce(m, b),
     r"combined with a computed tensor in `\w+ = mul\(sum\w*, cross_entropy\)`"),
    (lambda m, b: _mean_ce(m, b) * (b["labels"] != -100).sum(),
     r"combined with a computed tensor in `\w+ = mul\(cross_entropy, sum\w*\)`"),
    (lambda m, b: _mean_ce(m, b) * _mean_ce(m, b), "combined with a computed tensor"),
    (lambda m, b: 4.0 / _mean_ce(m, b),
     r"its value is the divisor in `\w+ = truediv\(4\.?0?, cross_entropy\)`"),
], ids=["count_times_loss", "loss_times_count", "loss_squared", "const_div_loss"])
def test_loss_combined_with_computed_values_raises(body, message):
    with pytest.raises(treefx.TreeCompileError, match=message):
        _step(body)()


@pytest.mark.parametrize("body, message", [
    (lambda m, b: F.cross_entropy(_logits(m, b)[:, :-2].flatten(0, 1),
                                  b["labels"][:, 2:].flatten()), r"sliced \[0:-2\]"),
    (lambda m, b: F.cross_entropy(_logits(m, b)[:, :-1].flatten(0, 1),
                                  b["labels"][:, 1:].flatten(), reduction="none").sum(),
     "reduction='none'"),
    (lambda m, b: F.cross_entropy(_logits(m, b).flatten(0, 1), b["labels"].flatten()),
     "not the labels shifted by one"),
    (lambda m, b: F.cross_entropy(_logits(m, b)[:, :-1].flatten(0, 1),
                                  b["labels"][:, 1:].flatten(), reduction="sum")
     / (b["labels"] != -100).sum(), "combined with a computed tensor"),
    (lambda m, b: F.cross_entropy(_logits(m, b)[:, :-1].flatten(0, 1),
                                  b["labels"][:, 1:].flatten(), label_smoothing=0.1),
     "label_smoothing=0.1"),
    (lambda m, b: _logits(m, b).logsumexp(-1).mean(), "computes no cross-entropy"),
])
def test_unprovable_losses_raise(body, message):
    with pytest.raises(treefx.TreeCompileError, match=message):
        _step(body)()


def _mixtral_with_router_logits():
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def test_moe_with_router_logits_trains_its_cross_entropy_and_refuses_the_aux_loss():
    """Hugging Face installs its output-capturing hooks (the router logits) on the first
    forward, under a lock Dynamo cannot trace; treefx installs them before the capture. A
    step that returns the cross-entropy is exact; one whose loss adds the router's
    load-balancing term (computed over the DFS row, not per sequence) is refused, naming it."""
    model = _mixtral_with_router_logits()
    check_step(treefx.step(make_hand_step("mean"), backend="eager"), model,
               odd_forest(22, VOCAB), "mean")
    with pytest.raises(treefx.TreeCompileError, match="another loss is added to it"):
        treefx.step(hf_labels_step, backend="eager")(model, treefx.pack(odd_forest(22, VOCAB)))


def test_hybrid_step_with_the_models_default_cache():
    """Qwen3-Next builds a cache when called without use_cache=False and writes each
    recurrence's final state into it (a tree recurrence has none) and pads a short row's conv
    state: the step runs the model with use_cache off (and restores its config), exactly."""
    transformers = pytest.importorskip("transformers")
    from test_hybrid import _gdn_config

    cfg = _gdn_config("qwen3_next")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert model.config.use_cache is True
    check_step(treefx.step(make_hand_step("sum"), backend="eager"), model,
               odd_forest(23, VOCAB), "sum")
    assert model.config.use_cache is True


def hf_step_without_mask(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


@pytest.mark.parametrize("regional", [False, True])
def test_hf_model_called_without_attention_mask(regional):
    """A step that passes no attention_mask, as a per-sequence step needs none: transformers
    >= 5.24 then infers packed sequences from the positions (a diff over the tokens), which on
    the tree would cut each branch off its prefix. Each sequence alone finds one sequence, and
    so does the tree step: exact, and HF's function is restored after the call."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    before = getattr(masking_utils, "find_packed_sequence_indices", None)
    model = hf_model("qwen3", "sdpa")
    step = treefx.step(hf_step_without_mask, backend="eager", regional=regional)
    check_step(step, model, odd_forest(24, VOCAB), "mean")
    assert getattr(masking_utils, "find_packed_sequence_indices", None) is before
