"""Log-probabilities without logits: ``treefx.compile(model, logits=False)`` and the fused op
under it (:mod:`treefx.ops.logprobs`). Values and gradients equal the full-logits path and
the oracle, and the [N, vocab] logits are never allocated (CPU, float32 / float64)."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB, hf_model
from torch.profiler import ProfilerActivity, profile
from trees import odd_forest

import treefx
from treefx.ops.cross_entropy import fast as ce
from treefx.ops.logprobs import fast as lp_ops
from treefx.ops.logprobs import fused_linear_tree_logprobs, linear_tree_logprobs_reference

transformers = pytest.importorskip("transformers")


def _inputs(n, dim, vocab, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, n, dim, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, dim, generator=g, dtype=dtype) / dim ** 0.5).requires_grad_()
    b = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_() if bias else None
    ids = torch.randint(0, vocab, (1, n), generator=g)
    parent = torch.arange(n) - 1 - torch.randint(0, 3, (n,), generator=g)  # some far, some -1
    parent = torch.where(parent < 0, -1, parent)
    return h, w, b, ids, parent


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n", [1, 37], ids=["N1", "N37"])
@pytest.mark.parametrize("block", [None, 8], ids=["one-block", "blocks-of-8"])
@pytest.mark.parametrize("all_rows", [False, True], ids=["trained-rows", "all-rows"])
def test_fused_logprobs_match_reference(monkeypatch, dtype, bias, n, block, all_rows):
    """Forward in chunks of 10 tokens; backward over vocabulary slices (about 25 rows for the
    ~24 trained tokens), in one block of tokens (each slice of the weight's gradient written
    once) or in blocks of 8 (summed in float32 over blocks); over the trained rows (found with
    nonzero) or every row (``all_rows``, as parts take it: the untrained add zero)."""
    vocab, dim = 53, 12
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", 10 * vocab)  # chunks of 10 tokens
    if block is not None:
        monkeypatch.setattr(lp_ops, "_TOKEN_BLOCK", block)
    h, w, b, ids, parent = _inputs(n, dim, vocab, dtype, bias)
    upstream = torch.randn(n, dtype=torch.promote_types(dtype, torch.float32))
    upstream[::3] = 0  # tokens no objective trains: skipped in the backward
    params = [t for t in (h, w, b) if t is not None]

    lp = fused_linear_tree_logprobs(h, w, b, ids, parent, all_rows)
    got = torch.autograd.grad((lp * upstream).sum(), params)
    ref_lp = linear_tree_logprobs_reference(h, w, b, ids, parent)
    ref = torch.autograd.grad((ref_lp * upstream).sum(), params)

    assert lp.dtype == ref_lp.dtype == torch.promote_types(dtype, torch.float32)
    assert torch.all(lp[parent < 0] == 0)
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=tol)
    for name, g_got, g_ref in zip(("h", "weight", "bias"), got, ref):
        assert g_got.dtype == g_ref.dtype
        err = (g_got.double() - g_ref.double()).norm() / g_ref.double().norm().clamp_min(1e-30)
        assert err <= tol, f"d/d {name} off by {err:.2e} (relative)"


@pytest.mark.parametrize("block", [None, 8], ids=["one-block", "blocks-of-8"])
def test_fused_logprobs_add_the_weight_gradient_into_a_buffer(monkeypatch, block):
    """``grad_into`` (a part's ``.grad`` of the output projection): the weight's gradient is
    added into it, in one or several token blocks, and autograd gets none for the weight."""
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", 10 * 53)
    if block is not None:
        monkeypatch.setattr(lp_ops, "_TOKEN_BLOCK", block)
    h, w, b, ids, parent = _inputs(37, 12, 53, torch.float64, True)
    before = torch.randn_like(w)
    into = before.clone()
    upstream = torch.randn(37, dtype=torch.float64)
    lp = fused_linear_tree_logprobs(h, w, b, ids, parent, True, grad_into=into)
    (lp * upstream).sum().backward()
    assert w.grad is None
    ref_w, ref_b, ref_h = torch.autograd.grad(
        (linear_tree_logprobs_reference(h, w, b, ids, parent) * upstream).sum(), (w, b, h))
    torch.testing.assert_close(into - before, ref_w, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(b.grad, ref_b, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(h.grad, ref_h, atol=1e-10, rtol=1e-10)


def test_frozen_projection_gets_no_gradient():
    """A LoRA model's output projection is frozen: only the hidden states get a gradient."""
    h, w, _, ids, parent = _inputs(20, 8, 31, torch.float64, False)
    w.requires_grad_(False)
    lp = fused_linear_tree_logprobs(h, w, None, ids, parent)
    lp.sum().backward()
    assert w.grad is None
    (ref,) = torch.autograd.grad(linear_tree_logprobs_reference(h, w, None, ids, parent).sum(), h)
    torch.testing.assert_close(h.grad, ref)


def test_custom_op_registration():
    """Schema, fake (meta) implementation and autograd registration agree with the real op:
    what AOTAutograd and Inductor rely on."""
    h, w, b, ids, parent = _inputs(9, 6, 17, torch.float64, True)
    torch.library.opcheck(torch.ops.treefx.linear_tree_logprobs.default, (h, w, b, ids, parent))
    torch.library.opcheck(torch.ops.treefx.linear_tree_logprobs.default,
                          (h, w, None, ids, parent))


# ------------------------------------------------------------------------ compiled models


def _qwen3(vocab=VOCAB, **overrides):
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8)
    cfg.update(overrides)
    cfg = transformers.AutoConfig.for_model("qwen3", vocab_size=vocab, **cfg)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _param_grads(model, loss):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for n, p in model.named_parameters()
                                       if p.requires_grad], allow_unused=True)
    return dict(zip(names, grads))


@pytest.mark.parametrize("name,backend", [("qwen3", "eager"),
                                          pytest.param("gpt2", "eager", marks=pytest.mark.slow),
                                          pytest.param("qwen3", "aot-eager",
                                                       marks=pytest.mark.slow)])
def test_logprobs_only_equal_the_full_logits_path(name, backend):
    """Values with and without autograd, and every parameter's gradient under an arbitrary
    per-token upstream gradient (what an RL objective gives), equal the default compiled
    model's; the first-call check against the oracle passed."""
    model = hf_model(name, "sdpa")
    full = treefx.compile(model, backend="eager", verify=False)
    lp_only = treefx.compile(model, backend=backend, logits=False, verify=True)
    assert not lp_only.returns_logits and full.returns_logits
    trees = odd_forest(31, VOCAB)
    batch = treefx.pack(trees)
    upstream = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(1))
    upstream[batch.loss_weights == 0] = 0

    out = lp_only(batch)
    assert out.logits is None and out.token_logprobs.shape == (batch.num_tokens,)
    assert isinstance(lp_only.verification, treefx.VerificationReport)
    assert lp_only.verification.passed and lp_only.verification.compared_params > 0
    ref = full(batch)
    torch.testing.assert_close(out.token_logprobs, ref.token_logprobs, atol=1e-6, rtol=0)
    g_got = _param_grads(model, (out.token_logprobs * upstream).sum())
    g_ref = _param_grads(model, (ref.token_logprobs * upstream).sum())
    assert g_got.keys() == g_ref.keys()
    for n, g in g_ref.items():
        assert g is not None and g_got[n] is not None, n
        err = (g_got[n] - g).norm() / g.norm().clamp_min(1e-12)
        assert err <= 1e-5, f"gradient of {n} off by {err:.2e} (relative)"

    with torch.no_grad():
        out_ng = lp_only(batch)
        ref_ng = full(batch)
    assert not out_ng.token_logprobs.requires_grad
    torch.testing.assert_close(out_ng.token_logprobs, ref_ng.token_logprobs, atol=1e-6, rtol=0)
    # The tree loss, from the log-probs alone, is the oracle's.
    torch.testing.assert_close(treefx.tree_loss(out_ng, batch),
                               treefx.reference.sequence_loss(model, trees).detach(),
                               atol=1e-5, rtol=1e-5)
    notes = [r.note for c in lp_only.contexts for r in c.log if r.pass_name == "logprobs"]
    assert notes and all(n.startswith("fused with the output projection") for n in notes)


def _vocab_sized(tm, vocab):
    """Graph values (every compiled graph, every subgraph) with a vocabulary-sized last axis."""
    return [f"{n.name}: {list(v.shape)}" for ctx in tm.contexts for scope in ctx.scopes()
            for n in scope.graph.nodes
            for v in [n.meta.get("example_value")]
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[-1] == vocab]


def _largest_allocation(fn) -> int:
    """The largest single CPU allocation (bytes) any op makes while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.self_cpu_memory_usage for e in prof.events())


def test_logits_are_never_materialized(monkeypatch):
    """Neither the graph nor the run holds an [N, vocab] tensor: the graph has no value with
    a vocabulary-sized last axis, and no op allocates N·vocab floats, forward or backward
    (chunks of a quarter of the tokens). The default compiled model does both (the control:
    what the checks would see if the logits were built)."""
    vocab = 4001  # N·vocab floats dwarf everything else the model allocates
    model = _qwen3(vocab)
    trees = odd_forest(32, vocab) + odd_forest(34, vocab) + odd_forest(35, vocab)
    batch = treefx.pack(trees)
    n = batch.num_tokens
    logits_bytes = n * vocab * 4
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", (n // 4) * vocab)
    lp_only = treefx.compile(model, backend="eager", logits=False, verify=False)
    full = treefx.compile(model, backend="eager", verify=False)
    upstream = torch.randn(n)

    def train(tm):
        def run():
            out = tm(batch)
            (out.token_logprobs * upstream).sum().backward()
        return run

    def no_grad(tm):
        def run():
            with torch.no_grad():
                tm(batch)
        return run

    for run in (train, no_grad):  # compile both graphs before measuring
        run(lp_only)()
        run(full)()
    assert _vocab_sized(lp_only, vocab) == []
    assert _vocab_sized(full, vocab)  # the control: the default graph holds the logits
    for run in (train, no_grad):
        assert _largest_allocation(run(lp_only)) < logits_bytes / 2, run.__name__
        assert _largest_allocation(run(full)) >= logits_bytes, run.__name__  # the control
    model.zero_grad(set_to_none=True)


def test_logits_the_model_transforms_are_built_with_a_warning(caplog):
    """A final logit softcap (Gemma 2) is not a plain projection: the logits are built, the
    values are still exact, and the warning says why."""
    cfg = transformers.AutoConfig.for_model(
        "gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=3.0,
        attn_logit_softcapping=None)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tm = treefx.compile(model, backend="eager", logits=False, verify=True)
    full = treefx.compile(model, backend="eager", verify=False)
    batch = treefx.pack(odd_forest(33, VOCAB))
    with caplog.at_level("WARNING", logger="treefx"), torch.no_grad():
        out = tm(batch)
        ref = full(batch)
    assert tm.verification.passed
    assert "the logits are built: they come from" in caplog.text
    assert out.logits is None
    torch.testing.assert_close(out.token_logprobs, ref.token_logprobs, atol=1e-6, rtol=0)


def test_logits_option_is_checked():
    with pytest.raises(TypeError, match="logits must be True or False"):
        treefx.compile(hf_model("qwen3", "sdpa"), logits="no")
