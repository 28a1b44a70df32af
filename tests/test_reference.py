"""The per-branch oracle: sequence_logprobs / sequence_loss against hand computation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treefx import Tree
from treefx.reference import logits_of, sequence_logprobs, sequence_loss

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    cfg = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(cfg).double().eval()
    # Random init gives nearly uniform logits; scale the head up so log-probs differ clearly.
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return m


@pytest.fixture(scope="module")
def trees():
    a = Tree.from_sequences(
        [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2], [7]],
        weights=[0.5, 1.5, 2.0, 3.0],
        loss_masks=[[1, 1, 0, 1, 1], [0, 0, 1, 1], [1, 1], [1]],
    )
    b = Tree.from_sequences([[10, 11, 12], [10, 11, 13, 14, 15, 16]])  # default weights, masks
    return [a, b]


def _manual_logprobs(model, seq):
    ids = torch.tensor([seq])
    logits = model(input_ids=ids).logits[0].to(torch.float64)
    logp = torch.log_softmax(logits, dim=-1)
    return torch.stack([logp[j - 1, seq[j]] for j in range(1, len(seq))]) if len(seq) > 1 else \
        torch.zeros(0, dtype=torch.float64)


def test_sequence_logprobs_matches_manual(model, trees):
    with torch.no_grad():
        lps = sequence_logprobs(model, trees)
    seqs = [s for t in trees for s in t.sequences]
    assert len(lps) == len(seqs) == 6
    for lp, seq in zip(lps, seqs):
        # Computed in the logits' dtype, at least float32: float64 here.
        assert lp.dtype == torch.float64
        assert lp.shape == (len(seq) - 1,)
        want = _manual_logprobs(model, seq)
        torch.testing.assert_close(lp, want, rtol=1e-12, atol=1e-12)
        assert (lp <= 0).all()
    # Every sequence runs alone: [1, 2] is a prefix of [1, 2, 3, 4, 5], so (causal model) its
    # log-probs are the first ones of the longer sequence's.
    torch.testing.assert_close(lps[2], lps[0][:1])
    assert lps[3].numel() == 0  # one token: nothing predicted
    # A single tree works as well as a list.
    with torch.no_grad():
        one = sequence_logprobs(model, trees[1])
    for a, b in zip(one, lps[4:]):
        torch.testing.assert_close(a, b)


def test_sequence_logprobs_log_softmax_of_the_logits(model):
    # Direct manual computation for one sequence, from softmax probabilities.
    seq = [5, 9, 33, 2, 60, 1]
    tree = Tree.from_sequences([seq])
    with torch.no_grad():
        (lp,) = sequence_logprobs(model, tree)
        logits = model(torch.tensor([seq])).logits[0]
        probs = torch.softmax(logits, dim=-1)
    want = torch.tensor([float(torch.log(probs[j - 1, seq[j]])) for j in range(1, len(seq))],
                        dtype=torch.float64)
    torch.testing.assert_close(lp, want, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(lp, lp.mean().expand_as(lp), atol=1e-3)  # not a trivial model


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sequence_loss_matches_hand_computation(model, trees, reduction):
    with torch.no_grad():
        lps = sequence_logprobs(model, trees)
        loss = sequence_loss(model, trees, reduction=reduction)
        global_loss = sequence_loss(model, trees, reduction=reduction, num_sequences=15)
    # The mean over all 6 sequences of both trees, not a sum of per-tree means.
    want = 0.0
    k = 0
    for t in trees:
        for i in range(t.num_sequences):
            m = t.loss_mask(i).tolist()[1:]
            lp = lps[k].double().tolist()
            k += 1
            n = sum(m)
            r = 1.0 if reduction == "sum" else (1.0 / n if n else 0.0)
            want += float(t.weights[i]) * r * sum(mj * -x for mj, x in zip(m, lp))
    assert k == 6
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert loss.dtype == torch.float64
    assert float(loss) == pytest.approx(want / 6, rel=1e-12)
    assert float(loss) > 0
    # A global count of 15 sequences (these 6 being a micro-batch of them).
    assert float(global_loss) == pytest.approx(want / 15, rel=1e-12)


def test_sequence_loss_by_hand_on_a_tiny_case(model):
    # One sequence, weight 2, mask [., 1, 0, 1]: sum = 2 * (-lp1 - lp3) / 1; mean = half that.
    seq = [3, 4, 5, 6]
    tree = Tree.from_sequences([seq], weights=[2.0], loss_masks=[[0, 1, 0, 1]])
    with torch.no_grad():
        lp = _manual_logprobs(model, seq)
        s = float(sequence_loss(model, tree, reduction="sum"))
        m = float(sequence_loss(model, tree, reduction="mean"))
    assert s == pytest.approx(2 * float(-lp[0] - lp[2]), rel=1e-10)
    assert m == pytest.approx(s / 2, rel=1e-12)
    # Nothing to predict: 0, not NaN.
    with torch.no_grad():
        zero = sequence_loss(model, Tree.from_sequences([[5]]), reduction="mean")
        masked = sequence_loss(model, Tree.from_sequences([[5, 6]], loss_masks=[[1, 0]]), reduction="mean")
    assert float(zero) == 0.0 and float(masked) == 0.0


class _LowPrecisionLM(torch.nn.Module):
    """Returns bfloat16 logits (a tuple output), like a model run in bf16."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 16)

    def forward(self, ids):
        return (self.emb(ids).to(torch.bfloat16), None)


def test_low_precision_logits_are_promoted_to_float32():
    torch.manual_seed(0)
    lm = _LowPrecisionLM()
    seq = [1, 2, 3, 4]
    (lp,) = sequence_logprobs(lm, Tree.from_sequences([seq]))
    assert lp.dtype == torch.float32
    logits = lm.emb(torch.tensor(seq)).to(torch.bfloat16).float()
    want = torch.log_softmax(logits[:-1], dim=-1)[torch.arange(3), torch.tensor(seq[1:])]
    torch.testing.assert_close(lp, want)
    loss = sequence_loss(lm, Tree.from_sequences([seq]))
    loss.backward()
    assert lm.emb.weight.grad.abs().sum() > 0


def test_sequence_loss_is_differentiable(model, trees):
    model.zero_grad(set_to_none=True)
    loss = sequence_loss(model, trees, reduction="mean")
    assert loss.requires_grad
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["lm_head.weight"] is not None and grads["lm_head.weight"].abs().sum() > 0
    assert grads["model.embed_tokens.weight"].abs().sum() > 0
    attn = [g for n, g in grads.items() if "self_attn" in n and g is not None]
    assert attn and any(g.abs().sum() > 0 for g in attn)
    model.zero_grad(set_to_none=True)


def test_sequence_loss_bad_arguments(model, trees):
    with pytest.raises(ValueError, match="reduction"):
        sequence_loss(model, trees, reduction="avg")
    with pytest.raises(TypeError, match="treefx.Tree"):
        sequence_loss(model, [])
    with pytest.raises(TypeError, match="treefx.Tree"):
        sequence_logprobs(model, [trees[0], "x"])
    with pytest.raises(TypeError, match="treefx.Tree"):
        sequence_logprobs(model, 3)
    with pytest.raises(ValueError, match="num_sequences=5 is smaller than the 6 sequences"):
        sequence_loss(model, trees, num_sequences=5)
    with pytest.raises(TypeError, match="num_sequences must be an integer count"):
        sequence_loss(model, trees, num_sequences=6.0)


def test_logits_of():
    t = torch.randn(1, 3, 5)
    assert logits_of(t) is t
    assert logits_of((t, torch.zeros(1))) is t
    assert logits_of([t]) is t
    assert logits_of(SimpleNamespace(logits=t, loss=None)) is t
    out = transformers.modeling_outputs.CausalLMOutputWithPast(logits=t)
    assert logits_of(out) is t
    for bad in ({"logits": t}, (), ("x", t), SimpleNamespace(logits="x"), None, 3):
        with pytest.raises(TypeError, match="cannot find logits"):
            logits_of(bad)
