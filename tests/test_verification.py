"""treefx.verify and the first-call check of treefx.compile: pass on exact models, catch a
planted defect (a pass switched off) naming the worst token and parameter, leave the model's
state alone, and say so when they cannot compare (random draws)."""

from __future__ import annotations

import logging

import pytest
import torch
from support import MaskedAttention
from trees import odd_forest

import treefx
import treefx.compiler.pipeline
from treefx.models import tiny_decoder
from treefx.verification import (
    FLOOR_FACTOR,
    Tolerance,
    VerificationUnavailable,
    probe_forest,
    tolerance_for,
)

VOCAB = 64


def model(**kw):
    torch.manual_seed(0)
    return tiny_decoder(vocab_size=VOCAB, **kw)


@pytest.fixture
def without_positions_pass(monkeypatch):
    """A planted defect: the model keeps DFS indices as its positions."""
    _drop_positions_pass(monkeypatch)


def _drop_positions_pass(monkeypatch):
    monkeypatch.setattr(treefx.compiler.pipeline, "PASSES",
                        tuple(p for p in treefx.compiler.pipeline.PASSES
                              if p[0] != "positions"))


def test_probe_forest_has_every_odd_shape():
    trees = probe_forest(VOCAB)
    assert len(trees) == 2
    first, second = trees
    seqs = first.sequences
    assert any(a != b and a == b[:len(a)] for a in seqs for b in seqs)  # a prefix
    assert any(seqs.count(s) > 1 for s in seqs)  # a duplicate
    assert 1 in first.segment_lengths.tolist()  # a single-token node
    assert any(len(s) == 1 for s in second.sequences)  # nothing to predict
    assert first.loss_masks is not None and second.loss_masks is None
    assert sum(t.num_tokens for t in probe_forest(VOCAB, min_tokens=300)) >= 300


def test_passes_on_an_exact_model():
    report = treefx.verify(model(), backend="eager")
    assert report.passed
    assert report.compared_params == report.total_params == len(list(model().parameters()))
    assert report.max_logprob_error < 1e-5 and report.max_grad_error < 1e-4
    assert "passed" in str(report) and report.tolerance == tolerance_for(torch.float32)


def test_non_finite_tree_gradients_and_log_probs_are_named():
    """A tree run whose kernels make NaN / inf (Gemma 4's norms through Inductor on the GPU)
    fails with the parameters and the token count named, and an error that says so instead
    of pointing at a rewrite of the token axis. The tree side here is the compiled model with
    one gradient and one log-prob made non-finite on the way out (``tree_run``)."""
    from treefx.verification import TreeVerificationError, verify_compiled

    m = model()
    tm = treefx.compile(m, backend="eager", verify=False)
    target = "layers.0.attention_norm.weight"
    assert target in dict(m.named_parameters())

    def tree_run(batch, params):
        out = tm(batch)
        loss = treefx.tree_loss(out, batch)
        grads = list(torch.autograd.grad(loss, [p for _, p in params], allow_unused=True))
        i = [n for n, _ in params].index(target)
        grads[i] = grads[i].clone()
        grads[i][0] = float("nan")
        lp = out.token_logprobs.detach().clone()
        lp[3] = float("inf")  # a token inside a sequence (the first has no log-prob)
        return lp, grads

    report = verify_compiled(tm, grads=True, params="all", raise_on_failure=False,
                             tree_run=tree_run, floor=False)
    assert not report.passed
    assert report.nonfinite_grads == (target,) and report.nonfinite_logprobs == 1
    assert "gradients of 1 parameter(s) are NOT FINITE (layers.0.attention_norm.weight)" in str(report)
    with pytest.raises(TreeVerificationError, match="made NaN or inf where each sequence run "
                       "alone did not"):
        verify_compiled(tm, grads=True, params="all", tree_run=tree_run, floor=False)
    clean = treefx.verify(m, backend="eager")
    assert clean.nonfinite_grads == () and clean.nonfinite_logprobs == 0


@pytest.mark.parametrize("planted", [False, True])
def test_probe_padded_to_the_batch_length_checks_the_same(planted, monkeypatch):
    """pad_to: the tree side runs the probe on a row padded with inert tokens to the first
    batch's length (what a compiled model's first call does through Inductor, so that it
    compiles once); the verdict, the errors and the reported tokens are the probe's own, on
    an exact model and on a planted defect alike."""
    from treefx.verification import verify_compiled

    seen = []

    def tree_run(tm):
        def run(batch, params):
            seen.append((batch.num_tokens, batch.num_real_tokens))
            lp = tm(batch).token_logprobs
            return lp, []
        return run

    if planted:  # the defect of without_positions_pass
        _drop_positions_pass(monkeypatch)
    tm = treefx.compile(model(), backend="eager", verify=False)
    plain = verify_compiled(tm, grads=False, raise_on_failure=False)
    padded = verify_compiled(tm, grads=False, raise_on_failure=False, tree_run=tree_run(tm),
                             pad_to=plain.num_tokens + 37)
    assert seen == [(plain.num_tokens + 37, plain.num_tokens)]
    assert padded.num_tokens == plain.num_tokens
    assert padded.passed == plain.passed == (not planted)
    assert abs(padded.max_logprob_error - plain.max_logprob_error) <= 1e-6 + \
        1e-4 * plain.max_logprob_error
    assert padded.worst_token == plain.worst_token


def test_catches_a_planted_defect(without_positions_pass):
    tm = treefx.compile(model(), backend="eager", verify=False)
    with pytest.raises(treefx.TreeVerificationError) as info:
        treefx.verify(tm)
    report = info.value.report
    assert not report.passed and report.max_logprob_error > 1e-3
    s, j, t = report.worst_token
    assert j >= 1 and 0 <= t < report.num_tokens
    assert f"sequence {s}, position {j}" in str(info.value)
    assert report.worst_param[0] in dict(tm.model.named_parameters())


def test_report_without_raising(without_positions_pass):
    report = treefx.verify(model(), backend="eager", raise_on_failure=False)
    assert not report.passed and "FAILED" in str(report)


def test_first_call_verifies_and_raises(without_positions_pass):
    tm = treefx.compile(model(), backend="eager", verify=True)
    with pytest.raises(treefx.TreeVerificationError):
        tm(treefx.pack(odd_forest(1, VOCAB)))


def test_first_call_report_is_kept():
    tm = treefx.compile(model(), backend="eager", verify=True)
    out = tm(treefx.pack(odd_forest(2, VOCAB)))
    assert out.token_logprobs.requires_grad
    assert tm.verification.passed and tm.verification.compared_params > 0
    # Without autograd the first call compares log-probabilities alone.
    tm = treefx.compile(model(), backend="eager", verify=True)
    with torch.no_grad():
        tm(treefx.pack(odd_forest(2, VOCAB)))
    assert tm.verification.passed and tm.verification.compared_params == 0


def test_model_state_is_left_alone():
    m = model()
    m.register_buffer("counter", torch.zeros(3))
    grads = {}
    for n, p in m.named_parameters():
        p.grad = torch.full_like(p, 7.0)
        grads[n] = p.grad
    torch.manual_seed(123)
    expected_draw = torch.rand(2)
    torch.manual_seed(123)
    treefx.verify(m, backend="eager")
    for n, p in m.named_parameters():
        assert p.grad is grads[n] and bool((p.grad == 7.0).all())
    assert torch.equal(torch.rand(2), expected_draw)


def test_random_draws_cannot_be_compared(caplog):
    m = model()

    class Noisy(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return torch.nn.functional.dropout(self.inner(input_ids), p=0.1, training=True)

    with pytest.raises(VerificationUnavailable, match="random"):
        treefx.verify(Noisy(m), backend="eager")
    tm = treefx.compile(Noisy(m), backend="eager", verify=True)
    with caplog.at_level(logging.WARNING, logger="treefx"):
        tm(treefx.pack(odd_forest(3, VOCAB)))
    assert isinstance(tm.verification, str) and "random" in tm.verification
    assert any("cannot verify" in r.message for r in caplog.records)


def test_environment_default(monkeypatch):
    monkeypatch.setenv("TREEFX_VERIFY", "1")
    assert treefx.compile(model()).verify_on_first_call is True
    monkeypatch.setenv("TREEFX_VERIFY", "0")
    assert treefx.compile(model()).verify_on_first_call is False
    assert treefx.compile(model(), verify=True).verify_on_first_call is True
    monkeypatch.setenv("TREEFX_VERIFY", "maybe")
    with pytest.raises(ValueError, match="TREEFX_VERIFY"):
        treefx.compile(model())


def test_float64_tolerance_and_explicit_trees():
    m = model().double()
    report = treefx.verify(m, odd_forest(4, VOCAB), backend="eager")
    assert report.dtype == torch.float64 and report.max_logprob_error < 1e-10
    one = treefx.verify(m, odd_forest(4, VOCAB), backend="eager", params=["lm_head.weight"])
    assert list(one.grad_errors) == ["lm_head.weight"]
    # With no tolerance of its own, the check applies a multiple of the oracle's own floor
    # (the per-sequence run against itself in other shapes): rounding, not a defect.
    tight = treefx.verify(m, backend="eager", tolerance=Tolerance(0.0, 0.0),
                          raise_on_failure=False)
    assert 0 < tight.logprob_floor < 1e-12 and 0 < tight.grad_floor < 1e-10
    assert tight.logprob_tolerance == FLOOR_FACTOR * tight.logprob_floor
    assert tight.passed == (tight.max_logprob_error <= tight.logprob_tolerance
                            and tight.max_grad_error <= tight.grad_tolerance)


def test_floor_does_not_hide_a_defect(without_positions_pass):
    report = treefx.verify(model(), backend="eager", raise_on_failure=False)
    assert not report.passed
    assert report.max_logprob_error > 1000 * report.logprob_floor


class LaterKeys(MaskedAttention):
    """Its first three positions see each other both ways (a bidirectional span, as image
    tokens get), through a group table it writes into: no tree form, and the compiler cannot
    see it statically. Run alone, a sequence's first tokens depend on its later ones; the
    floor's extended sequences change them, so the floor was as large as the error and the
    check passed (log-probs off by 0.26 within a floored tolerance of 0.6)."""

    def mask(self, input_ids, x, b, qi, ki):
        group = torch.full(x.shape[:2], -1)
        group[:, :3] = 0
        return (ki <= qi) | ((group[b, qi] == group[b, ki]) & (group[b, qi] >= 0))


def test_a_model_that_is_not_causal_fails_however_large_its_floor():
    torch.manual_seed(0)
    report = treefx.verify(LaterKeys(), odd_forest(3, VOCAB), backend="eager",
                           raise_on_failure=False)
    assert report.floor_measured and not report.causal and not report.passed
    assert report.causal_error > 1e-2 and "NOT CAUSAL" in str(report)
    causal = treefx.verify(model(), backend="eager", floor=True)
    assert causal.passed and causal.causal_error < 1e-6


def test_floor_perturbs_the_embeddings_by_one_rounding():
    """The floor run moves the outputs of the embeddings (and linear layers) by up to one
    rounding of their dtype (so that a model which amplifies rounding, an MoE router near a
    tie, shows it), and leaves no hook behind."""
    from treefx.verification import rounding_noise

    m = model().to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 50))
    emb = m.get_input_embeddings() if hasattr(m, "get_input_embeddings") else next(
        x for x in m.modules() if isinstance(x, torch.nn.Embedding))
    plain = emb(ids)
    with rounding_noise(m, 0):
        noisy = emb(ids)
    assert not emb._forward_hooks
    rel = ((noisy.float() - plain.float()).abs() / plain.float().abs().clamp_min(1e-30))
    assert 0 < rel.max() <= torch.finfo(torch.bfloat16).eps
    assert torch.equal(emb(ids), plain)
    report = treefx.verify(m, backend="eager", grads=False, floor=True)
    assert report.floor_measured and report.logprob_floor > 0


def test_floor_measured_only_where_the_dtype_tolerance_is_missed():
    """By default the oracle's floor (one more per-sequence run) is measured only where the
    comparison misses the dtype's tolerance: a pass within it needs none."""
    m = model()
    within = treefx.verify(m, backend="eager")
    assert within.passed and not within.floor_measured and within.logprob_floor == 0
    assert set(within.stage_seconds) == {"tree", "oracle"}
    assert "floor not needed" in str(within)
    tight = treefx.verify(m, backend="eager", tolerance=Tolerance(0.0, 0.0),
                          raise_on_failure=False)
    assert tight.floor_measured and tight.logprob_floor > 0 and "floor" in tight.stage_seconds
    never = treefx.verify(m, backend="eager", tolerance=Tolerance(0.0, 0.0), floor=False,
                          raise_on_failure=False)
    assert not never.floor_measured and not never.passed
    with pytest.raises(ValueError, match="floor must be True, False or 'auto'"):
        treefx.verify(m, backend="eager", floor="always")


# ------------------------------------------------------------------ explain and the command line

def test_explain_shows_the_verification():
    from treefx.tools.debug import explain

    report = explain(model(), odd_forest(3, VOCAB), verify=True)
    assert report.verification is not None and report.verification.passed
    assert report.status == "compiled, verified"
    assert "verification (the tree run against each sequence run alone)" in str(report)
    assert explain(model(), odd_forest(3, VOCAB), verify=False).verification is None


def test_explain_shows_a_failed_verification(without_positions_pass):
    from treefx.tools.debug import explain

    report = explain(model(), odd_forest(3, VOCAB), verify=True)
    assert report.ok and not report.verification.passed  # compiled, but wrong
    assert report.status == "compiled, verification FAILED"
    assert "FAILED" in str(report)


def test_cli_check_exit_status_says_what_it_found(capsys, without_positions_pass):
    from treefx.tools.cli import main

    # a planted defect: compiles, but differs from each sequence alone -> 1
    assert main(["check", "treefx.tools.debug.examples:qwen3_tiny", "--backend", "eager"]) == 1
    out = capsys.readouterr().out
    assert "qwen3_tiny, eager backend on cpu, float32" in out and "FAILED" in out


def test_cli_check_passes_and_refuses(capsys):
    from treefx.tools.cli import main

    assert main(["check", "treefx.tools.debug.examples:qwen3_tiny", "--backend", "eager",
                 "--dtype", "float64"]) == 0
    assert "treefx verify passed" in capsys.readouterr().out
    # attention written with einsum matches no pattern: refused with the node named -> 2
    assert main(["check", "support:EinsumAttention", "--backend", "eager"]) == 2
    out = capsys.readouterr().out
    assert "refused (UnmatchedAttentionError)" in out and "att = .softmax(einsum" in out
    with pytest.raises(SystemExit, match="cannot build a tiny 'no_such_type'"):
        main(["check", "hf:no_such_type"])


# ------------------------------------------------------------------ the probe's vocabulary


class TokenTable(torch.nn.Module):
    """A token embedding that is not an ``nn.Embedding``: a table indexed by the ids."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, dim) * 0.1)

    def forward(self, ids):
        return self.table[ids]


class CustomEmbedding(torch.nn.Module):
    """Tokens through a :class:`TokenTable` of ``VOCAB`` rows, positions through an
    ``nn.Embedding`` of 4 · VOCAB rows: the model's only ``nn.Embedding`` is not its token
    embedding, and it declares no vocabulary (no config, no get_input_embeddings)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tokens = TokenTable(VOCAB, 16)
        self.pos = torch.nn.Embedding(4 * VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.tokens(input_ids) + self.pos(position_ids)
        q, k, v = (t[:, None] for t in self.qkv(x).chunk(3, dim=-1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + out[:, 0])


def test_probe_vocabulary_of_a_custom_token_embedding():
    """The probe's ids stay inside the vocabulary of a model whose token embedding is a custom
    module (they came from its position nn.Embedding, 4x larger: an IndexError in the model):
    the width of its logits, or the largest id of the user's batch."""
    from treefx.verification import probe_vocab_size

    m = CustomEmbedding()
    assert probe_vocab_size(m) == VOCAB  # its logits' width
    report = treefx.verify(m, backend="eager")
    assert report.passed
    tm = treefx.compile(CustomEmbedding(), backend="eager", verify=True)
    tm(treefx.pack(odd_forest(1, VOCAB)))  # the first-call probe
    assert tm.verification.passed


class NeedsPositions(CustomEmbedding):
    """Its forward requires position_ids, so it cannot be run on bare ids to measure it."""

    def forward(self, input_ids, position_ids):
        return super().forward(input_ids, position_ids)


def test_probe_vocabulary_unknown_says_why_and_what_to_do():
    from treefx.verification import VocabularyUnknown, probe_vocab_size

    with pytest.raises(VocabularyUnknown, match=r"cannot tell which token ids NeedsPositions "
                       r"takes for the probe forest: it declares no vocabulary .*, and running "
                       r"it on two tokens of id 0 failed: TypeError: .*position_ids.*; pass "
                       r"trees= .*config.vocab_size"):
        treefx.verify(NeedsPositions(), backend="eager")
    assert probe_vocab_size(NeedsPositions(), largest_id=9) == 10  # the ids of a batch it takes
