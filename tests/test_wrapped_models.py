"""Models as users hold them: PEFT LoRA models, models already wrapped in ``torch.compile``,
forwards written ``(*args, **kwargs)``. ``treefx.compile`` and ``@treefx.step`` are exact on
them against the per-branch oracle (values and the LoRA parameters' gradients, float32 CPU),
or refuse with an error that says what to do."""

from __future__ import annotations

import logging

import pytest
import torch
from support import VOCAB, check_against_oracle, grads, hf_model
from test_step import check_step, hf_labels_step, make_hand_step
from trees import odd_forest

import treefx
from treefx.models import tiny_decoder

peft = pytest.importorskip("peft")

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_qwen3(task_type: str | None = "CAUSAL_LM"):
    """HF Qwen3 from a tiny config with random weights and LoRA adapters on every linear
    layer; the adapters' B matrices are made nonzero (PEFT starts them at 0, where the A
    matrices' gradients vanish and the adapters change nothing)."""
    config = peft.LoraConfig(task_type=task_type, r=4, lora_alpha=8, lora_dropout=0.0,
                             target_modules=LORA_TARGETS)
    model = peft.get_peft_model(hf_model("qwen3", "sdpa"), config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model


def _lora_grads_only(g: dict) -> None:
    assert g and all("lora_" in n for n in g), sorted(g)[:4]
    assert any("lora_A" in n for n in g) and any("lora_B" in n for n in g)
    assert all(v.abs().max() > 0 for v in g.values())


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", pytest.param(None, marks=pytest.mark.slow)],
                         ids=["PeftModelForCausalLM", "PeftModel"])
def test_peft_lora_matches_oracle(task_type):
    """``PeftModelForCausalLM`` names its arguments; ``PeftModel`` (no task type) takes
    ``(*args, **kwargs)`` and passes them to its base model, whose forward treefx reads."""
    model = lora_qwen3(task_type)
    assert type(model).__name__ == ("PeftModelForCausalLM" if task_type else "PeftModel")
    tm = treefx.compile(model, backend="eager")
    assert tm.opts["attention_mask"]  # else HF reads the tree's positions as packed documents
    trees = odd_forest(40, VOCAB)
    check_against_oracle(tm, trees)  # log-probs, every trainable (LoRA) gradient, the loss

    # The LoRA gradients once more, by hand: the tree loss against each sequence alone.
    batch = treefx.pack(trees)
    treefx.tree_loss(tm(batch), batch).backward()
    g_tree = grads(model)
    treefx.reference.sequence_loss(model, trees).backward()
    g_ref = grads(model)
    _lora_grads_only(g_ref)
    assert g_tree.keys() == g_ref.keys()
    for name, g in g_ref.items():
        err = (g_tree[name] - g).norm() / g.norm()
        assert err <= 1e-4, f"gradient of {name} off by {err:.2e} (relative)"


def test_peft_lora_logprobs_only_and_first_call_check():
    model = lora_qwen3()
    tm = treefx.compile(model, backend="eager", logits=False, verify=True)
    trees = odd_forest(41, VOCAB)
    out = tm(treefx.pack(trees))
    assert tm.verification.passed and tm.verification.compared_params == len(
        [p for p in model.parameters() if p.requires_grad])
    assert out.logits is None
    with torch.no_grad():
        ref = treefx.reference.sequence_logprobs(model, trees)
    batch = treefx.pack(trees)
    for i, lp in enumerate(ref):
        torch.testing.assert_close(out.token_logprobs[batch.sequence_index(i)[1:]].detach(), lp,
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("which,backend", [("hf_labels", "eager"), ("hand_written", "eager"),
                                           pytest.param("hf_labels", "aot-eager",
                                                        marks=pytest.mark.slow)])
def test_peft_lora_step(which, backend):
    """The fused loss skips the frozen output projection's gradient (AOTAutograd traces it as
    Inductor would)."""
    model = lora_qwen3()
    fn = hf_labels_step if which == "hf_labels" else make_hand_step("mean")
    step = treefx.step(fn, backend=backend)
    check_step(step, model, odd_forest(42, VOCAB), "mean")
    model.zero_grad(set_to_none=True)
    step(model, treefx.pack(odd_forest(42, VOCAB))).backward()
    _lora_grads_only(grads(model))


def test_peft_prompt_learning_is_refused():
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = peft.get_peft_model(hf_model("qwen3", "sdpa"), config)
    with pytest.raises(TypeError, match="adds virtual tokens .* use a weight adapter"):
        treefx.compile(model, backend="eager")


def _never_called(gm, example_inputs):
    raise AssertionError("the torch.compile wrapper's own backend ran")


def test_torch_compiled_model_is_unwrapped(caplog):
    """``treefx.compile(torch.compile(model))`` compiles the original module itself (same
    parameters); the wrapper's backend never runs. So does ``@treefx.step``."""
    model = hf_model("qwen3", "sdpa")
    wrapped = torch.compile(model, backend=_never_called)
    with caplog.at_level(logging.INFO, logger="treefx"):
        tm = treefx.compile(wrapped, backend="eager")
    assert tm.model is model
    assert "wrapped in torch.compile" in caplog.text
    check_against_oracle(tm, odd_forest(43, VOCAB))

    step = treefx.step(hf_labels_step, backend="eager")
    trees = odd_forest(44, VOCAB)
    loss = step(wrapped, treefx.pack(trees))
    loss.backward()
    g_tree = grads(model)
    ref = treefx.reference.sequence_loss(model, trees, reduction="mean")
    ref.backward()
    g_ref = grads(model)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-4)
    for name, g in g_ref.items():
        assert (g_tree[name] - g).norm() / g.norm().clamp_min(1e-12) <= 1e-4, name


@pytest.mark.slow
def test_torch_compiled_peft_model():
    model = lora_qwen3()
    tm = treefx.compile(torch.compile(model, backend=_never_called), backend="eager")
    assert tm.model is model
    check_against_oracle(tm, odd_forest(45, VOCAB))


class ForwardsEverything(torch.nn.Module):
    """A wrapper whose forward names no argument, as RL frameworks write them."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, *args, **kwargs):
        return self.lm(*args, **kwargs)


class PositionalOnly(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, *args):
        return self.lm(*args)


def test_args_kwargs_forward_needs_its_signature():
    """treefx cannot tell what ``forward(*args, **kwargs)`` takes (an HF model inside needs
    ``attention_mask``): an error saying what to pass, then exact with it."""
    wrapper = ForwardsEverything(hf_model("qwen3", "sdpa"))
    with pytest.raises(TypeError, match=r"ForwardsEverything\.forward takes only \(\*args, "
                                        r"\*\*kwargs\).*forward_signature=model\.<inner>\.forward"):
        treefx.compile(wrapper, backend="eager")
    tm = treefx.compile(wrapper, backend="eager", forward_signature=wrapper.lm.forward)
    assert tm.opts["attention_mask"] and tm.opts["use_cache"]
    check_against_oracle(tm, odd_forest(46, VOCAB))


def test_positional_only_forward_gets_the_tokens():
    """A forward of ``*args`` alone can take nothing but the tokens: no signature needed."""
    torch.manual_seed(0)
    tm = treefx.compile(PositionalOnly(tiny_decoder(vocab_size=VOCAB)), backend="eager")
    check_against_oracle(tm, odd_forest(47, VOCAB))
