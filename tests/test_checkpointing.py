"""Activation checkpointing: Dynamo captures each checkpointed region as the body of a
higher-order op, and the passes rewrite inside it exactly as at top level. Values and every
gradient against the per-branch oracle (float32, CPU, eager backend, train() mode with dropout
0), for Hugging Face gradient checkpointing with both ``use_reentrant`` values,
``torch.utils.checkpoint`` in user code, a selective policy, nested regions, ``cond``, and
``@treefx.step``; a higher-order op that runs its body along the tokens is refused."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from trees import odd_forest

import treefx
from treefx.models import enable_activation_checkpointing, tiny_decoder, tiny_hybrid
from treefx.verification import Tolerance

transformers = pytest.importorskip("transformers")

VOCAB = 64
EXACT = Tolerance(logprob=1e-4, grad=1e-4)

HF = {
    "qwen3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                 resid_pdrop=0.0, embd_pdrop=0.0),
    "qwen3_next": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       layer_types=["linear_attention", "full_attention"],
                       linear_num_value_heads=2, linear_num_key_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=16,
                       decoder_sparse_step=1),
}


def hf_checkpointed(name: str, use_reentrant: bool, impl: str = "sdpa"):
    cfg = transformers.AutoConfig.for_model(name, vocab_size=VOCAB, **HF[name])
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    enable_activation_checkpointing(model, use_reentrant=use_reentrant)
    return model.train()


def regions(ctx) -> list[str]:
    """The higher-order-op bodies the passes went into."""
    return [c.body.op for c in ctx.scopes() if c.body is not None]


def rewritten_in_bodies(ctx, pass_name: str) -> int:
    return sum(r.pass_name == pass_name and not r.kept and "subgraph body" in r.note
               for r in ctx.log)


def check(tm, trees, tol=EXACT):
    for reduction in ("sum", "mean"):
        report = treefx.verify(tm, trees, reduction=reduction, tolerance=tol)
        assert report.passed and report.compared_params == report.total_params > 0


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("name,impl", [  # in CI: Qwen3 both ways; the others -m slow
    ("qwen3", "sdpa"), pytest.param("llama", "eager", marks=pytest.mark.slow),
    pytest.param("gpt2", "sdpa", marks=pytest.mark.slow)])
def test_hf_gradient_checkpointing_is_exact(name, impl, use_reentrant):
    model = hf_checkpointed(name, use_reentrant, impl)
    tm = treefx.compile(model, backend="eager")
    check(tm, odd_forest(1, VOCAB))
    (ctx,) = tm.contexts
    assert regions(ctx) == ["tag_activation_checkpoint"] * 2
    assert rewritten_in_bodies(ctx, "attention") == 2


@pytest.mark.parametrize("use_reentrant", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["nonreentrant", "reentrant"])
def test_hf_hybrid_gradient_checkpointing_is_exact(use_reentrant):
    model = hf_checkpointed("qwen3_next", use_reentrant)
    tm = treefx.compile(model, backend="eager")
    # Hugging Face's Gated DeltaNet computes in float32 and its chunked kernel rounds
    # differently at other chunk boundaries: the oracle's own floor (docs/ARCHITECTURE.md).
    check(tm, odd_forest(2, VOCAB), Tolerance(logprob=1e-4, grad=1e-3))
    (ctx,) = tm.contexts
    assert rewritten_in_bodies(ctx, "ssm") == 2  # the conv and the recurrence, inside a body
    assert rewritten_in_bodies(ctx, "attention") == 1


class Checkpointed(torch.nn.Module):
    """User code: a layer run under ``torch.utils.checkpoint``."""

    def __init__(self, layer, **kwargs):
        super().__init__()
        self.layer, self.kwargs = layer, kwargs

    def forward(self, *args):
        return checkpoint(self.layer, *args, **self.kwargs)


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {
    "nonreentrant": dict(use_reentrant=False),
    "reentrant": dict(use_reentrant=True),
    "selective": dict(use_reentrant=False, context_fn=functools.partial(
        create_selective_checkpoint_contexts, _save_matmuls)),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("attn_impl", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def test_torch_checkpoint_in_user_code_is_exact(policy, attn_impl):
    torch.manual_seed(0)
    model = tiny_decoder(vocab_size=VOCAB, attn_impl=attn_impl)
    model.layers = torch.nn.ModuleList(Checkpointed(layer, **POLICIES[policy])
                                       for layer in model.layers)
    tm = treefx.compile(model, backend="eager")
    check(tm, odd_forest(3, VOCAB))
    (ctx,) = tm.contexts
    assert regions(ctx) == ["tag_activation_checkpoint"] * 2
    # The eager attention (matmul, softmax, matmul) and the mask it builds live inside the
    # region.
    assert rewritten_in_bodies(ctx, "attention") == 2


def test_pure_torch_hybrid_checkpointed_is_exact():
    torch.manual_seed(0)
    model = tiny_hybrid(vocab_size=VOCAB)
    model.layers = torch.nn.ModuleList(Checkpointed(layer, use_reentrant=False)
                                       for layer in model.layers)
    tm = treefx.compile(model, backend="eager")
    check(tm, odd_forest(4, VOCAB))
    assert rewritten_in_bodies(tm.contexts[0], "ssm") >= 2


def test_nested_regions_are_rewritten():
    torch.manual_seed(0)
    model = tiny_decoder(vocab_size=VOCAB)
    inner = [Checkpointed(layer, use_reentrant=False) for layer in model.layers]
    model.layers = torch.nn.ModuleList(Checkpointed(layer, use_reentrant=False)
                                       for layer in inner)
    tm = treefx.compile(model, backend="eager")
    check(tm, odd_forest(5, VOCAB))
    bodies = [c for c in tm.contexts[0].scopes() if c.body is not None]
    assert len(bodies) == 4 and any(c.parent.body is not None for c in bodies)


class CondBlock(torch.nn.Module):
    """A block whose attention runs inside one of two ``torch.cond`` branches."""

    def __init__(self, layer, flag: bool):
        super().__init__()
        self.layer, self.flag = layer, flag

    def forward(self, x, cos, sin):
        pred = torch.tensor(self.flag)
        return torch.cond(pred, lambda x, c, s: self.layer(x, c, s),
                          lambda x, c, s: self.layer(x, c, s) * 1.0, (x, cos, sin))


def test_cond_branches_are_rewritten():
    torch.manual_seed(0)
    model = tiny_decoder(vocab_size=VOCAB)
    model.layers = torch.nn.ModuleList(CondBlock(layer, i % 2 == 0)
                                       for i, layer in enumerate(model.layers))
    tm = treefx.compile(model, backend="eager")
    trees = odd_forest(6, VOCAB)
    batch = treefx.pack(trees)
    with torch.no_grad():  # torch.cond has no CPU backward through sdpa here; forward only
        out = tm(batch)
        ref = treefx.reference.sequence_logprobs(model, trees)
    for i, lp in enumerate(ref):
        torch.testing.assert_close(out.token_logprobs[batch.sequence_index(i)[1:]], lp,
                                   atol=1e-4, rtol=0)
    assert regions(tm.contexts[0]).count("cond") == 4  # two branches per layer


def hf_labels_step(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 labels=batch["labels"]).loss


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_step_with_gradient_checkpointing_is_exact(use_reentrant):
    model = hf_checkpointed("qwen3", use_reentrant)
    step = treefx.step(hf_labels_step, backend="eager")
    trees = odd_forest(7, VOCAB)
    loss = step(model, treefx.pack(trees, reduction="mean"))
    loss.backward()
    g_tree = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = treefx.reference.sequence_loss(model, trees, reduction="mean")
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-4)
    for n, p in model.named_parameters():
        err = (g_tree[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-12)
        assert err <= 1e-4, f"gradient of {n} off by {err:.2e}"
    assert rewritten_in_bodies(step.contexts[0], "attention") == 2


def _autocast_step(model, batch, tm, *, warm: str):
    """One bfloat16-autocast training step of ``tm`` on ``batch`` (the backward outside the
    region, as Trainer does it); ``warm``: what ran in the same region before the tree call.
    The gradients."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if warm == "eager":  # the model alone first: its bf16 weight copies are cached
            model(torch.tensor([[1, 2, 3, 4]])).logits.float().sum().backward()
            model.zero_grad(set_to_none=True)
        loss = treefx.tree_loss(tm(batch), batch)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("warm", ["eager", "eager-autocast-forward",
                                  pytest.param("verify", marks=pytest.mark.slow)])
def test_checkpointed_regions_under_autocast_after_the_model_ran(warm):
    """Gradient checkpointing under bfloat16 autocast, where the same autocast region ran the
    model before the tree call (TRL's default bf16 and gradient checkpointing, with treefx's
    first-call check): autocast had cached its bf16 weight copies, the forward took them from
    the cache and the recompute cast them again ("aten._to_copy ... not found in storage").
    Each tree call now starts with the cache empty and off; the gradients equal a step without
    the earlier run. ``eager-autocast-forward``: the model's forward wrapped in an autocast of
    its own (accelerate's mixed precision), which switches the cache on inside; ``verify``:
    the first-call check itself (13 s: -m slow; the eager case is what it runs first)."""
    model = hf_checkpointed("qwen3", use_reentrant=False)
    if warm == "eager-autocast-forward":
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    batch = treefx.pack(odd_forest(3, VOCAB), reduction="mean")
    tm = treefx.compile(model, backend="eager", verify=warm == "verify")
    got = _autocast_step(model, batch, tm, warm="none" if warm == "verify" else "eager")
    assert warm != "verify" or tm.verification.passed
    ref = _autocast_step(model, batch, tm, warm="none")
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, rtol=0, atol=0, msg=n)


class ScanModel(torch.nn.Module):
    """A linear recurrence written with torch's associative_scan along the tokens."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.decay = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids):
        from torch._higher_order_ops.associative_scan import associative_scan

        x = self.emb(input_ids)
        a = torch.sigmoid(self.decay(x))

        def combine(left, right):
            return (left[0] * right[0], right[0] * left[1] + right[1])

        _, h = associative_scan(combine, (a, x), dim=1, combine_mode="generic")
        return self.head(h)


def test_a_scan_along_the_tokens_is_refused():
    tm = treefx.compile(ScanModel(), backend="eager")
    with pytest.raises(treefx.TreeCompileError, match="associative_scan|along the sequence"):
        tm(treefx.pack(odd_forest(8, VOCAB)))


def test_dropout_in_a_region_keeps_its_draws():
    """Dead-code elimination must not drop a random draw inside a body (a later draw would
    shift); the verification refuses to compare such a graph instead of failing on noise."""
    torch.manual_seed(0)
    model = tiny_decoder(vocab_size=VOCAB)

    class Noisy(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x, cos, sin):
            F.dropout(x, p=0.5, training=True)  # unused draw
            return self.layer(x, cos, sin)

    model.layers = torch.nn.ModuleList(Checkpointed(Noisy(layer), use_reentrant=False)
                                       for layer in model.layers)
    tm = treefx.compile(model, backend="eager")
    with pytest.raises(treefx.verification.VerificationUnavailable, match="random"):
        treefx.verify(tm, odd_forest(9, VOCAB))


def test_a_checkpointed_layer_that_stores_keys_for_later_layers_is_exact():
    """Gemma 4 (and Gemma 3n) layers store their keys and values in a dict that later layers
    read (KV sharing). Inside a checkpointed layer that write is a side effect Dynamo refused
    to trace (a graph break: treefx refused the model with checkpointing on); captured with it
    done once in the forward, the model equals the oracle, values and every gradient."""
    from treefx.tools import zoo

    r = zoo.run_model("gemma4_text", checkpointing=True)
    assert r["status"] == "exact", r
