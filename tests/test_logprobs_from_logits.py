"""The log-probabilities a default compiled model reads from its logits
(:mod:`treefx.ops.logprobs.from_logits`): outside the compiled graph, so a loss on them alone
sends the logits output no gradient, and a loss on both sums the two; the Triton kernels run
on the GPU, checked here under Triton's interpreter and compiled for sm_90 where Triton is
installed (the CPU build of torch comes without it)."""

from __future__ import annotations

import os

import pytest
import torch
from support import VOCAB, hf_model, run_under_tritons_interpreter
from trees import odd_forest

import treefx
from treefx.ops.logprobs import from_logits, tree_logprobs_from_logits

transformers = pytest.importorskip("transformers")


def _row_logits_oracle(model, trees, batch) -> torch.Tensor:
    """[N, V]: each DFS row token's logits from the unmodified model on a sequence holding it
    (every sequence through that token gives the same ones)."""
    rows = [None] * batch.num_tokens
    seqs = [t.sequence(j) for t in trees for j in range(t.num_sequences)]
    for i, seq in enumerate(seqs):
        logits = model(torch.as_tensor(seq)[None]).logits[0]
        for j, t in enumerate(batch.sequence_index(i).tolist()):
            if rows[t] is None:
                rows[t] = logits[j]
    return torch.stack(rows)


def test_a_loss_on_logits_and_logprobs_gets_both_gradients():
    """A loss reading the log-probabilities (the tree loss) and the logits (an arbitrary
    linear term): values and every parameter's gradient equal the unmodified model run on
    each sequence alone; with the log-probabilities alone, the gradients equal the oracle's
    tree loss (the logits output then gets no gradient)."""
    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, verify=False)
    trees = odd_forest(23, VOCAB)
    batch = treefx.pack(trees)
    r = torch.randn(batch.num_tokens, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [p for p in model.parameters() if p.requires_grad]

    out = tm(batch)
    lp_loss = treefx.tree_loss(out, batch)
    got_lp = torch.autograd.grad(lp_loss, params, retain_graph=True)
    got = torch.autograd.grad(lp_loss + (out.logits[0] * r).sum() * 1e-3, params)

    ref_lp_loss = treefx.reference.sequence_loss(model, trees)
    ref_lp = torch.autograd.grad(ref_lp_loss, params)
    ref = torch.autograd.grad(
        treefx.reference.sequence_loss(model, trees)
        + (_row_logits_oracle(model, trees, batch) * r).sum() * 1e-3, params)
    torch.testing.assert_close(lp_loss, ref_lp_loss, atol=1e-5, rtol=1e-5)
    for a, b in [*zip(got_lp, ref_lp), *zip(got, ref)]:
        assert (a - b).norm() <= 1e-4 * b.norm().clamp_min(1e-12)
    assert any((a - b).norm() > 1e-3 * b.norm() for a, b in zip(got, got_lp))  # both count


def test_the_compiled_graph_returns_the_logits_not_their_log_softmax():
    """The log-probabilities are read outside the graph: no log-sum-exp over the vocabulary
    in it (whose backward, for an unused logits output, read a zero-filled [N, V] gradient);
    its outputs are the logits and a view of the tree input (its anchor)."""
    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, verify=False)
    batch = treefx.pack(odd_forest(5, VOCAB))
    out = tm(batch)
    assert out.logits.shape == (1, batch.num_tokens, VOCAB)
    nodes = [n for ctx in tm.contexts for scope in ctx.scopes() for n in scope.graph.nodes]
    assert not [n for n in nodes if "logsumexp" in str(n.target) or "log_softmax" in
                str(n.target)]


def test_off_the_gpu_the_log_softmax_of_each_tokens_row():
    """On the CPU (the plain form): each token's log-probability is the log-softmax of its
    predecessor's row at its label, summed into a row read by several tokens in the gradient;
    0 and no gradient without a predecessor."""
    logits = torch.randn(1, 9, 17, dtype=torch.float64, requires_grad=True)
    parent = torch.tensor([-1, 0, 1, 1, 3, -1, 5, 5, 0])  # rows 0, 1 and 5 read twice
    ids = torch.randint(0, 17, (1, 9), generator=torch.Generator().manual_seed(0))
    assert not from_logits.available(logits)
    got = tree_logprobs_from_logits(logits, ids, parent)
    want = torch.stack([torch.log_softmax(logits[0, p], -1)[y] if p >= 0 else
                        logits.new_zeros(()) for p, y in zip(parent.tolist(), ids[0].tolist())])
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    up = torch.randn(9, dtype=torch.float64)
    g_got, = torch.autograd.grad((got * up).sum(), logits)
    g_want, = torch.autograd.grad((want * up).sum(), logits)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-12)
    assert torch.all(g_got[0, [2, 4, 6, 7, 8]] == 0)  # rows no token reads


@pytest.mark.parametrize("ids_len, parent_len", [(8, 9), (9, 10)])
def test_rows_and_tokens_must_agree(ids_len, parent_len):
    logits = torch.randn(1, 9, 17)
    with pytest.raises(ValueError, match="one per token"):
        tree_logprobs_from_logits(logits, torch.zeros(1, ids_len, dtype=torch.long),
                                  torch.full((parent_len,), -1))


def _triton():
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("under the interpreter already")
    return triton


def test_the_kernels_equal_the_plain_form_under_tritons_interpreter():
    """``benchmarks.logprobs --check-from-logits``: both kernels against the float64 plain
    form (forests with branching rows, duplicated labels on a row, a row of -inf but one
    entry, a vocabulary not a multiple of the block; float32 and bf16), and the gradient of
    rows each read by one token with labels inside and outside the row (the fused
    log-probabilities' slices)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("under the interpreter already")
    out = run_under_tritons_interpreter("benchmarks.logprobs", "--check-from-logits")
    assert "3 of 3 cases ok" in out, out


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_kernels_compile_for_hopper(dtype):
    """Triton's compiler for sm_90 (no GPU needed): code generation and type checks."""
    triton = _triton()
    from triton.backends.compiler import GPUTarget

    def compile_(kernel, config, types):
        block, warps = config
        src = triton.compiler.ASTSource(
            fn=kernel, signature={**types, "BLOCK": "constexpr"},
            constexprs={(kernel.arg_names.index("BLOCK"),): block})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps))

    row = "*" + dtype
    assert compile_(from_logits._lse_kernel, from_logits.LSE_CONFIG, {
        "logits": row, "stride": "i64", "n_vocab": "i32", "lse": "*fp32"}).asm["ptx"]
    assert compile_(from_logits._grad_kernel, from_logits.GRAD_CONFIG, {
        "logits": row, "stride": "i64", "n_vocab": "i32", "lse": "*fp32",
        "child_start": "*i64", "child_end": "*i64", "child_tok": "*i64", "ids": "*i64",
        "g": "*fp32", "out": row, "out_stride": "i64"}).asm["ptx"]
