"""Hybrid models: causal conv1d and recurrent state routed through the tree, against the
per-branch oracle (eager backend, CPU)."""

from __future__ import annotations

import copy
import functools
import itertools
import sys

import pytest
import torch
import torch.nn.functional as F
from support import VOCAB, check_against_oracle, grads
from trees import check_forward, odd_forest, odd_tree

import treefx
from treefx.compiler.recurrences import recurrence
from treefx.ops.conv import tree_causal_conv1d
from treefx.ops.recurrence import tree_nodes, tree_recurrence

transformers = pytest.importorskip("transformers")

# Single-token nodes, nodes shorter than the conv kernel, a prefix sequence, a forest.
SHORT_NODES = treefx.Tree.from_sequences(
    [[1, 2], [1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 6, 7, 8, 9], [1, 2, 4, 6, 7, 8, 10], [11]]
)


def per_sequence(batch, fn):
    """fn applied to each sequence's tokens alone, scattered back per sequence index."""
    return [(batch.sequence_index(i), fn(batch.sequence_index(i)))
            for i in range(batch.num_sequences)]


def _conv_inputs(batch, k: int, c: int = 5):
    """A generator seeded by ``k`` and float64 leaves for a width-``k`` conv over ``batch``:
    input [2, c, N], weight [c, 1, k], bias [c] (the generator goes on to draw probes)."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(2, c, batch.num_tokens, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(c, 1, k, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(c, dtype=torch.float64, generator=g, requires_grad=True)
    return g, (x, w, b)


@pytest.mark.parametrize("k", [2, 4, 6])
@pytest.mark.parametrize("trees", [[SHORT_NODES], odd_forest(30, VOCAB)], ids=["short", "forest"])
def test_tree_conv1d_matches_each_sequence_alone(k, trees):
    batch = treefx.pack(trees)
    g, (x, w, b) = _conv_inputs(batch, k)
    c = x.shape[1]
    out = tree_causal_conv1d(x, w, b, batch.parent_token)
    probe = torch.randn(out.shape, dtype=torch.float64, generator=g)
    grads_tree = torch.autograd.grad((out * probe).sum(), (x, w, b))
    total = 0
    for idx, ref in per_sequence(batch, lambda idx: F.conv1d(
            x[:, :, idx], w, b, padding=k - 1, groups=c)[..., :len(idx)]):
        torch.testing.assert_close(out[:, :, idx], ref, atol=1e-12, rtol=0)
        # Each token's output counts once however many sequences run through it.
        total = total + (ref * probe[:, :, idx] / _multiplicity(batch)[idx]).sum()
    for a, r in zip(grads_tree, torch.autograd.grad(total, (x, w, b))):
        torch.testing.assert_close(a, r, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("k", [2, 4, 6])
@pytest.mark.parametrize("trees", [[SHORT_NODES], odd_forest(33, VOCAB)], ids=["short", "forest"])
def test_fast_tree_conv1d_is_the_reference(k, trees):
    """The traced graphs' conv (the row's conv, then the boundary tokens recomputed by a custom
    op whose backward recomputes them) against the gather over every token: values and the
    gradients of input, weight and bias, float64, eagerly and traced by AOTAutograd. Only
    tokens near a node start are recomputed."""
    from treefx.ops.conv import boundary_taps, tree_causal_conv1d_fast
    from treefx.ops.recurrence import tree_nodes

    batch = treefx.pack(trees)
    g, (x, w, b) = _conv_inputs(batch, k)
    probe = torch.randn(x.shape, dtype=torch.float64, generator=g)
    ref = tree_causal_conv1d(x, w, b, batch.parent_token)
    grads_ref = torch.autograd.grad((ref * probe).sum(), (x, w, b))
    for bias in (b, None):
        got = tree_causal_conv1d_fast(x, w, bias, batch.parent_token)
        want = ref if bias is not None else ref - b.detach()[None, :, None]
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    traced = torch.compile(tree_causal_conv1d_fast, backend="aot_eager", fullgraph=True,
                           dynamic=True)
    for fn in (tree_causal_conv1d_fast, traced):
        got = fn(x, w, b, batch.parent_token)
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
        for a, r in zip(torch.autograd.grad((got * probe).sum(), (x, w, b)), grads_ref):
            torch.testing.assert_close(a, r, atol=1e-12, rtol=1e-12)
    pos, taps = boundary_taps(batch.parent_token.numpy(), k)
    starts, lengths, _, _ = tree_nodes(batch.parent_token)
    assert 0 < len(pos) <= (k - 1) * len(starts) and taps.shape == (k, len(pos))


def test_the_conv_after_inference_mode_trains_on_the_same_row():
    """Log-probabilities under torch.inference_mode(), then a training step on the same row:
    the boundary taps cached for the row must not be inference tensors (autograd saves the
    index)."""
    from treefx.ops.conv import tree_causal_conv1d_fast

    batch = treefx.pack([SHORT_NODES])
    g, (x, w, b) = _conv_inputs(batch, 4)
    with torch.inference_mode():
        tree_causal_conv1d_fast(x.detach(), w.detach(), b.detach(), batch.parent_token)
    out = tree_causal_conv1d_fast(x, w, b, batch.parent_token)
    grads = torch.autograd.grad(out.sum(), (x, w, b))
    ref = tree_causal_conv1d(x, w, b, batch.parent_token)
    for a, r in zip(grads, torch.autograd.grad(ref.sum(), (x, w, b))):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=1e-12)


def _multiplicity(batch) -> torch.Tensor:
    """How many sequences run through each token."""
    m = torch.zeros(batch.num_tokens, dtype=torch.float64)
    for i in range(batch.num_sequences):
        m[batch.sequence_index(i)] += 1
    return m


def test_tree_nodes_splits_at_branches():
    batch = treefx.pack(treefx.Tree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8]]))
    starts, lengths, parents, depth = tree_nodes(batch.parent_token)
    # the larger child first (treefx.pack lays a node's children largest subtree first)
    assert (starts, lengths, parents, depth) == ((0, 3, 6), (3, 3, 2), (-1, 0, 0), (0, 1, 1))


def test_tree_nodes_reuses_an_unchanged_row_only(monkeypatch):
    """One host copy per row: the same unchanged row (or a view of it) is not copied again;
    a changed row, another row with other values, or one at another place is."""
    import treefx.ops.host_row as hmod

    copies = []
    copy = hmod.host_row
    monkeypatch.setattr(hmod, "host_row", lambda t: copies.append(1) or copy(t))
    info = torch.stack([torch.zeros(8, dtype=torch.long),
                        torch.tensor([-1, 0, 1, 2, 1, 4, -1, 6]),
                        torch.zeros(8, dtype=torch.long)])
    row = info[1]
    first = tree_nodes(row)
    assert first == ((0, 2, 4, 6), (2, 2, 2, 2), (-1, 0, 0, -1), (0, 1, 1, 0))
    assert tree_nodes(row) == first and tree_nodes(info[1]) == first and len(copies) == 1
    info[1, 7] = -1  # in place, through the base: token 7 becomes a root of its own
    changed = tree_nodes(row)
    assert len(copies) == 2
    assert changed == ((0, 2, 4, 6, 7), (2, 2, 2, 1, 1), (-1, 0, 0, -1, -1), (0, 1, 1, 0, 0))
    assert changed == tree_nodes(torch.tensor([-1, 0, 1, 2, 1, 4, -1, -1]))  # other storage
    assert len(copies) == 3
    clone = row.clone()
    assert tree_nodes(clone) == changed and len(copies) == 4


def test_a_row_moved_from_the_host_is_not_copied_back(monkeypatch):
    """A row ``TreeBatch.to`` moved from the host keeps its host copy: the ops' first read of
    the structure takes it (no copy back, which waits for the device's queue); the same row
    changed in place, or a copy of it elsewhere, is copied as before."""
    import treefx.layout as layout
    import treefx.ops.host_row as hmod

    copies = []
    copy = hmod.host_row
    monkeypatch.setattr(hmod, "host_row", lambda t: copies.append(1) or copy(t))
    monkeypatch.setattr(layout, "_HOST_ROWS", type(layout._HOST_ROWS)())
    batch = treefx.pack(treefx.Tree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8]]))
    # what TreeBatch.to does after a move from the host (CPU-only here: the "device" row is
    # another CPU tensor)
    moved = batch.parent_token.clone()
    layout.remember_host_row(moved, batch.parent_token)
    assert tree_nodes(moved) == ((0, 3, 6), (3, 3, 2), (-1, 0, 0), (0, 1, 1))
    assert tree_nodes(moved[None][0]) == tree_nodes(moved) and copies == []
    moved[7] = 6  # in place: the kept copy no longer names this row's contents
    assert tree_nodes(moved) == ((0, 3, 6), (3, 3, 2), (-1, 0, 0), (0, 1, 1))
    assert copies == [1]
    assert layout.known_host_row(moved.clone()) is None
    for _ in range(layout._HOST_ROWS_KEPT + 1):  # a few rows kept, the oldest dropped
        layout.remember_host_row(torch.zeros(3, dtype=torch.long), torch.zeros(3))
    assert len(layout._HOST_ROWS) == layout._HOST_ROWS_KEPT


def test_a_compiled_hybrid_reads_a_moved_row_without_copying_it_back(monkeypatch):
    """Through the traced graph the ops get a row of the engine's stacked graph input, not
    the batch's own: that input takes the batch row's host copy along, so a Qwen3-Next step
    (its conv and recurrence reading the structure on the host) copies no row back. Without
    the kept copy each call copies once."""
    import treefx.layout as layout
    import treefx.ops.host_row as hmod

    cfg = _gdn_config("qwen3_next")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tm = treefx.compile(model, backend="aot-eager", verify=False)
    batch = treefx.pack([SHORT_NODES], reduction="mean")
    copies = []
    copy = hmod.host_row
    monkeypatch.setattr(hmod, "host_row", lambda t: copies.append(1) or copy(t))
    monkeypatch.setattr(layout, "_HOST_ROWS", type(layout._HOST_ROWS)())
    model.zero_grad(set_to_none=True)
    treefx.reference.sequence_loss(model, [SHORT_NODES], reduction="mean").backward()
    oracle = grads(model)
    for kept in (False, True):
        if kept:  # as TreeBatch.to keeps it after a move from the host
            layout.remember_host_row(batch.parent_token, batch.parent_token)
        copies.clear()
        for _ in range(2):
            loss = treefx.tree_loss(tm(batch), batch)
            loss.backward()
            # the step on the kept copy is the per-sequence oracle's, values and gradients
            torch.testing.assert_close(
                loss, treefx.reference.sequence_loss(model, [SHORT_NODES], reduction="mean"),
                atol=1e-5, rtol=1e-5)
            got = grads(model)
            assert got.keys() == oracle.keys()
            for name, g in got.items():
                torch.testing.assert_close(g, oracle[name], atol=1e-4, rtol=1e-4, msg=name)
        assert len(copies) == (0 if kept else 2)


@pytest.mark.parametrize("trees", [[SHORT_NODES], odd_forest(31, VOCAB)], ids=["short", "forest"])
def test_tree_gated_delta_rule_matches_each_sequence_alone(trees):
    """Values and the gradients of every input: siblings share their parent's final state,
    and autograd must sum their gradients into it."""
    rec = recurrence("qwen3_next_gated_delta_rule")
    batch = treefx.pack(trees)
    n, heads, dim = batch.num_tokens, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, heads, dim, dtype=torch.float64, generator=g).requires_grad_()
               for _ in range(3))
    decay = (-torch.rand(1, n, heads, dtype=torch.float64, generator=g)).requires_grad_()
    beta = torch.rand(1, n, heads, dtype=torch.float64, generator=g).requires_grad_()
    inputs = (q, k, v, decay, beta)
    kw = dict(use_qk_l2norm_in_kernel=True)
    out, state = tree_recurrence(rec, batch.parent_token, (q, k, v),
                                 dict(g=decay, beta=beta, output_final_state=False, **kw))
    assert state is None
    probe = torch.randn(out.shape, dtype=torch.float64, generator=g)
    grads_tree = torch.autograd.grad((out * probe).sum(), inputs)
    mult = _multiplicity(batch)
    total = 0
    for i in range(batch.num_sequences):
        idx = batch.sequence_index(i)
        ref, _ = rec.fn(q[:, idx], k[:, idx], v[:, idx], g=decay[:, idx], beta=beta[:, idx], **kw)
        # The torch kernel computes in float32 whatever its inputs.
        torch.testing.assert_close(out[:, idx], ref, atol=1e-5, rtol=1e-5)
        total = total + (ref * probe[:, idx] / mult[idx, None, None]).sum()
    for a, r in zip(grads_tree, torch.autograd.grad(total, inputs)):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)


def _gdn_config(model_type: str):
    extra = dict(num_experts=0, mlp_only_layers=[0, 1, 2, 3]) if model_type == "qwen3_next" \
        else {}
    return transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2,
        **extra)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_hf_gated_deltanet_hybrids_match_oracle(model_type):
    cfg = _gdn_config(model_type)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, [SHORT_NODES, odd_tree(32, VOCAB)])
    notes = sorted(r.note for r in tm.contexts[0].log if r.pass_name == "ssm")
    assert notes[:2] == ["causal conv1d"] * 2
    assert all("gated_delta_rule" in n for n in notes[2:]) and len(notes) == 4


# Qwen3.5 runs the same Hugging Face kernel as Qwen3-Next: -m slow (38 s of CI).
@pytest.mark.parametrize("model_type", [
    "qwen3_next", pytest.param("qwen3_5_text", marks=pytest.mark.slow), "olmo_hybrid"])
def test_traced_gated_deltanet_trains_on_its_first_call(model_type):
    """Through AOTAutograd (the traced graph Inductor compiles), the recurrence op keeps its
    forward's graph for the backward. Its first call runs below ADInplaceOrView as well as
    below autograd: Hugging Face's torch Gated DeltaNet writes its output into slices of a
    buffer, and without ADInplaceOrView re-admitted that output had no history, so every
    gradient behind the layer (its projections, conv, A_log) came back zero while the loss
    was right. Checked on the first call, against the per-sequence oracle."""
    if model_type == "olmo_hybrid":  # the kernel copied into another model's module
        from treefx.tools.zoo import build_model

        model = build_model(model_type)
        trees = [SHORT_NODES, odd_tree(33, 128)]
    else:
        cfg = _gdn_config(model_type)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        trees = [SHORT_NODES, odd_tree(32, VOCAB)]
    tm = treefx.compile(model, backend="aot-eager", verify=False)
    check_against_oracle(tm, trees)


def test_no_matrix_product_reads_rows_of_tokens(monkeypatch):
    """The traced graph of a Qwen3.5 hybrid (its conv on Hugging Face's [B, C, N] layout) has
    no matrix product whose operand is laid out with the tokens as its rows' length: where N
    is odd (most trees) cuBLAS runs such a product in its unaligned kernels (52 ms of a 274 ms
    step on an H100, 2026-11-27). The tree conv computes with the tokens first for that; this
    reads every mm of the forward and backward graphs AOTAutograd traces."""
    from treefx.run import backends

    graphs = []
    real = backends._as_is

    def recording(gm, example_inputs):
        graphs.append(gm)
        return real(gm, example_inputs)

    monkeypatch.setattr(backends, "_as_is", recording)
    cfg = _gdn_config("qwen3_5_text")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tm = treefx.compile(model, backend="aot-eager", regional=False, verify=False)
    batch = treefx.pack(odd_forest(3, VOCAB))
    assert batch.num_tokens % 2
    treefx.tree_loss(tm(batch), batch).backward()
    products = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten.bmm.default}
    seen, rows_of_tokens = 0, []
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target not in products:
                continue
            seen += 1
            for a in n.all_input_nodes:
                v = a.meta.get("val")
                # a matrix's rows: one of its last two dims, of more than one element,
                # strided by the token count (a batch's stride or a single row is no matrix
                # cuBLAS reads by that leading dimension: RoPE's [3, 1, N] positions)
                if isinstance(v, torch.Tensor) and v.dim() >= 2 and any(
                        isinstance(st, torch.SymInt) and st.node.hint == batch.num_tokens
                        and v.shape[d] != 1
                        for d, st in zip(range(v.dim() - 2, v.dim()), v.stride()[-2:])):
                    rows_of_tokens.append((n.name, tuple(v.shape), tuple(v.stride())))
    assert seen > 20  # forward and backward of every projection
    assert not rows_of_tokens, rows_of_tokens


@pytest.mark.parametrize("model_type", ["olmo_hybrid",
                                        pytest.param("qwen3_5_moe_text", marks=pytest.mark.slow)])
def test_a_kernel_copied_into_a_new_model_is_recognised(model_type):
    """Hugging Face copies the Gated DeltaNet kernel into each new hybrid's own module; treefx
    recognises it there by name and signature (treefx.compiler.recurrences.discover), without
    a list of models, and the model is exact."""
    from treefx.tools.zoo import build_model

    model = build_model(model_type)
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, [SHORT_NODES, odd_tree(33, 128)])
    notes = {r.note for r in tm.contexts[0].log if r.pass_name == "ssm"}
    owner = model_type.removesuffix("_text")
    assert any(f"{owner}_gated_delta_rule" in n for n in notes), notes


@pytest.mark.parametrize("model_type", [
    pytest.param("kimi_linear", marks=pytest.mark.slow),
    pytest.param("bailing_hybrid", marks=pytest.mark.slow)])
def test_kimi_delta_attention_is_a_tree_recurrence(model_type):
    """Kimi Delta Attention (a decay per key channel; Kimi-Linear, Bailing-hybrid) in Gated
    DeltaNet's signature: recognised by name wherever the model defines it, each node's state
    from its parent's, exact."""
    from treefx.tools.zoo import build_model

    model = build_model(model_type)
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, [SHORT_NODES, odd_tree(34, 128)])
    notes = {r.note for c in tm.contexts for r in c.log if r.pass_name == "ssm"}
    assert any(f"{model_type}_kimi_delta_attention" in n for n in notes), notes


class CumsumLinearAttention(torch.nn.Module):
    """A linear attention written with a cumulative op over the tokens: a cumsum is a sum
    along each path on the tree (exact); other cumulative ops are unregistered state."""

    def __init__(self, op=torch.cumsum):
        super().__init__()
        self.op = op
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.kv = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids):
        k, v = self.kv(self.emb(input_ids)).chunk(2, dim=-1)
        state = self.op(torch.sigmoid(k) * v, dim=1)
        return self.head(state)


def test_cumsum_along_the_tokens_is_a_sum_along_each_path():
    torch.manual_seed(0)
    tm = treefx.compile(CumsumLinearAttention(), backend="eager")
    check_against_oracle(tm, [SHORT_NODES, odd_tree(34, VOCAB)])
    (rewrite,) = [r for r in tm.contexts[0].log if r.pass_name == "ssm"]
    assert rewrite.note == "cumulative sum along each path"


class ChunkedScan(torch.nn.Module):
    """Cuts the tokens into chunks (as chunked recurrences do)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        n = x.shape[1]
        x = F.pad(x, (0, 0, 0, (-n) % 4))
        chunks = x.reshape(1, -1, 4, 8)
        mixed = chunks.mean(dim=2, keepdim=True).expand_as(chunks).reshape(1, -1, 8)[:, :n]
        return self.head(mixed)


@pytest.mark.parametrize("model, message", [
    (CumsumLinearAttention(torch.cumprod), "a cumulative op runs along the tokens"),
    (ChunkedScan(), "a token axis of size .* from the N tokens"),
])
def test_unrouted_state_names_node_and_module(model, message):
    tm = treefx.compile(model, backend="eager")
    with pytest.raises(treefx.UnmatchedStateError, match=message):
        tm(treefx.pack(odd_tree(33, VOCAB)))


def test_conv_that_is_not_causal_is_refused():
    class CenteredConv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 8)
            self.conv = torch.nn.Conv1d(8, 8, 3, padding=1, groups=8)
            self.head = torch.nn.Linear(8, VOCAB)

        def forward(self, input_ids):
            return self.head(self.conv(self.emb(input_ids).transpose(1, 2)).transpose(1, 2))

    tm = treefx.compile(CenteredConv(), backend="eager")
    with pytest.raises(treefx.UnmatchedStateError, match="padding .*not the causal K-1 = 2"):
        tm(treefx.pack(odd_tree(34, VOCAB)))


def test_hf_mamba2_matches_oracle():
    """Mamba2's chunked scan (its torch fallback, padded per depth with a step dt = -inf
    that leaves the state alone) and its causal conv1d, through the tree."""
    cfg = transformers.AutoConfig.for_model(
        "mamba2", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8,
        head_dim=8, state_size=16, n_groups=2, expand=2, conv_kernel=4, chunk_size=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, [SHORT_NODES, odd_tree(35, VOCAB)])
    notes = sorted(r.note for r in tm.contexts[0].log if r.pass_name == "ssm")
    assert notes == ["causal conv1d"] * 2 + ["recurrence mamba2_mamba2_chunk_scan"] * 2


def test_mamba2_with_a_step_floor_is_exact():
    """Nemotron-H clamps the step dt to [time_step_min, ...] inside its scan kernel: the
    padding's step of 0 becomes a real step and would decay the state handed to children.
    treefx measures that the padding is not neutral and runs each depth's nodes in groups of
    equal length instead (Gated DeltaNet's padding stays neutral, and padded)."""
    from treefx.ops.recurrence.reference import _NEUTRAL

    cfg = transformers.AutoConfig.for_model(
        "nemotron_h", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, mamba_num_heads=4,
        mamba_head_dim=8, ssm_state_size=8, n_groups=1, layers_block_type=["mamba", "attention"],
        time_step_min=0.01, initializer_range=0.2, mamba_chunk_size=8,
        # the floor: time_step_min's up to transformers 5.24, time_step_limit's from 5.25
        time_step_limit=(0.01, float("inf")))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, [SHORT_NODES, odd_tree(36, VOCAB)])
    verdicts = {k[0]: v for k, v in _NEUTRAL.items()}
    assert verdicts["nemotron_h_mamba2_chunk_scan"] is False


def test_gated_deltanet_padding_is_neutral():
    from treefx.ops.recurrence import padding_is_neutral

    rec = recurrence("qwen3_next_gated_delta_rule")
    g = torch.Generator().manual_seed(0)
    b, t, h, d = 1, 5, 2, 8
    seq = {"query": torch.randn(b, t, h, d, generator=g), "key": torch.randn(b, t, h, d, generator=g),
           "value": torch.randn(b, t, h, d, generator=g),
           "g": -torch.rand(b, t, h, generator=g), "beta": torch.rand(b, t, h, generator=g)}
    assert padding_is_neutral(rec, seq, {"use_qk_l2norm_in_kernel": True})


@pytest.mark.parametrize("layer_types", [("gdn", "attention"), ("attention", "gdn", "gdn")])
def test_pure_torch_hybrid_matches_oracle(layer_types):
    from treefx.models import tiny_hybrid

    torch.manual_seed(0)
    model = tiny_hybrid(layer_types, vocab_size=VOCAB)
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, [SHORT_NODES, odd_tree(36, VOCAB)])
    notes = [r.note for r in tm.contexts[0].log if r.pass_name == "ssm"]
    n_gdn = layer_types.count("gdn")
    assert sorted(notes) == ["causal conv1d"] * n_gdn + [
        "recurrence treefx_models_gated_delta_rule"] * n_gdn


def test_hf_bamba_mamba2_hybrid_matches_oracle():
    """A Mamba2 + attention hybrid (Bamba): its own copy of the chunked scan is registered."""
    cfg = transformers.AutoConfig.for_model(
        "bamba", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8,
        mamba_d_state=16, mamba_n_groups=2, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=8,
        attn_layer_indices=[1])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tm = treefx.compile(model, backend="eager")
    if not hasattr(sys.modules[type(model).__module__], "mamba2_chunk_scan"):  # before 5.15
        with pytest.raises(treefx.TreeCompileError, match=r"Mamba2 mixer at .* under "
                           rf"transformers {transformers.__version__}: before 5\.15"):
            tm(treefx.pack([SHORT_NODES]))
        return
    check_against_oracle(tm, [SHORT_NODES, odd_tree(37, VOCAB)])
    log = tm.contexts[0].log
    assert sorted(r.note for r in log if r.pass_name == "ssm") == [
        "causal conv1d", "recurrence bamba_mamba2_chunk_scan"]
    assert [r.module for r in log if r.pass_name == "attention"] == ["model.layers.1.self_attn"]


def test_traced_recurrence_matches_oracle():
    """The inductor backend's form of a recurrence: one opaque custom op, traced by
    AOTAutograd, its backward recomputing the forward through torch.func.vjp. Checked on the
    CPU by tracing with AOTAutograd and running the traced graphs eagerly (values and
    gradients, both reductions); a model without attention, as FlexAttention has no CPU
    backward."""
    from treefx.models import tiny_hybrid

    torch.manual_seed(0)
    model = tiny_hybrid(("gdn", "gdn"), vocab_size=VOCAB)
    tm = treefx.compile(model, backend="aot-eager")
    check_against_oracle(tm, [SHORT_NODES, odd_tree(38, VOCAB)])
    ops = [r.after for r in tm.contexts[0].log if "recurrence" in r.note]
    assert len(ops) == 2 and all("tree_recurrence_op_" in op for op in ops)


class _Checkpointed(torch.nn.Module):
    """A layer run under a non-reentrant ``torch.utils.checkpoint`` (user code)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.layer, *args, use_reentrant=False)


@pytest.mark.parametrize("keep", ["1", "0"], ids=["kept", "recomputed"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_recurrence_backward_matches_oracle(monkeypatch, checkpointed, keep):
    """The traced recurrence's backward on the forward's kept graph (the default) or on a
    recomputed forward (``TREEFX_KEEP_RECURRENCE_GRAPH=0``): values and gradients against the
    oracle, every backward on the path asked for (under checkpointing the forward runs again
    in the backward, and that run's graph is the one used)."""
    from treefx.models import tiny_hybrid
    from treefx.ops.recurrence import backward_paths

    monkeypatch.setenv("TREEFX_KEEP_RECURRENCE_GRAPH", keep)
    torch.manual_seed(0)
    model = tiny_hybrid(("gdn", "gdn"), vocab_size=VOCAB)
    if checkpointed:
        model.layers = torch.nn.ModuleList(_Checkpointed(layer) for layer in model.layers)
    tm = treefx.compile(model, backend="aot-eager")
    before = backward_paths()
    check_against_oracle(tm, [SHORT_NODES, odd_tree(38, VOCAB)])
    after = backward_paths()
    used, unused = ("kept", "recomputed") if keep == "1" else ("recomputed", "kept")
    assert after[used] > before[used] and after[unused] == before[unused]
    ops = [r.after for r in tm.contexts[0].log if "recurrence" in r.note]
    assert len(ops) == 2 and all(("_kept(" in op) == (keep == "1") for op in ops)


class _Sine(torch.autograd.Function):
    """A kernel made as fla's are: a Python autograd.Function whose output leaves the op."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


def test_kept_graph_of_an_output_made_by_a_python_function():
    """The kept graph of an output made by a Python autograd.Function (fla's kernels, the
    one-pass tree) must hold that Function's node: on torch 2.11 a gradient edge on such a
    node holds it weakly, so once the op hands its output out and drops it, the node is gone
    (its backward failed on the H100). The edge kept is a C++ node's (a view's, which holds
    the Function's node, made where autograd records inside the op's body); the gradient is
    the Function's own, after the output was dropped."""
    import gc

    from treefx.ops.recurrence import traced

    x = torch.randn(7, dtype=torch.float64)
    grad = torch.randn(7, dtype=torch.float64)

    def run(xs):
        return [_Sine.apply(xs[0] * 3.0)]

    with torch._C._AutoDispatchBelowAutograd():  # where a custom op's body runs
        outs, handle, owned = traced.run_keeping(run, [x])
    (edge, _), = handle._treefx_kept[0]
    assert not isinstance(edge.node, torch.autograd.function.BackwardCFunction)
    assert isinstance(edge.node.next_functions[0][0], torch.autograd.function.BackwardCFunction)
    del outs
    gc.collect()
    (got,) = traced.kept_grads(handle, run, owned, [grad])
    torch.testing.assert_close(got, grad * 3.0 * torch.cos(3.0 * x), rtol=1e-12, atol=0)


@pytest.mark.slow
def test_kept_recurrence_graph_through_inductor_equals_the_recomputed(monkeypatch):
    """Through Inductor's generated code (on the CPU: its buffer reuse and in-place kernels,
    regional pieces), three steps of a tree and of a forest of separate sequences (packing's
    shape): the kept graph's losses and gradients equal the recomputed path's (float32)."""
    from treefx.models import tiny_hybrid
    from treefx.ops.recurrence import backward_paths

    monkeypatch.setenv("TREEFX_INDUCTOR_ON_CPU", "1")
    tree = treefx.pack([odd_tree(38, VOCAB), odd_tree(39, VOCAB)])
    forest = treefx.pack([treefx.Tree.from_sequences([s]) for seed in (40, 41)
                          for s in odd_tree(seed, VOCAB).sequences])

    def steps(keep: str):
        monkeypatch.setenv("TREEFX_KEEP_RECURRENCE_GRAPH", keep)
        torch.manual_seed(0)
        model = tiny_hybrid(("gdn", "gdn", "gdn"), vocab_size=VOCAB)
        tm = treefx.compile(model, backend="inductor", verify=False)
        got = []
        for _ in range(3):
            for b in (tree, forest):
                model.zero_grad(set_to_none=True)
                loss = treefx.tree_loss(tm(b), b)
                loss.backward()
                got.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        return got

    before = backward_paths()
    kept = steps("1")
    assert backward_paths()["kept"] - before["kept"] == 18  # 3 layers x 6 steps
    for (lk, gk), (lr, gr) in zip(kept, steps("0")):
        torch.testing.assert_close(lk, lr, rtol=1e-6, atol=0)
        for a, b in zip(gk, gr):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_keeping_the_recurrence_graph_is_the_default(monkeypatch):
    from treefx.ops.recurrence.traced import keeps_forward_graph

    monkeypatch.delenv("TREEFX_KEEP_RECURRENCE_GRAPH", raising=False)
    assert keeps_forward_graph()
    monkeypatch.setenv("TREEFX_KEEP_RECURRENCE_GRAPH", "0")
    assert not keeps_forward_graph()
    monkeypatch.setenv("TREEFX_KEEP_RECURRENCE_GRAPH", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        keeps_forward_graph()


@pytest.mark.parametrize("model_type", ["qwen3_next"])
def test_traced_hf_hybrid_forward(model_type):
    """HF Qwen3-Next through the inductor backend's graph (FlexAttention and the traced
    recurrence), traced by AOTAutograd, forward only on the CPU."""
    cfg = _gdn_config(model_type)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tm = treefx.compile(model, backend="aot-eager")
    check_forward(tm, [SHORT_NODES, odd_tree(39, VOCAB)], atol=1e-4)


def _per_node_varlen(rec):
    """A varlen form built from the padded kernel, one node at a time: checks the plumbing of
    the fast path (concatenation, offsets, per-node states, splitting) on the CPU."""
    def varlen(seq, static, init, cu, cu_cpu, final=True):
        assert cu_cpu.device.type == "cpu" and torch.equal(cu_cpu, cu.cpu())
        outs, fins = [], []
        for j in range(len(cu) - 1):
            a, b = int(cu[j]), int(cu[j + 1])
            out, fin = rec.fn(**{n: t[:, a:b] for n, t in seq.items()}, **static,
                              initial_state=None if init is None else init[j:j + 1],
                              output_final_state=final)
            outs.append(out)
            fins.append(fin)
        return torch.cat(outs, dim=1), torch.cat(fins) if final else None
    return varlen


def _in_threes(seq, static, sizes):
    """At most 3 nodes a call (as fla's grid limit splits a level of thousands of nodes)."""
    return [min(3, len(sizes) - i) for i in range(0, len(sizes), 3)]


@pytest.mark.parametrize("split", [None, _in_threes], ids=["one_call", "calls_of_three"])
@pytest.mark.parametrize("trees", [
    [SHORT_NODES], odd_forest(32, VOCAB),
    [treefx.Tree.from_sequences([s]) for s in odd_tree(33, VOCAB).sequences],
], ids=["short", "forest", "roots_alone"])
def test_varlen_path_matches_padded_path(trees, split):
    import dataclasses

    padded = recurrence("qwen3_next_gated_delta_rule")
    # varlen_check off: fla's own check (use_fla) says no on the CPU
    fast = dataclasses.replace(padded, varlen=_per_node_varlen(padded), varlen_devices=("cpu",),
                               varlen_check=None, varlen_split=split, tree_varlen=None)
    batch = treefx.pack(trees)
    n, g = batch.num_tokens, torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, n, 2, 8, dtype=torch.float64, generator=g).requires_grad_()
              for _ in range(3)]
    inputs += [(-torch.rand(1, n, 2, dtype=torch.float64, generator=g)).requires_grad_(),
               torch.rand(1, n, 2, dtype=torch.float64, generator=g).requires_grad_()]
    probe = torch.randn(1, n, 2, 8, dtype=torch.float64, generator=g)
    from treefx.ops.recurrence import kernel_runs

    results = []
    for rec, path in ((padded, "padded"), (fast, "varlen")):
        before = kernel_runs().get((rec.name, path), 0)
        out, _ = tree_recurrence(rec, batch.parent_token, inputs[:3],
                                 dict(g=inputs[3], beta=inputs[4], use_qk_l2norm_in_kernel=True))
        assert kernel_runs().get((rec.name, path), 0) == before + 1, path
        results.append((out, torch.autograd.grad((out * probe).sum(), inputs)))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _autograd_nodes(t: torch.Tensor) -> list:
    """The nodes of the autograd graph behind ``t``."""
    seen, todo = {}, [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen[fn] = None
        todo += [f for f, _ in fn.next_functions]
    return list(seen)


@pytest.mark.parametrize("fast", [False, True], ids=["padded", "varlen"])
def test_the_recomputed_backward_cuts_each_input_once(fast):
    """The traced op's backward recomputes the tree recurrence under autograd. Its inputs are
    cut into nodes by one split each (backward: one cat of the pieces' gradients), its
    per-node outputs and states taken from one split / unbind per call: a slice per node would
    give each a zero tensor the size of the whole input, all added up in the backward
    (O(nodes x tokens): 40% of Qwen3-Next's GPU step at 17k tokens)."""
    import dataclasses

    padded = recurrence("qwen3_next_gated_delta_rule")
    rec = padded if not fast else dataclasses.replace(
        padded, varlen=_per_node_varlen(padded), varlen_devices=("cpu",), varlen_check=None,
        tree_varlen=None)
    batch = treefx.pack(odd_forest(32, VOCAB))
    n, g = batch.num_tokens, torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, n, 2, 8, generator=g).requires_grad_() for _ in range(3)]
    inputs += [(-torch.rand(1, n, 2, generator=g)).requires_grad_(),
               torch.rand(1, n, 2, generator=g).requires_grad_()]
    out, _ = tree_recurrence(rec, batch.parent_token, inputs[:3],
                             dict(g=inputs[3], beta=inputs[4], use_qk_l2norm_in_kernel=True))
    nodes = _autograd_nodes(out)
    # a slice or an index of a whole input row (n tokens) makes a zero row in the backward
    whole = [type(f).__name__ for f in nodes if type(f).__name__ in (
        "SliceBackward0", "NarrowBackward0", "SelectBackward0", "IndexBackward0")
        and n in tuple(getattr(f, "_saved_self_sym_sizes", ()))]
    assert not whole, whole
    cuts = [f for f in nodes if type(f).__name__.startswith("Split")]
    assert len(cuts) >= len(inputs)


@pytest.mark.parametrize("fast", [False, True], ids=["padded", "varlen"])
def test_final_states_only_where_a_node_hands_one_on(fast):
    """A row padded with one-token roots (the first-call probe at a batch's length) or a
    forest of many leaves: final states (2 MiB each at 32 heads of 128 channels) are kept only
    for nodes with children, and a kernel call whose nodes have none is asked for none."""
    import dataclasses

    from treefx.ops.recurrence.reference import run_tree

    padded = recurrence("qwen3_next_gated_delta_rule")
    asked = []

    def counting(fn):
        @functools.wraps(fn)  # its signature (``final``) seen through the wrapper
        def run(*a, **kw):
            asked.append(kw.get("output_final_state", kw.get("final", True)))
            return fn(*a, **kw)
        return run

    rec = dataclasses.replace(padded, varlen=counting(_per_node_varlen(padded)),
                              varlen_devices=("cpu",), varlen_check=None,
                              tree_varlen=None) if fast else \
        dataclasses.replace(padded, tree_fn=counting(padded.run))
    trees = [SHORT_NODES] + [treefx.Tree.from_sequences([[5]]) for _ in range(40)]
    batch = treefx.pack(trees, pad_to_multiple=128)
    n, g = batch.num_tokens, torch.Generator().manual_seed(1)
    xs = [torch.randn(1, n, 2, 8, dtype=torch.float64, generator=g).requires_grad_()
          for _ in range(3)]
    kw = dict(g=(-torch.rand(1, n, 2, dtype=torch.float64, generator=g)).requires_grad_(),
              beta=torch.rand(1, n, 2, dtype=torch.float64, generator=g).requires_grad_())
    inputs = [*xs, kw["g"], kw["beta"]]
    probe = torch.randn(1, n, 2, 8, dtype=torch.float64, generator=g)
    row, final, (starts, lengths, parents, depth) = run_tree(rec, batch.parent_token, xs, kw)
    assert set(final) == {p for p in parents if p >= 0}
    assert len(starts) > 100 and False in asked and True in asked
    ref, _ = tree_recurrence(padded, batch.parent_token, xs, kw)
    torch.testing.assert_close(row, ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(torch.autograd.grad((row * probe).sum(), inputs),
                    torch.autograd.grad((ref * probe).sum(), inputs)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_fla_calls_stay_within_the_cuda_grid():
    """fla launches nodes x heads blocks on a grid axis of at most 65,535: a level of 3,000
    one-token roots (a row padded to a batch's length) at 32 value heads runs in two calls,
    and chunks of 64 tokens are counted too; the hybrid models' recurrences use the split."""
    from treefx.families import fla

    v = torch.empty(1, 0, 32, 128)
    assert fla.split_calls({"value": v}, {}, [1] * 3000) == [2047, 953]
    assert fla.split_calls({"value": v}, {}, [100, 5]) == [2]
    assert fla.split_calls({"value": torch.empty(1, 0, 1, 8)}, {},
                           [64 * 40_000, 64 * 30_000, 1]) == [1, 2]
    assert recurrence("qwen3_next_gated_delta_rule").varlen_split is fla.split_calls


def test_model_passing_cu_seqlens_is_refused():
    rec = recurrence("qwen3_next_gated_delta_rule")
    batch = treefx.pack([SHORT_NODES])
    x = torch.randn(1, batch.num_tokens, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        tree_recurrence(rec, batch.parent_token, (x, x, x),
                        dict(g=x[..., 0], beta=x[..., 0], cu_seqlens=torch.tensor([0, 3])))


class _DecayedSum(torch.autograd.Function):
    """h_t = a_t h_(t-1) + x_t as a classic autograd.Function (ctx in forward, its own
    backward), the style of fla's kernels."""

    @staticmethod
    def forward(ctx, x, a, h0):
        h = torch.zeros_like(x[:, 0]) if h0 is None else h0
        out = []
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            out.append(h)
        out = torch.stack(out, 1)
        ctx.h0_given = h0 is not None
        ctx.save_for_backward(a, out, h0 if h0 is not None else torch.zeros_like(x[:, 0]))
        return out, h

    @staticmethod
    def backward(ctx, g_out, g_fin):
        a, out, h0 = ctx.saved_tensors
        gh = torch.zeros_like(h0) if g_fin is None else g_fin.clone()
        gx, ga = torch.zeros_like(out), torch.zeros_like(a)
        for t in reversed(range(out.shape[1])):
            gh = gh + g_out[:, t]
            gx[:, t] = gh
            ga[:, t] = gh * (out[:, t - 1] if t > 0 else h0)
            gh = gh * a[:, t]
        return gx, ga, (gh if ctx.h0_given else None)


def decayed_sum(x, a, initial_state=None, output_final_state=False):
    out, fin = _DecayedSum.apply(x, a, initial_state)
    return out, (fin if output_final_state else None)


def _decayed_sum_site(keep: bool, kernel=None):
    from treefx.compiler.recurrences import Recurrence
    from treefx.ops.recurrence import TracedTreeRecurrence, register_site

    fn = kernel or decayed_sum
    rec = Recurrence(name=f"decayed_sum_test_{fn.__name__}", fn=fn, seq_args={"x": 1, "a": 1},
                     neutral={"a": 1.0})
    rec.signature = __import__("inspect").signature(decayed_sum)
    rec.output_like = "x"
    return rec, TracedTreeRecurrence(register_site(rec, ["x", "a"], {}), keep=keep)


@pytest.mark.parametrize("outer", [None, "checkpoint"])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("keep", [False, True], ids=["recomputed", "kept"])
def test_traced_recurrence_runs_classic_autograd_functions(keep, backend, outer):
    """The traced op runs the kernels under plain autograd inside a custom op, in its forward
    (``keep``: the graph kept for the backward) or recomputed in its backward: kernels
    written as classic autograd.Functions (fla's) must differentiate there too. This one saves
    an input and its own output, as kernels do: the op must hand the compiled graph tensors
    the kept graph does not read. ``outer``: the compiled call runs under a non-reentrant
    checkpoint (its saved-tensor hooks around the op: the kept graph's tensors dropped and
    recomputed with the rest)."""
    from torch.utils.checkpoint import checkpoint

    from treefx.ops.recurrence import backward_paths

    rec, op = _decayed_sum_site(keep)
    batch = treefx.pack(odd_forest(33, VOCAB))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, batch.num_tokens, 3, dtype=torch.float64, generator=g, requires_grad=True)
    a = torch.rand(1, batch.num_tokens, 3, dtype=torch.float64, generator=g, requires_grad=True)
    probe = torch.randn(x.shape, dtype=torch.float64, generator=g)

    def loss(parent, x, a):
        # the graph writes over its buffers after the op (an in-place scale of the output)
        out = op(parent, x * 1.0, a + 0.0)[0]
        return (out.mul_(2.0) * probe).sum()

    compiled = torch.compile(loss, backend=backend, fullgraph=True)
    before = backward_paths()
    if outer == "checkpoint":  # the forward runs twice: once, and again in the backward
        got = torch.autograd.grad(checkpoint(compiled, batch.parent_token, x, a,
                                             use_reentrant=False), (x, a))
    else:
        got = torch.autograd.grad(compiled(batch.parent_token, x, a), (x, a))
    after = backward_paths()
    path = "kept" if keep else "recomputed"
    assert after[path] == before[path] + 1 and sum(after.values()) == sum(before.values()) + 1
    want_out, _ = tree_recurrence(rec, batch.parent_token, (x, a), {})
    want = torch.autograd.grad((want_out * 2.0 * probe).sum(), (x, a))
    for w in want:
        assert w.abs().sum() > 0
    for a_, w in zip(got, want):
        torch.testing.assert_close(a_, w, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("keep", [False, True], ids=["recomputed", "kept"])
def test_recurrence_op_passes_opcheck(keep):
    """torch.library.opcheck on the traced op (schema, fake kernel against the real one,
    autograd through AOTAutograd), with an input of other strides than a contiguous one: the
    fake kernel promises contiguous outputs, and Inductor asserts them on the GPU."""
    from treefx.ops.recurrence import traced

    _, op = _decayed_sum_site(keep)
    batch = treefx.pack(odd_forest(33, VOCAB))
    n = batch.num_tokens
    x = torch.randn(1, 3, n, dtype=torch.float64).transpose(1, 2).requires_grad_()
    a = torch.rand(1, n, 3, dtype=torch.float64, requires_grad=True)
    fn = traced._tree_recurrence_kept if keep else traced._tree_recurrence_op
    torch.library.opcheck(fn, (op.key, batch.parent_token, [x, a]))


def _kept_sum_call(op):
    """The sum of ``op``'s output over an odd forest, through AOTAutograd, on float64 inputs
    that require grad (the forward only)."""
    batch = treefx.pack(odd_forest(33, VOCAB))
    x = torch.randn(1, batch.num_tokens, 3, dtype=torch.float64, requires_grad=True)
    a = torch.rand(1, batch.num_tokens, 3, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(lambda p, x, a: op(p, x, a)[0].sum(), backend="aot_eager",
                             fullgraph=True)
    return compiled(batch.parent_token, x, a)


def test_a_forward_without_its_backward_frees_the_kept_graph():
    """A step abandoned after its forward (an evaluation with gradients on, an error before
    the backward) must not keep the kernels' graph alive: it rides on a tensor AOTAutograd
    holds for the backward, and dies with it."""
    import gc
    import weakref

    seen = []

    def watched(x, a, initial_state=None, output_final_state=False):
        if a.requires_grad:  # (not the probe of whether padding is neutral)
            seen.append(weakref.ref(a))  # the kernel saves it for its backward
        return decayed_sum(x, a, initial_state, output_final_state)

    _, op = _decayed_sum_site(True, watched)
    out = _kept_sum_call(op)
    # kept while the backward may come (a view the kernel saved may be kept as its base's
    # data, its own Python object gone, so: some, not every one)
    assert seen and any(r() is not None for r in seen)
    del out
    gc.collect()
    assert all(r() is None for r in seen)


def test_a_kernel_without_history_is_an_error_not_zero_gradients():
    """A kernel that returns its output without autograd history (here: detached) from
    inputs that require grad would give the kept graph nothing to differentiate: an error, not
    zero gradients."""
    def detached(x, a, initial_state=None, output_final_state=False):
        out, fin = decayed_sum(x, a, initial_state, output_final_state)
        return out.detach(), fin

    _, op = _decayed_sum_site(True, detached)
    with pytest.raises(RuntimeError, match="no autograd history"):
        _kept_sum_call(op)


def test_capture_does_not_run_the_kernel_on_fake_tensors():
    """Dynamo runs graph-kept markers on fake tensors; GPU kernels (fla's Triton) cannot run
    there, so the marker answers with the output's shape without calling the kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from treefx.compiler.recurrences import Recurrence, register_recurrence

    def kernel(x, a, initial_state=None, output_final_state=False):
        raise RuntimeError("the kernel ran")

    rec = register_recurrence(Recurrence(name="fake_probe_test", fn=kernel,
                                         seq_args={"x": 1, "a": 1}))
    real = torch.randn(1, 5, 3)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
        out, state = rec.marker(fake, fake)
    assert out.shape == real.shape and state is None
    with pytest.raises(RuntimeError, match="the kernel ran"):
        rec.marker(real, real)


@pytest.mark.parametrize("model_type", ["nemotron_h"])
def test_traced_recurrence_has_the_kernels_output_dtype(model_type):
    """Hugging Face's Mamba2 torch kernel computes in float32 and returns float32 for bfloat16
    inputs. The traced graph must carry that dtype: Inductor, told bfloat16, read the output
    wrongly (NaN log-probs on the GPU)."""
    from treefx.tools import zoo
    from treefx.ops.recurrence import TracedTreeRecurrence
    from treefx.compiler.graph import example

    model = zoo.build_model(model_type, torch.bfloat16)
    tm = treefx.compile(model, backend="aot-eager", verify=False)
    trees = zoo.probe_forest(zoo.VOCAB, zoo.special_token_ids(model.config))
    with torch.no_grad():
        out = tm(treefx.pack(trees))
    assert torch.isfinite(out.token_logprobs).all()
    sites = [n for n in tm.contexts[0].gm.graph.nodes
             if isinstance(n.target, TracedTreeRecurrence)]
    assert sites
    for n in sites:
        val = example(n)
        val = val[0] if isinstance(val, tuple) else val
        assert val.dtype == torch.float32, n.name


def test_two_fsdp2_hybrids_of_other_widths_in_one_process(tmp_path):
    """Two Qwen3-Next models of different widths, each sharded by FSDP2 (a group of one
    process, gloo), compiled one after the other. FSDP2's parameters enter the graph as plain
    inputs, and Dynamo's automatic dynamic shapes remember sizes by function name: when every
    engine's captured function had the same name, the second model was traced with its widths
    symbolic and its causal conv1d refused (found on two H100s, distributed_check's hybrid
    speed case after its exactness case). Both train exactly, with static widths."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        for heads in (2, 4):
            cfg = _gdn_config("qwen3_next")
            cfg.linear_num_key_heads, cfg.linear_num_value_heads = heads, 2 * heads
            cfg._attn_implementation = "sdpa"
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg)
            trees = [SHORT_NODES, odd_tree(32, VOCAB)]
            model.zero_grad(set_to_none=True)
            ref_loss = treefx.reference.sequence_loss(model, trees, reduction="mean")
            ref_loss.backward()
            ref = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            tm = treefx.compile(model, backend="eager", verify=False)
            batch = treefx.pack(trees, reduction="mean")
            loss = treefx.tree_loss(tm(batch), batch)
            loss.backward()
            torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad.full_tensor(), ref[name], rtol=1e-4,
                                           atol=1e-6)
            convs = [n for ctx in tm.contexts for n in ctx.gm.graph.nodes
                     if n.op == "call_function" and "conv1d" in str(n.target)]
            assert convs and all(isinstance(n.kwargs.get("groups", n.args[6] if len(n.args)
                                                         > 6 else 1), int) for n in convs)
    finally:
        dist.destroy_process_group()


def test_gated_deltanet_gradients_are_exact_in_float64(monkeypatch):
    """Hugging Face's torch Gated DeltaNet kernel computes in float32 whatever its inputs, and
    the gradients of ``A_log`` and ``dt_bias`` are sums that cancel: the tree's and the
    per-sequence run's float32 roundings differ there by up to ~1e-4 of the scaled gradient
    (on the GPU: 1.1e-5 against a 1e-5 tolerance, BENCHMARKS.md [mg-15]). With the kernel made
    to compute in float64, the tree's gradients equal the oracle's to float64's rounding: the
    difference is the float32 kernel's, not the tree's."""
    import types

    import transformers.models.qwen3_next.modeling_qwen3_next as hf_next

    wide = types.ModuleType("torch")
    wide.__dict__.update(torch.__dict__)
    wide.float32 = torch.float64  # the kernel's cast to float32 becomes one to float64
    monkeypatch.setattr(hf_next, "torch", wide)
    cfg = _gdn_config("qwen3_next")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).double()
    trees = [SHORT_NODES, odd_tree(32, VOCAB)] + odd_forest(5, VOCAB)
    oracle = copy.deepcopy(model)
    treefx.reference.sequence_loss(oracle, trees, reduction="mean").backward()
    tm = treefx.compile(model, backend="eager", verify=False)
    batch = treefx.pack(trees, reduction="mean")
    treefx.tree_loss(tm(batch), batch).backward()
    ref = dict(oracle.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in ref.values())
    for name, p in model.named_parameters():
        if "A_log" in name or "dt_bias" in name:
            r = ref[name].grad
            err = float((p.grad - r).abs().max()) / max(float(r.abs().max()), 1e-3 * scale)
            assert err < 1e-7, (name, err)  # float64 kernel: ~5e-9; float32 kernel: 1.4e-6


@pytest.mark.parametrize("backend", ["eager", "aot-eager"])
def test_padding_in_chains_is_inert_for_a_hybrid(backend):
    """A row padded in root chains (``pad_node_tokens``, as the first-call check pads its
    probe) gives the real tokens the log-probabilities and the parameters the gradients of
    one root a pad token: the conv, the recurrence and attention see no pad chain."""
    from treefx.models import tiny_hybrid

    torch.manual_seed(0)
    model = tiny_hybrid(("gdn", "attention"), vocab_size=VOCAB).double()
    tm = treefx.compile(model, backend=backend, verify=False)
    trees = odd_forest(7, VOCAB)
    got = []
    for node in (1, 9):
        batch = treefx.pack(trees, pad_to_multiple=64, pad_node_tokens=node)
        assert batch.num_padding > 9
        model.zero_grad(set_to_none=True)
        out = tm(batch)
        treefx.tree_loss(out, batch).backward()
        got.append((out.token_logprobs[:batch.num_real_tokens].detach(),
                    [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(got[1][0], got[0][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(got[1][1], got[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_row_of_roots_alone_goes_to_the_kernel_as_it_is():
    """Separate sequences (packing's layout) in one variable-length call on the row itself: no
    copy of the inputs into nodes and back; root states given and final states handed out
    (a part of a forest) equal the level path's (each node split out and concatenated)."""
    import dataclasses

    from treefx.ops.recurrence.reference import run_tree

    padded = recurrence("qwen3_next_gated_delta_rule")
    calls = []

    def recording(seq, static, init, cu, cu_cpu, final=True):
        calls.append((seq["value"].data_ptr(), cu_cpu.tolist()))
        return _per_node_varlen(padded)(seq, static, init, cu, cu_cpu, final=final)

    fast = dataclasses.replace(padded, varlen=recording, varlen_devices=("cpu",),
                               varlen_check=None, tree_varlen=None)
    seqs = odd_tree(34, VOCAB).sequences
    batch = treefx.pack([treefx.Tree.from_sequences([s]) for s in seqs])
    n, g = batch.num_tokens, torch.Generator().manual_seed(2)
    xs = [torch.randn(1, n, 2, 8, dtype=torch.float64, generator=g).requires_grad_()
          for _ in range(3)]
    kw = dict(g=(-torch.rand(1, n, 2, dtype=torch.float64, generator=g)).requires_grad_(),
              beta=torch.rand(1, n, 2, dtype=torch.float64, generator=g).requires_grad_(),
              use_qk_l2norm_in_kernel=True)
    h0 = torch.randn(len(seqs), 2, 8, 8, dtype=torch.float64, generator=g).requires_grad_()
    starts = [int(s) for s in torch.nonzero(batch.parent_token < 0)[:, 0]]
    keep = (0, len(seqs) - 1)
    got = []
    for rec in (fast, dataclasses.replace(fast, varlen_split=_in_threes)):  # row; levels
        calls.clear()
        row, final, _ = run_tree(rec, batch.parent_token, xs, kw, keep=keep,
                                 root_state=lambda t: h0[starts.index(t)])
        fin = torch.stack([final[i] for i in keep])
        grads = torch.autograd.grad(row.sum() + (fin * fin).sum(),
                                    [*xs, kw["g"], kw["beta"], h0])
        got.append((row, fin, grads, list(calls)))
    (row, fin, grads, one), (row2, fin2, grads2, several) = got
    assert len(one) == 1 and one[0][0] == xs[2].data_ptr()  # the row itself, one call
    assert one[0][1] == [0, *itertools.accumulate(len(s) for s in seqs)]
    assert len(several) > 1
    # Hugging Face's kernel computes in float32 (its floor), whatever the inputs' dtype
    torch.testing.assert_close(row, row2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fin, fin2, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("separate", [True, False], ids=["roots_alone", "trees"])
def test_hugging_face_qwen3_next_on_the_variable_length_path_equals_the_oracle(monkeypatch,
                                                                              separate):
    """Hugging Face's Qwen3-Next with its Gated DeltaNet on the variable-length path (fla's
    form, emulated here on the CPU one node at a time by Hugging Face's own kernel): a batch of
    separate sequences, handed to the kernel as the row it is, and a forest of trees, run level
    by level; log-probabilities and every gradient against each sequence run alone."""
    from treefx.ops.recurrence import kernel_runs
    from treefx.tools.zoo import build_model

    model = build_model("qwen3_next")  # float32: Hugging Face's kernel computes in it anyway
    rec = recurrence("qwen3_next_gated_delta_rule")
    for name, value in (("varlen", _per_node_varlen(rec)), ("varlen_devices", ("cpu",)),
                        ("varlen_check", None), ("tree_varlen", None)):
        monkeypatch.setattr(rec, name, value)
    vocab = model.get_input_embeddings().num_embeddings
    trees = odd_forest(35, vocab)
    if separate:
        trees = [treefx.Tree.from_sequences([s]) for t in trees for s in t.sequences]
    before = kernel_runs().get((rec.name, "varlen"), 0)
    check_against_oracle(treefx.compile(model, backend="eager", verify=False), trees)
    assert kernel_runs().get((rec.name, "varlen"), 0) > before
