"""fla (flash-linear-attention) as the tree recurrence's fast path: the gate that says where its
gradients are known to be right, the announced fallback to Hugging Face's torch kernel, and
the query/key expansion to the value heads. fla's kernels need a GPU; what runs here is the
decision and the fallback (benchmarks/fla_check.py checks the kernels on the GPU)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import treefx
from treefx.families import fla

transformers = pytest.importorskip("transformers")

H100 = (9, 0)
A100 = (8, 0)


@pytest.mark.parametrize("kernel, version, triton, cap, tilelang, kdim, ok", [
    # fla 0.4.2 tiles keys wider than 64 by 128 on Hopper: clear of issue 640's 64 tiles
    ("gated_delta_rule", "0.4.2", "3.6.0", H100, False, 128, True),
    ("gated_delta_rule", "0.4.2", "3.6.0", H100, False, 64, False),
    ("gated_delta_rule", "0.4.2", "3.6.0", H100, False, 48, False),
    ("gated_delta_rule", "0.4.2", "3.6.0", H100, False, 32, True),
    ("gated_delta_rule", "0.4.2", "3.6.0", H100, False, None, False),
    ("gated_delta_rule", "0.4.2", "3.3.1", H100, False, 64, True),
    ("gated_delta_rule", "0.4.2", "3.7.1", H100, False, 64, True),
    ("gated_delta_rule", "0.4.1", "3.6.0", H100, False, 128, False),
    ("gated_delta_rule", "0.4.2", "3.6.0", A100, False, 64, True),
    ("gated_delta_rule", "0.3.2", "3.6.0", A100, False, 128, False),
    # fla >= 0.5 mirrors fla's own guard: 0.5.0/0.5.1 from Triton 3.4.0 on, 0.5.2 on below 3.7.1
    ("gated_delta_rule", "0.5.0", "3.6.0", H100, False, 128, False),
    ("gated_delta_rule", "0.5.0", "3.6.0", H100, True, 128, True),
    ("gated_delta_rule", "0.5.1", "3.7.1", H100, False, 128, False),
    ("gated_delta_rule", "0.5.2", "3.7.1", H100, False, 128, True),
    ("gated_delta_rule", "0.6.0", "3.6.0", H100, False, 128, False),
    ("gated_delta_rule", "0.6.0", "3.6.0+git1a2b", H100, True, 128, True),
    ("gated_delta_rule", "0.6.0", "3.6.0", A100, False, 128, True),
    ("gated_delta_rule", "0.6.0", "3.6.0", (10, 0), False, 128, True),
    # Kimi Delta Attention: fla 0.4.x's backward reads out of bounds on Hopper
    ("kimi_delta_attention", "0.4.2", "3.6.0", H100, False, 128, False),
    ("kimi_delta_attention", "0.4.2", "3.6.0", A100, False, 128, True),
    ("kimi_delta_attention", "0.5.0", "3.6.0", H100, False, 128, True),
])
def test_gate(kernel, version, triton, cap, tilelang, kdim, ok):
    got, why = fla.gate(kernel, version, triton, cap, tilelang, kdim)
    assert got is ok, why
    assert why == "known good" if ok else version in why


def test_gate_refuses_unknown_kernels():
    with pytest.raises(ValueError, match="unknown kernel"):
        fla.gate("mamba2", "0.4.2", "3.6.0", H100, False, 128)


def _env(**kw):
    base = dict(device_type="cuda", capability=H100, device_name="NVIDIA H100 80GB HBM3",
                fla="0.4.2", triton="3.6.0", torch="2.11.0", tilelang=False)
    return fla.Environment(**{**base, **kw})


def test_decide():
    use = fla.decide("gated_delta_rule", _env(), torch.bfloat16, 128)
    assert use.use and not use.loud
    off = fla.decide("gated_delta_rule", _env(setting="0"), torch.bfloat16, 128)
    assert not off.use and not off.loud and "TREEFX_FLA=0" in off.reason
    assert fla.decide("gated_delta_rule", _env(setting="1"), torch.bfloat16, 128).use
    cpu = fla.decide("gated_delta_rule", _env(device_type="cpu", capability=None),
                     torch.float32, 128)
    assert not cpu.use and not cpu.loud  # no fla kernel exists there: nothing to announce
    for env, dtype, why in [(_env(fla=None), torch.bfloat16, "not installed"),
                            (_env(), torch.float64, "float64"),
                            (_env(hip=True), torch.bfloat16, "ROCm"),
                            (_env(fla="0.5.0"), torch.bfloat16, "issue 640")]:
        d = fla.decide("gated_delta_rule", env, dtype, 128)
        assert not d.use and d.loud and why in d.reason, d
    with pytest.raises(ValueError, match="TREEFX_FLA"):
        fla.decide("gated_delta_rule", _env(setting="maybe"), torch.bfloat16, 128)


def test_a_fallback_is_announced_once_with_the_versions():
    env = _env(fla="0.5.1", triton="3.6.0")
    decision = fla.decide("gated_delta_rule", env, torch.bfloat16, 128)
    fla._WARNED.discard(("gated_delta_rule", decision.reason))
    with pytest.warns(fla.FlaFallbackWarning) as got:
        fla.announce("gated_delta_rule", decision, env)
    (w,) = got
    msg = str(w.message)
    for part in ("fla 0.5.1", "Triton 3.6.0", "torch 2.11.0", "NVIDIA H100", "compute 9.0",
                 "issue 640", "TREEFX_FLA=0", "torch kernel"):
        assert part in msg, (part, msg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fla.announce("gated_delta_rule", decision, env)  # once per process and reason
        fla.announce("gated_delta_rule", fla.decide("gated_delta_rule", _env(setting="0"),
                                                    torch.bfloat16, 128), env)


def test_this_machine_falls_back_quietly_on_cpu_tensors():
    q = torch.zeros(1, 3, 2, 8)
    seq = {"query": q, "key": q, "value": q, "g": q[..., 0], "beta": q[..., 0]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fla.use_fla("gated_delta_rule", seq, {}) is False
    env = fla.environment(torch.device("cpu"))
    assert env.device_type == "cpu" and env.capability is None


def _hf_gdn():
    """Hugging Face's torch Gated DeltaNet beneath its wrapper (a function up to transformers
    5.24, the ``kernels`` package's ``Func`` module from 5.25)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    from treefx.families.hf_kernels import torch_function

    fn = torch_function(m.torch_chunk_gated_delta_rule)
    assert inspect.isfunction(fn) and fn.__module__ == m.__name__, fn
    return fn


def test_expand_heads_is_hugging_faces_mapping():
    """Query/key of 2 heads expanded to 6 value heads, run with equal heads, give what Hugging
    Face's torch kernel gives on the unexpanded ones (transformers >= 5.24 expands inside the
    kernel; 5.17 in the layer, the same repeat_interleave), values and the gradients of the
    unexpanded query and key."""
    kernel = _hf_gdn()
    params = inspect.signature(kernel).parameters
    g = torch.Generator().manual_seed(0)
    n, hk, hv, d = 7, 2, 6, 8
    q, k = (torch.randn(1, n, hk, d, dtype=torch.float64, generator=g).requires_grad_()
            for _ in range(2))
    v = torch.randn(1, n, hv, d, dtype=torch.float64, generator=g)
    decay = -torch.rand(1, n, hv, dtype=torch.float64, generator=g)
    beta = torch.rand(1, n, hv, dtype=torch.float64, generator=g)
    probe = torch.randn(1, n, hv, d, dtype=torch.float64, generator=g)
    qe, ke = fla.expand_heads(q, k, hv)
    assert qe.shape == (1, n, hv, d) and ke.shape == (1, n, hv, d)
    out, _ = kernel(qe, ke, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad((out * probe).sum(), (q, k))
    assert all(gr.shape == (1, n, hk, d) for gr in grads)
    if "kwargs" in params and "repeat_interleave" in inspect.getsource(kernel):
        ref, _ = kernel(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
        ref_grads = torch.autograd.grad((ref * probe).sum(), (q, k))
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # Another mapping (each value head cycling through the key heads) is another model.
    tiled, _ = kernel(q.repeat(1, 1, hv // hk, 1), k.repeat(1, 1, hv // hk, 1), v, g=decay,
                      beta=beta, use_qk_l2norm_in_kernel=True)
    assert (tiled - out).abs().max() > 1e-3
    assert fla.expand_heads(q, k, hk) == (q, k)
    with pytest.raises(ValueError, match="multiple"):
        fla.expand_heads(q, k, 5)


def test_tree_runs_the_torch_kernel_under_hugging_faces_wrapper():
    """Hugging Face's decorated kernel would call fla itself when fla is installed, past the
    gate; the tree's padded path runs the torch function beneath it, and on the CPU the tree
    takes that path (counted by kernel_runs)."""
    from treefx.compiler.recurrences import recurrence
    from treefx.ops.recurrence import kernel_runs, tree_recurrence

    rec = recurrence("qwen3_next_gated_delta_rule")
    assert rec.run is _hf_gdn() and rec.varlen is fla.gated_delta_rule
    batch = treefx.pack([treefx.Tree.from_sequences([[1, 2, 3], [1, 2, 4, 5], [6]])])
    n = batch.num_tokens
    x = torch.randn(1, n, 2, 8)
    before = kernel_runs()
    tree_recurrence(rec, batch.parent_token, (x, x, x),
                    dict(g=-torch.rand(1, n, 2), beta=torch.rand(1, n, 2)))
    after = kernel_runs()
    key = (rec.name, "padded")
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert after.get((rec.name, "varlen"), 0) == before.get((rec.name, "varlen"), 0)
