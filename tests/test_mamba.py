"""The Mamba (v1) family: treefx's selective scan with an initial state against Hugging Face's
own kernel, and HF Mamba, Falcon-Mamba, Jamba and Zamba against the per-branch oracle."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
from support import VOCAB, check_against_oracle
from test_hybrid import SHORT_NODES, _multiplicity
from trees import odd_forest, odd_tree

import treefx
from treefx.compiler.recurrences import Recurrence, recurrence, register_recurrence
from treefx.families.hf_kernels import torch_function
from treefx.ops.recurrence import padding_is_neutral, tree_recurrence
from treefx.ops.recurrence.reference import _NEUTRAL
from treefx.ops.selective_scan import selective_scan

transformers = pytest.importorskip("transformers")
modeling_mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")

# Hugging Face's torch selective scan (its token loop), not mamba_ssm's kernel where that is
# installed: the torch function beneath Hugging Face's wrapper. None before transformers 5.15,
# whose Mamba mixer writes the scan inline (refused: test_hf_mamba_family_matches_oracle).
HF_SCAN = torch_function(getattr(modeling_mamba, "mamba_selective_scan", None))
needs_hf_scan = pytest.mark.skipif(HF_SCAN is None, reason="this transformers has no "
                                   "mamba_selective_scan (its Mamba mixer's scan is inline)")


def scan_inputs(batch=2, width=6, state=4, length=11, dtype=torch.float64, seed=0):
    """hidden_states, dt, A, B, C, D, z, delta_bias of a selective scan. Values are rounded to
    float32 (HF's kernel casts B and x with .float()), so float64 runs compare exactly."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):  # float32 values
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_()

    a = (-torch.rand(width, state, generator=g) * 4 - 0.1).to(dtype).requires_grad_()
    return dict(hidden_states=r(batch, width, length), dt=r(batch, width, length),
                A=a, B=r(batch, state, length), C=r(batch, state, length), D=r(width),
                z=r(batch, width, length), delta_bias=r(width, scale=0.5))


OPTIONS = {
    "full": dict(delta_softplus=True),
    "no_gate_no_skip": dict(delta_softplus=True, z=None, D=None),
    "no_bias_no_softplus": dict(delta_bias=None, delta_softplus=False),
}


def _call(fn, inputs, option, **kw):
    args = {**inputs, **OPTIONS[option]}
    if not args["delta_softplus"]:  # a positive step without softplus
        args["dt"] = args["dt"].abs()
    return fn(**args, **kw)


def _tensors(inputs, option):
    return [t for k, t in inputs.items() if k not in OPTIONS[option]]


@needs_hf_scan
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype, tol, grad_tol", [(torch.float64, 1e-10, 1e-6),
                                                  (torch.float32, 2e-5, 1e-4)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("length", [1, 2, 8, 13])
def test_selective_scan_matches_hf_kernel(option, dtype, tol, grad_tol, length):
    """Plain sequences from a zero state: the output, the last state and every gradient equal
    Hugging Face's token loop (log-step scan here). In float64 HF's .float() casts of x and B
    round their gradients to float32, hence the gradients' looser tolerance."""
    inputs = scan_inputs(length=length, dtype=dtype)
    ours, ours_state = _call(selective_scan, inputs, option, return_last_state=True)
    ref, ref_state = _call(HF_SCAN, inputs, option, return_last_state=True)
    assert ours.dtype == dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref.to(dtype), atol=tol, rtol=tol)
    torch.testing.assert_close(ours_state, ref_state, atol=tol, rtol=tol)
    assert _call(selective_scan, inputs, option).shape == ours.shape  # bare output
    probe = torch.randn(ours.shape, dtype=dtype)
    wrt = _tensors(inputs, option)
    got = torch.autograd.grad((ours * probe).sum() + ours_state.sum(), wrt)
    want = torch.autograd.grad((ref * probe).sum() + ref_state.sum(), wrt)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=grad_tol, rtol=grad_tol)


@needs_hf_scan
def test_selective_scan_keeps_half_precision_inputs_dtype():
    inputs = {k: t.detach().to(torch.bfloat16) if k not in ("A", "D", "delta_bias") else
              t.detach().float() for k, t in scan_inputs(dtype=torch.float32).items()}
    out, state = selective_scan(**inputs, delta_softplus=True, return_last_state=True)
    ref, _ = HF_SCAN(**inputs, delta_softplus=True, return_last_state=True)
    assert out.dtype == ref.dtype == torch.float32 and state.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("cut", [1, 5, 10])
def test_selective_scan_hands_its_state_over(cut):
    """A sequence cut in two, the second part starting from the first part's last state, is
    the sequence in one piece: values, last state, and gradients through the state."""
    inputs = scan_inputs(length=11)
    full, full_state = selective_scan(**inputs, delta_softplus=True, return_last_state=True)
    seq = ("hidden_states", "dt", "B", "C", "z")
    first = {k: (t[..., :cut] if k in seq else t) for k, t in inputs.items()}
    second = {k: (t[..., cut:] if k in seq else t) for k, t in inputs.items()}
    out1, state1 = selective_scan(**first, delta_softplus=True, return_last_state=True)
    out2, state2 = selective_scan(**second, delta_softplus=True, return_last_state=True,
                                  initial_state=state1)
    joined = torch.cat([out1, out2], dim=-1)
    torch.testing.assert_close(joined, full, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(state2, full_state, atol=1e-12, rtol=1e-12)
    probe = torch.randn(full.shape, dtype=full.dtype)
    wrt = list(inputs.values())
    got = torch.autograd.grad((joined * probe).sum() + state2.sum(), wrt)
    want = torch.autograd.grad((full * probe).sum() + full_state.sum(), wrt)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("length", [1, 2, 3, 5, 8])
def test_selective_scan_gradients(length):
    """The scan's hand-written backward (states recomputed, a reverse scan) against finite
    differences, from a zero and from a given state."""
    inputs = scan_inputs(batch=2, width=3, state=2, length=length, seed=length)
    h0 = torch.randn(2, 3, 2, dtype=torch.float64).requires_grad_()
    names = list(inputs)

    def run(*tensors, with_state):
        args = dict(zip(names, tensors[:len(names)]))
        state = tensors[-1] if with_state else None
        out, last = selective_scan(**args, delta_softplus=True, return_last_state=True,
                                   initial_state=state)
        return out, last

    assert torch.autograd.gradcheck(lambda *t: run(*t, with_state=True),
                                    (*inputs.values(), h0))
    assert torch.autograd.gradcheck(lambda *t: run(*t, with_state=False), tuple(inputs.values()))


def test_selective_scan_of_no_tokens():
    inputs = {k: t.detach() for k, t in scan_inputs(length=0).items()}
    out, state = selective_scan(**inputs, return_last_state=True)
    assert out.shape == (2, 6, 0) and torch.all(state == 0) and state.shape == (2, 6, 4)
    h0 = torch.randn(2, 6, 4, dtype=torch.float64)
    assert torch.equal(selective_scan(**inputs, return_last_state=True, initial_state=h0)[1], h0)


@needs_hf_scan
@pytest.mark.parametrize("option", ["full", "no_gate_no_skip"])
@pytest.mark.parametrize("trees", [[SHORT_NODES], odd_forest(41, VOCAB)], ids=["short", "forest"])
def test_tree_selective_scan_matches_each_sequence_alone(trees, option):
    """HF's kernel run over the tree (treefx's scan per depth, neutral dt = -inf padding) is
    the scan on each sequence alone: values (against HF's kernel too) and the gradients of
    every input (against treefx's scan: HF's rounds those of x and B to float32); a gate the
    model passes as None stays None."""
    rec = recurrence("mamba_mamba_selective_scan")
    batch = treefx.pack(trees)
    inputs = scan_inputs(batch=1, length=batch.num_tokens, seed=1)
    kw = OPTIONS[option]
    args = {**inputs, **kw}
    out = tree_recurrence(rec, batch.parent_token, (), args)
    g = torch.Generator().manual_seed(2)
    probe = torch.randn(out.shape, dtype=out.dtype, generator=g)
    wrt = _tensors(inputs, option)
    grads_tree = torch.autograd.grad((out * probe).sum(), wrt)
    mult = _multiplicity(batch)
    total = 0
    seq = ("hidden_states", "dt", "B", "C", "z")
    for i in range(batch.num_sequences):
        idx = batch.sequence_index(i)
        alone = {k: (t[..., idx] if k in seq and t is not None else t) for k, t in args.items()}
        ref = selective_scan(**alone)
        torch.testing.assert_close(out[..., idx], ref, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(out[..., idx], HF_SCAN(**alone), atol=1e-10, rtol=1e-10)
        total = total + (ref * probe[..., idx] / mult[idx]).sum()
    for a, r in zip(grads_tree, torch.autograd.grad(total, wrt)):
        torch.testing.assert_close(a, r, atol=1e-9, rtol=1e-9)


@needs_hf_scan
def test_mamba_padding_is_neutral_only_after_softplus():
    """dt = -inf is a step of 0 after softplus; without softplus it is not neutral (measured:
    the tree then runs nodes of equal length together, unpadded)."""
    rec = recurrence("mamba_mamba_selective_scan")
    inputs = {k: t.detach() for k, t in scan_inputs(batch=1, length=5).items()}
    seq = {k: inputs.pop(k) for k in ("hidden_states", "dt", "B", "C", "z")}
    assert padding_is_neutral(rec, seq, dict(inputs, delta_softplus=True))
    assert not padding_is_neutral(rec, seq, dict(inputs, delta_softplus=False))


def test_tree_fn_must_take_the_state():
    def kernel(x, a, flag=False):
        return x

    def tree_kernel(x, a, flag=False):  # no initial_state
        return x

    with pytest.raises(ValueError, match=r"tree_fn tree_kernel has no parameters "
                                         r"\['initial_state'\]"):
        register_recurrence(Recurrence(name="no_state_test", fn=kernel, seq_args={"x": 1},
                                       output_final_state="flag", tree_fn=tree_kernel))


# --------------------------------------------------------------------------------- HF models

def _config(model_type: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2)
    if model_type in ("mamba", "falcon_mamba"):
        extra = dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=4)
    elif model_type == "jamba":
        # Layer 0 Mamba with a dense MLP, layer 1 attention with 4 experts (top 2).
        extra = dict(intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                     mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                     attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                     expert_layer_offset=1, num_experts=4, num_experts_per_tok=2)
    else:  # zamba: two hybrid layers (Mamba, and one transformer block that both share: its
        # weights are tied as the word embeddings are)
        extra = dict(layers_block_type=["hybrid", "hybrid"],
                     intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                     attention_hidden_size=64, attention_head_dim=16, n_mamba_heads=2,
                     mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)
    cfg = transformers.AutoConfig.for_model(model_type, **common, **extra)
    if model_type in ("jamba", "zamba"):
        cfg._attn_implementation = "sdpa"
    return cfg


def _model(model_type: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(model_type)).eval()


@pytest.mark.parametrize("model_type, scans", [
    ("mamba", 2), ("falcon_mamba", 2), ("jamba", 1),
    pytest.param("zamba", 2 * 2, marks=pytest.mark.slow)])
def test_hf_mamba_family_matches_oracle(model_type, scans):
    """Hugging Face's Mamba-v1 models: the selective scan (treefx's, from each node's parent
    state) and the causal conv1d run through the tree; Jamba's attention and experts and
    Zamba's shared attention block alongside. Values and every gradient."""
    model = _model(model_type)
    if model_type == "zamba":
        blocks = [layer.shared_transf for layer in model.model.layers]
        assert blocks[0].self_attn.q_proj.weight is blocks[1].self_attn.q_proj.weight
    tm = treefx.compile(model, backend="eager")
    if not hasattr(sys.modules[type(model).__module__], "mamba_selective_scan"):  # before 5.15
        with pytest.raises(treefx.TreeCompileError, match=r"Mamba mixer at .* under "
                           rf"transformers {transformers.__version__}: before 5\.15"):
            tm(treefx.pack([SHORT_NODES]))
        return
    check_against_oracle(tm, [SHORT_NODES, odd_tree(42, VOCAB)])
    notes = [r.note for r in tm.contexts[0].log if r.pass_name == "ssm"]
    verdicts = {k[0]: v for k, v in _NEUTRAL.items()}
    assert verdicts[f"{model_type}_mamba_selective_scan"] is True  # levels run padded
    # Zamba calls the scan once per Mamba head.
    assert notes.count(f"recurrence {model_type}_mamba_selective_scan") == scans
    assert notes.count("causal conv1d") == scans // (2 if model_type == "zamba" else 1)


@needs_hf_scan
def test_traced_hf_mamba_matches_oracle():
    """The inductor backend's form (the recurrence as one opaque custom op, its backward
    recomputing the forward), traced by AOTAutograd and run eagerly: values and gradients
    (Mamba has no attention, so the CPU can run the whole backward)."""
    model = _model("mamba")
    tm = treefx.compile(model, backend="aot-eager")
    check_against_oracle(tm, [SHORT_NODES, odd_tree(43, VOCAB)])
    ops = [r.after for r in tm.contexts[0].log if "recurrence" in r.note]
    assert len(ops) == 2 and all("tree_recurrence_op_" in op for op in ops)


@needs_hf_scan
@pytest.mark.parametrize("d_dtype", [torch.float32, torch.bfloat16])
def test_selective_scan_output_dtype_is_hfs(d_dtype):
    """bfloat16 inputs with a float32 D (as HF's mixers pass it): HF's kernel returns float32,
    and the traced graph expects what the model's kernel returns."""
    hf = HF_SCAN
    g = torch.Generator().manual_seed(0)
    x, dt, z = (torch.randn(1, 4, 3, generator=g).bfloat16() for _ in range(3))
    A = -torch.rand(4, 2, generator=g)
    B, C = (torch.randn(1, 2, 3, generator=g).bfloat16() for _ in range(2))
    D = torch.ones(4, dtype=d_dtype)
    want = hf(x, dt, A, B, C, D=D, z=z, delta_softplus=True).dtype
    assert selective_scan(x, dt, A, B, C, D=D, z=z, delta_softplus=True).dtype == want
