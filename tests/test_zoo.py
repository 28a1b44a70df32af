"""The zoo's per-model check (treefx.tools.zoo): its classifier on real models, on a perturbed
treefx (it must report WRONG), on small hand-made models (refused, not a decoder), its tiny
configs and its report."""

from __future__ import annotations

import importlib
import re

import pytest
import torch


transformers = pytest.importorskip("transformers")
zoo = importlib.import_module("treefx.tools.zoo")
compile_module = importlib.import_module("treefx.run.model")


@pytest.mark.parametrize("model_type", ["qwen3", "gpt2", "llama"])
def test_fast_models_are_exact(model_type):
    r = zoo.run_model(model_type)
    assert r["status"] == "exact", r
    assert r["float32"]["logprob_err"] <= 1e-4 and r["float32"]["grad_err"] <= 1e-4
    assert "float64" not in r  # no second run when float32 passes


def _shift_values(logits, ids, parent):
    return _original(logits, ids, parent) + 1e-3


def _scale_gradients(logits, ids, parent):
    lp = _original(logits, ids, parent)
    return lp + 0.01 * (lp - lp.detach())  # same values, gradients x 1.01


_original = compile_module.tree_logprobs_from_logits


@pytest.mark.parametrize("perturb, verify", [(_shift_values, True), (_scale_gradients, False)],
                         ids=["values-self-check", "grads-unchecked"])
def test_perturbed_treefx_is_reported(monkeypatch, perturb, verify):
    """treefx's tree log-probs perturbed where the compiled model reads them from its logits.
    Without treefx's first-call self-check the classifier must call it WRONG, in float32 and
    in the float64 re-run, with the error it made; with the self-check, treefx refuses it and
    the zoo records the same numbers from a run without the check."""
    monkeypatch.setattr(compile_module, "tree_logprobs_from_logits", perturb)
    r = zoo.run_model("gpt2", verify=verify)  # (tests/conftest.py turns the default off)
    if verify:
        assert r["status"] == "refused", r
        assert r["float32"]["type"] == "TreeVerificationError"
        runs = r["unverified"]
        assert "the self-check caught a wrong rewrite || without it: float32: log-prob" \
            in r["detail"]
    else:
        assert r["status"] == "WRONG", r
        runs = r
        assert "float32: log-prob err" in r["detail"]
        assert re.search(r"float64( \([^)]*\))?: log-prob err", r["detail"])
    for dt in ("float32", "float64"):
        x = runs[dt]
        assert x["status"] == "WRONG"
        if perturb is _shift_values:
            assert x["logprob_err"] == pytest.approx(1e-3, rel=1e-2)
        else:
            assert x["logprob_err"] < (1e-5 if dt == "float32" else 1e-12)
            assert x["grad_err"] == pytest.approx(1e-2, rel=1e-2)
            # The oracle's own floor was measured (a gradient over the tolerance) and is far
            # below the error: it excuses rounding, not a wrong gradient.
            assert x["grad_floor"] < 1e-3 * x["grad_err"]
            assert x["grad_tol"] == zoo.TOLERANCES[dt][1]
            assert "the oracle's own floor there" in r["detail"]


def test_gradient_tolerance_from_the_oracles_floor():
    """A parameter's tolerance is the dtype's, or FLOOR_FACTOR x the oracle's own relative
    error there where that is larger; the parameter reported is the one nearest to (or
    furthest over) its own tolerance."""
    names = ["w", "lambda", "b"]
    errors = [5e-5, 3e-4, 1e-6]
    v = zoo.judge_gradients(names, errors, 1e-4)
    assert not v["ok"] and v["grad_param"] == "lambda" and "grad_floor" not in v
    v = zoo.judge_gradients(names, errors, 1e-4, floors=[1e-6, 1e-4, 0.0])
    assert v["ok"] and v["grad_param"] == "lambda"  # 3e-4 of 4e-4
    assert (v["grad_floor"], v["grad_tol"]) == (1e-4, zoo.FLOOR_FACTOR * 1e-4)
    v = zoo.judge_gradients(names, errors, 1e-4, floors=[1e-6, 5e-5, 0.0])
    assert not v["ok"] and v["grad_param"] == "lambda" and v["grad_tol"] == 2e-4
    v = zoo.judge_gradients(names, [5e-5, 1e-5, float("inf")], 1e-4, floors=[1e-5, 1.0, 1.0])
    assert not v["ok"] and v["grad_param"] == "b"  # not finite: never within a floor
    assert zoo.judge_gradients([], [], 1e-4)["ok"]
    ref = [torch.tensor([3.0, 4.0]), torch.zeros(2)]
    got = [torch.tensor([3.0, 4.5]), torch.tensor([0.0, 1e-7])]
    # 0.5 / 5; a zero gradient is measured against 1e-6 of the whole gradient's norm
    assert zoo.relative_errors(got, ref, 5.0) == pytest.approx([0.1, 1e-7 / 5e-6])


class Float32Norm(torch.nn.Module):
    """Per-token, with an RMSNorm computed in float32 whatever the model's dtype (as Hugging
    Face's are): a float64 run keeps float32 rounding in its gradients."""

    def __init__(self, vocab=zoo.VOCAB, dim=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.head(h.to(x.dtype))


def test_float64_throughout_lifts_float32_casts():
    """The float64 re-run computes in float64 also where the model casts to float32: there the
    tree and the per-sequence runs round a shared prefix's summed gradient differently in
    float32 (6e-8 here), and the oracle's measured floor (rounding noise of float64) does not
    see it; lifted, they agree to float64 rounding."""
    x = torch.randn(3, dtype=torch.float64)
    with zoo.float64_throughout() as mode:
        assert x.float().dtype == torch.float64
        assert x.to(torch.float32).dtype == torch.float64
        assert x.to("cpu", torch.float32).dtype == torch.float64
        assert torch.sum(x, dtype=torch.float32).dtype == torch.float64
        assert torch.softmax(x, 0, dtype=torch.float32).dtype == torch.float64
        assert torch.zeros(2, dtype=torch.float32).dtype == torch.float64
        assert x.view(torch.float32).shape == (6,)  # a reinterpretation is left alone
        assert x.to(torch.float16).dtype == torch.float16
        assert mode.lifted == 6
    assert x.float().dtype == torch.float32

    torch.manual_seed(0)
    model = Float32Norm().double()
    trees = zoo.probe_forest()
    r = zoo.compare(model, trees, tolerances=zoo.TOLERANCES["float64"])
    assert r["status"] == "WRONG" and 1e-8 < r["grad_err"] < 1e-6, r
    assert r["grad_floor"] < 1e-12
    with zoo.float64_throughout() as mode:
        r = zoo.compare(model, trees, tolerances=zoo.TOLERANCES["float64"])
    assert r["status"] == "exact" and r["grad_err"] < 1e-12, r
    assert mode.lifted > 0


@pytest.mark.slow
def test_cancelling_gradients_are_judged_on_the_oracles_floor():
    """DiffLlama's lambda_* gradients are sums that cancel to ~5e-6 of the whole gradient:
    float32 rounding there reached 1.4e-4 on one CPU (torch 2.11) against a fixed 1e-4. The
    tolerance of such a parameter is FLOOR_FACTOR x the oracle's own floor; here the fixed one
    is cut to 1e-5 so that this CPU shows it too."""
    model = zoo.build_model("diffllama")
    trees = zoo.probe_forest(zoo.VOCAB, zoo.special_token_ids(model.config))
    r = zoo.compare(model, trees, tolerances=(1e-4, 1e-5))
    assert r["status"] == "exact", r
    assert "grad_floor" in r and r["grad_err"] <= r["grad_tol"]


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gated_deltanet_rounding_is_told_by_float64_throughout(checkpointing):
    """LaraMini's Gated DeltaNet runs its kernel in float32 (also for float64 weights) and its
    MoE experts in grouped_mm (no float64): its A_log gradient, ~1e-6 of the whole, differs by
    ~1e-3 in float32 (the oracle moves by ~5e-4 with the kernel's chunk size alone). The
    float64 re-run, float64 throughout with batched_mm experts, tells it is rounding. In a
    checkpointing sweep that re-run goes without checkpointing: a checkpoint's recomputation
    in the backward runs outside float64_throughout, and torch.utils.checkpoint refused it
    (the row stayed WRONG)."""
    if "lara_mini" not in zoo.all_model_types():
        pytest.skip("LaraMini is new in transformers 5.24")
    r = zoo.run_model("lara_mini", checkpointing=checkpointing)
    assert r["status"] in ("exact", "rounding"), r
    if r["status"] == "rounding":
        x = r["float64"]
        assert x["setup"] == ["float32 casts lifted", "experts batched_mm"] + (
            ["without checkpointing"] if checkpointing else [])
        assert x["grad_err"] < 1e-8 and x["logprob_err"] < 1e-9


class _Embed(torch.nn.Module):
    def __init__(self, vocab=zoo.VOCAB, dim=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)


class DataDependentBranch(_Embed):
    """Causal, but its Python branch on a tensor value cannot be captured as one graph."""

    def forward(self, input_ids):
        x = self.emb(input_ids)
        if x.sum() > 0:
            x = 2 * x
        return self.head(x)


class Bidirectional(_Embed):
    """Every token sees the whole sequence: not a decoder."""

    def forward(self, input_ids):
        x = self.emb(input_ids)
        return self.head(x + x.mean(dim=1, keepdim=True))


def test_refused_and_not_a_decoder():
    torch.manual_seed(0)
    trees = zoo.probe_forest()
    r = zoo.compare(DataDependentBranch(), trees, tolerances=zoo.TOLERANCES["float32"])
    assert r["status"] == "refused" and r["type"] == "GraphBreakError", r
    assert r["treefx_frame"].startswith("treefx/")
    r = zoo.compare(Bidirectional(), trees, tolerances=zoo.TOLERANCES["float32"])
    assert r["status"] == "not a decoder" and r["causal_err"] > 1e-3


def test_probe_forest_has_the_odd_shapes():
    trees = zoo.probe_forest(exclude={0, 1, 2})
    assert len(trees) == 2
    seqs = [tuple(t.sequence(i)) for t in trees for i in range(t.num_sequences)]
    assert len(set(seqs)) < len(seqs)  # a duplicate
    assert any(a != b and b[:len(a)] == a for a in seqs for b in seqs)  # a prefix
    assert any(len(s) == 1 for s in seqs)
    assert 17 <= max(map(len, seqs)) <= 24  # crosses windows (5) and chunks (8)
    assert all(tok >= 3 for s in seqs for tok in s)  # special ids left out


def test_tiny_configs_keep_one_layer_of_each_kind():
    cfg = zoo.tiny_config("gemma2")
    assert cfg.num_hidden_layers == 2 and set(cfg.layer_types) == {"sliding_attention",
                                                                   "full_attention"}
    assert cfg.sliding_window == zoo.WINDOW and cfg.hidden_size == zoo.HIDDEN
    cfg = zoo.tiny_config("qwen3_next")
    assert set(cfg.layer_types) == {"linear_attention", "full_attention"}
    cfg = zoo.tiny_config("deepseek_v3")  # first_k_dense_replace: one dense, one MoE layer
    assert (cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.n_routed_experts) == (2, 1, 4)
    cfg = zoo.tiny_config("gpt2")  # aliases without attribute_map entries; dropout off
    assert (cfg.n_embd, cfg.n_layer, cfg.vocab_size) == (zoo.HIDDEN, 2, zoo.VOCAB)
    assert cfg.attn_pdrop == cfg.resid_pdrop == cfg.embd_pdrop == 0.0


def _row(mt, status, detail=""):
    return {"model_type": mt, "status": status, "detail": detail, "seconds": 1.0}


def test_markdown_header_and_sections(tmp_path):
    results = [_row("qwen3", "exact"), _row("odd|model", "WRONG", "float32: log-prob err 1e-2"),
               _row("gemma2", "refused", "UnmatchedAttentionError: ...")]
    md = zoo.markdown_section(results, command="python -m treefx.zoo --models qwen3",
                              date="2026-01-02", dtype="float32", checkpointing=False,
                              revision="abc1234")
    assert f"torch {torch.__version__}, transformers {transformers.__version__}" in md
    assert "2026-01-02" in md and "`python -m treefx.zoo --models qwen3`" in md
    assert "abc1234" in md and "log-prob abs 0.0001" in md
    assert "counts: exact 1, WRONG 1, refused 1 (of 3)" in md
    assert "| odd\\|model | WRONG |" in md  # a | in a cell is escaped
    path = tmp_path / "zoo.md"
    zoo.write_markdown(path, md, checkpointing=False)
    ck = zoo.markdown_section(results[:1], command="c", date="d", dtype="float32",
                              checkpointing=True)
    zoo.write_markdown(path, ck, checkpointing=True)
    zoo.write_markdown(path, md.replace("2026-01-02", "2026-01-03"), checkpointing=False)
    text = path.read_text()
    assert text.startswith("# treefx zoo")
    assert "2026-01-03" in text and "2026-01-02" not in text  # replaced, not appended
    assert text.index("## All causal-LM") < text.index("## Gradient checkpointing")
    assert text.count("<!-- zoo:default -->") == text.count("<!-- zoo:checkpointing -->") == 1
