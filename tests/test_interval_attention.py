"""Tree attention as key intervals (:mod:`treefx.ops.attention.intervals`): the intervals
against the tree's mask, the op against dense tree attention (values and gradients), and
models through the whole-tree sites on it against the per-branch oracle. On the CPU the op is
taken only where ``TREEFX_CUDNN_ATTENTION=1`` asks, and then computes plain torch from the
same intervals; cuDNN's kernels are checked on the GPU by ``benchmarks.gpu_check --cases
intervals``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import VOCAB, check_against_oracle, hf_model
from test_trunk_attention import comb
from trees import odd_forest

import treefx
from treefx.mask import dense_tree_mask
from treefx.models import tiny_decoder
from treefx.ops.attention import intervals, tree_attention_dense
from treefx.tools.synth import random_parent_row

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _subtree_end(parent: np.ndarray) -> torch.Tensor:
    """Each row's subtree end in a depth-first row from its predecessors (the mask's input)."""
    n = len(parent)
    end = np.arange(1, n + 1)
    for i in range(n - 1, -1, -1):
        if parent[i] >= 0:
            end[parent[i]] = max(end[parent[i]], end[i])
    return torch.from_numpy(end)


def _mask_of(f: np.ndarray, keys: int | None = None) -> np.ndarray:
    j = np.arange(f.shape[1] if keys is None else keys)
    seen = j[None, :] < f[0][:, None]
    for a, b in zip(f[1::2], f[2::2]):
        seen |= (j[None, :] >= a[:, None]) & (j[None, :] < b[:, None])
    return seen


@pytest.mark.parametrize("seed", range(12))
def test_the_intervals_are_the_tree_mask(seed):
    """Random rows (forests, single-token nodes, long chains): each row's intervals name
    exactly its ancestors and itself; their count is odd and the ends never go down."""
    par = random_parent_row(seed, roots=1 + seed % 3)
    f = intervals.tree_intervals(par)
    assert f.dtype == np.int32 and f.shape[0] % 2 == 1 and f.shape[1] == len(par)
    assert (np.diff(f[1:], axis=0) >= 0).all()
    want = dense_tree_mask(_subtree_end(par)).numpy()
    np.testing.assert_array_equal(_mask_of(f), want)


def test_the_intervals_of_packed_trees():
    """Rows as :func:`treefx.pack` lays them out: a comb, odd forests with duplicates and
    prefixes of each other, one-token trees."""
    for trees in ([comb(0)], odd_forest(3, VOCAB), [comb(1)] + odd_forest(5, VOCAB),
                  [treefx.Tree.from_sequences([[1]]), treefx.Tree.from_sequences([[2], [2, 3]])]):
        b = treefx.pack(trees)
        f = intervals.tree_intervals(b.parent_token.numpy())
        np.testing.assert_array_equal(_mask_of(f), dense_tree_mask(b.subtree_end).numpy())
    # a comb's rows: the trunk, then leaves that see a prefix of it: two intervals at most
    f = intervals.tree_intervals(treefx.pack([comb(0)]).parent_token.numpy())
    assert f.shape[0] == 5


def _part_mask(t: dict) -> np.ndarray:
    """[n, A + n] bool: the keys each of a part's rows sees, as its FlexAttention site's
    ``mask_mod`` has it (key ``j`` of the extended row when ``j <= A + i < subtree_end[j]``)."""
    se = torch.cat([t["part_info"][2], t["tree_info"][2]])
    return dense_tree_mask(se)[t["part_info"].shape[1]:].numpy()  # the part's query rows


@pytest.mark.parametrize("seed", range(6))
def test_the_intervals_of_parts(seed):
    """A part's rows (:func:`treefx.parts.part_tensors`: the context's padded path, then its
    own rows): the intervals over the extended row name the keys its site's mask does, the
    context's prefix the row hangs under and its own ancestors, on random trees cut into
    parts of several sizes (forests, one-token nodes, parts that start inside a node)."""
    from treefx import parts

    batch = treefx.pack(odd_forest(seed, VOCAB) + ([comb(seed)] if seed % 2 else []))
    for budget in (3, 7, 16, 40):
        plan = parts.plan(batch, budget, block_size=4)
        for part in plan.parts:
            t = parts.part_tensors(plan, part)
            a, n = t["part_info"].shape[1], t["tree_info"].shape[1]
            f = intervals.tree_intervals(t["tree_info"][1].numpy(), a)
            assert f.shape[1] == n
            np.testing.assert_array_equal(_mask_of(f, a + n), _part_mask(t),
                                          err_msg=f"budget {budget}")


def test_a_row_that_is_not_depth_first_is_an_error():
    """A predecessor at or after its own row (a row not laid out depth first, or a part's
    predecessors in the wrong coordinates) is an error, not intervals of some other mask."""
    with pytest.raises(ValueError, match="at or after its own row"):
        intervals.tree_intervals(np.array([-1, 0, 2]))
    with pytest.raises(ValueError, match="at or after its own row"):
        intervals.tree_intervals(np.array([-1, 0, 1]) + 4, context=3)  # local rows 1, 2, 3
    f = intervals.tree_intervals(np.array([2, 3, 4]), context=3)  # under context row 2
    np.testing.assert_array_equal(f[:, 0], [3, 3, 4])


@pytest.mark.parametrize("group", [1, 2])
def test_the_op_is_tree_attention(group, monkeypatch):
    """float64: the op's output and the gradients of q, k, v equal dense tree attention's."""
    monkeypatch.setenv(intervals.SWITCH, "1")
    torch.manual_seed(group)
    b = treefx.pack([comb(2)] + odd_forest(4, VOCAB))
    n, hk = b.num_tokens, 2
    q = torch.randn(1, hk * group, n, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, hk, n, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    g = torch.randn(1, hk * group, n, 8, dtype=torch.float64)
    out = intervals.tree_interval_attention(q, k, v, b.parent_token, 0.3)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = tree_attention_dense(q, k, v, dense_tree_mask(b.subtree_end), None, scale=0.3,
                               enable_gqa=group > 1)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=0)


@pytest.mark.parametrize("group", [1, 2])
def test_the_part_op_is_part_attention(group, monkeypatch):
    """float64: a part's queries over its context and its own keys (the op with k longer
    than q) equal dense attention under the part's mask, values and the gradients of q, k, v
    and of the context's keys and values, on parts with and without context."""
    from treefx import parts

    monkeypatch.setenv(intervals.SWITCH, "1")
    torch.manual_seed(group)
    batch = treefx.pack([comb(2)] + odd_forest(4, VOCAB))
    plan = parts.plan(batch, 24, block_size=8)
    hk, checked = 2, 0
    for part in plan.parts:
        t = parts.part_tensors(plan, part)
        a, n = t["part_info"].shape[1], t["tree_info"].shape[1]
        checked += a > 0

        def rand(h, rows):
            return torch.randn(1, h, rows, 8, dtype=torch.float64, requires_grad=True)

        q, k, v, kc, vc = rand(hk * group, n), rand(hk, n), rand(hk, n), rand(hk, a), rand(hk, a)
        g = torch.randn(1, hk * group, n, 8, dtype=torch.float64)
        out = intervals.tree_part_interval_attention(q, k, v, kc, vc, t["tree_info"][1], 0.3)
        grads = torch.autograd.grad(out, (q, k, v, kc, vc), g)
        mask = torch.from_numpy(_part_mask(t))
        keys, values = torch.cat([kc, k], 2), torch.cat([vc, v], 2)
        if group > 1:
            keys, values = (x.repeat_interleave(group, 1) for x in (keys, values))
        p = (q @ keys.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf")).softmax(-1)
        ref = p @ values
        ref_grads = torch.autograd.grad(ref, (q, k, v, kc, vc), g)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
        for x, r in zip(grads, ref_grads):
            torch.testing.assert_close(x, r, atol=1e-12, rtol=0)
    assert checked >= 3  # parts under a context


def test_the_op_checks(monkeypatch):
    """torch.library's checks of the op and its backward (fake tensors, autograd)."""
    monkeypatch.setenv(intervals.SWITCH, "1")
    b = treefx.pack(odd_forest(2, VOCAB))
    n = b.num_tokens
    q = torch.randn(1, n, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, n, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    torch.library.opcheck(intervals._attend, (q, k, v, b.parent_token, 0.25))


def test_a_row_of_another_length_is_an_error(monkeypatch):
    """q, k and the predecessor row must describe the same tokens: a row cut short names the
    lengths instead of attending over the wrong keys."""
    monkeypatch.setenv(intervals.SWITCH, "1")
    b = treefx.pack(odd_forest(2, VOCAB))
    n = b.num_tokens
    q = torch.randn(1, 4, n, 8)
    k = v = torch.randn(1, 2, n, 8)
    with pytest.raises(ValueError, match=f"row has \\({n - 1},\\) entries, but q has {n}"):
        intervals.tree_interval_attention(q, k, v, b.parent_token[:-1])


def test_keys_shorter_than_the_queries_are_an_error(monkeypatch):
    """A part's keys are its context's then its own: fewer keys than queries is an error."""
    monkeypatch.setenv(intervals.SWITCH, "1")
    b = treefx.pack(odd_forest(2, VOCAB))
    n = b.num_tokens
    q = torch.randn(1, 4, n, 8)
    k = v = torch.randn(1, 2, n - 1, 8)
    with pytest.raises(ValueError, match=f"q has {n} tokens and k {n - 1}"):
        intervals.tree_interval_attention(q, k, v, b.parent_token)


def test_wanted_on_the_gpu_in_half_precision_unless_switched(monkeypatch):
    x = torch.zeros(1, 4, 8, 16)
    monkeypatch.delenv(intervals.SWITCH, raising=False)
    assert not intervals.wanted(x, x[:, :2], x[:, :2])  # the CPU: FlexAttention
    monkeypatch.setenv(intervals.SWITCH, "1")
    assert intervals.wanted(x, x[:, :2], x[:, :2])
    assert not intervals.wanted(x, x[:, :3], x[:, :3])  # heads that do not group
    assert not intervals.wanted(torch.zeros(2, 4, 8, 16), x[:, :2], x[:, :2])  # two rows
    monkeypatch.setenv(intervals.SWITCH, "0")
    assert not intervals.wanted(x, x[:, :2], x[:, :2])


def test_a_warm_up_that_fails_is_reported_and_changes_nothing(monkeypatch, caplog):
    """The children compiling cuDNN's kernels (:mod:`interval_warmup`) run by their path in
    fresh interpreters, the forward's and the backward's apart; here (no frontend) they fail,
    and each of the op's waits reports its child's output and returns. They start only where
    the op runs on cuDNN's kernels, once per kernel set."""
    from treefx.ops.attention import interval_warmup

    x = torch.zeros(1, 4, 8, 16)
    intervals.warm_up(x, x[:, :2], x[:, :2])  # the CPU: nothing to compile
    assert not interval_warmup._running
    monkeypatch.setattr(interval_warmup, "_disk_cache_on", lambda: True)
    monkeypatch.setattr(interval_warmup, "_running", {})
    monkeypatch.setattr(interval_warmup, "_done", set())
    monkeypatch.delenv(interval_warmup.PROCESSES, raising=False)
    interval_warmup.start(x, x[:, :2], x[:, :2])
    interval_warmup.start(x, x[:, :2], x[:, :2])
    assert sorted(role for _, role in interval_warmup._running) == ["backward", "forward"]
    assert len(set(interval_warmup._running.values())) == 2  # two processes
    rows = x.transpose(1, 2)
    with caplog.at_level("WARNING", logger="treefx"):
        interval_warmup.wait(rows, rows[:, :, :2], rows[:, :, :2])
    assert "warm-up process (forward) ended with 1" in caplog.text and "cudnn" in caplog.text
    assert [role for _, role in interval_warmup._running] == ["backward"]
    with caplog.at_level("WARNING", logger="treefx"):
        interval_warmup.wait(rows, rows[:, :, :2], rows[:, :, :2], "backward")
    assert "warm-up process (backward) ended with 1" in caplog.text
    assert not interval_warmup._running
    interval_warmup.start(x, x[:, :2], x[:, :2])  # done: not again
    assert not interval_warmup._running
    # one process for both, reported once
    monkeypatch.setenv(interval_warmup.PROCESSES, "1")
    caplog.clear()
    interval_warmup.start(x, x[:, :4], x[:, :4])
    assert len(interval_warmup._running) == 2 and len(set(interval_warmup._running.values())) == 1
    with caplog.at_level("WARNING", logger="treefx"):
        for role in interval_warmup.ROLES:
            interval_warmup.wait(rows, rows[:, :, :4], rows[:, :, :4], role)
    assert caplog.text.count("warm-up process (forward and backward) ended with 1") == 1
    monkeypatch.setenv(interval_warmup.PROCESSES, "3")
    with pytest.raises(ValueError, match="TREEFX_CUDNN_WARMUP_PROCESSES"):
        interval_warmup.start(x, x[:, :1], x[:, :1])
    monkeypatch.delenv(interval_warmup.PROCESSES)
    monkeypatch.setenv(interval_warmup.SWITCH, "0")
    interval_warmup.start(x, x[:, :1], x[:, :1])
    assert not interval_warmup._running


def test_a_models_kernels_are_guessed_from_its_config(monkeypatch):
    """Before Dynamo's trace, the kernels a model's attention will need are read from its
    config (heads, KV heads, head width) and its parameters' dtype; an MLA config, float32
    weights, a head width the kernels do not take, or the CPU start nothing."""
    from treefx.ops.attention import interval_warmup
    from treefx.tools import zoo

    started = []
    monkeypatch.setattr(interval_warmup, "start_for", lambda *a: started.append(a[:6]))
    cuda = torch.device("cuda", 0)
    model = hf_model("qwen3", "sdpa", torch.bfloat16)  # 4 heads, 2 KV heads of 16
    intervals.warm_up_model(model, cuda)  # no frontend here
    monkeypatch.setattr(intervals, "available", lambda device: True)
    monkeypatch.setattr(intervals, "_arch", lambda index: 90)
    intervals.warm_up_model(model, torch.device("cpu"))
    intervals.warm_up_model(model, cuda)  # 16 wide: not the kernels'
    assert not started
    model.config.head_dim = 64
    intervals.warm_up_model(model, cuda)
    cfg = model.config
    assert started == [(torch.bfloat16, cfg.num_attention_heads, cfg.num_key_value_heads, 64,
                        64, cuda)]
    intervals.warm_up_model(model.float(), cuda)
    mla = zoo.build_model("deepseek_v3", torch.bfloat16)
    intervals.warm_up_model(mla, cuda)
    assert len(started) == 1


def test_the_frontend_is_found_without_importing_it():
    """Where the frontend is installed is decided from the installed packages (its import
    takes seconds and waits for the op's first call); here it is not, and an import forced
    anyway is an error that says how to turn the op off."""
    import sys

    assert not intervals._installed()
    assert "cudnn.flex_attention" not in sys.modules
    assert intervals._version("1.32.0") >= intervals._MIN_VERSION
    assert intervals._version("1.31.9rc1") < intervals._MIN_VERSION
    intervals._frontend.cache_clear()
    with pytest.raises(RuntimeError, match="TREEFX_CUDNN_ATTENTION=0"):
        intervals._frontend()


def _interval_sites(tm) -> list:
    return [r.note for c in tm.contexts for r in c.log
            if r.pass_name == "attention" and "interval-mask" in r.note]


@pytest.mark.parametrize("backend", ["flex-eager", "aot-eager"])
def test_whole_trees_on_intervals_match_the_oracle(backend, monkeypatch):
    """Qwen3 (float64) with its sites on the op: log-probs and every gradient equal each
    sequence alone, on a comb, on odd forests, and on both together. (Gradients within 1e-6
    relative: they differ from the oracle's by 6-9e-8 with FlexAttention's sites too, in
    both backends; the log-probs agree to 1e-15.)"""
    monkeypatch.setenv(intervals.SWITCH, "1")
    tm = treefx.compile(hf_model("qwen3", "sdpa", torch.float64), backend=backend,
                        block_size=16)
    for trees in ([comb(0)], odd_forest(3, VOCAB), [comb(1)] + odd_forest(1, VOCAB)):
        check_against_oracle(tm, trees, atol=1e-9, rtol=1e-6)
    assert len(_interval_sites(tm)) == 2  # both layers' sites


@pytest.mark.parametrize("model_type,checkpointing", [
    ("gpt2", False), ("deepseek_v3", False), ("exaone4", False), ("llama", True)])
def test_families_on_intervals_match_the_oracle(model_type, checkpointing, monkeypatch):
    """Other families' attention through the op (learned positions, MLA's head widths,
    sliding-window layers beside full ones: a windowed layer keeps FlexAttention), with
    activation checkpointing for one, checked by ``treefx.verify`` against each sequence
    alone (float32)."""
    from treefx.tools import zoo

    monkeypatch.setenv(intervals.SWITCH, "1")
    model = zoo.build_model(model_type, torch.float32, checkpointing=checkpointing)
    exclude = zoo.special_token_ids(model.config)
    tm = treefx.compile(model, backend="flex-eager", block_size=16, verify=False)
    for trees in (zoo.probe_forest(zoo.VOCAB, exclude), [comb(3)]):
        rep = treefx.verify(tm, trees, raise_on_failure=False)
        assert rep.passed, rep
    assert len(_interval_sites(tm)) == (1 if model_type == "exaone4" else 2)


def test_a_step_on_intervals_matches_the_oracle(monkeypatch):
    """``@treefx.step`` lowers its attention the same way: loss and every gradient equal the
    per-sequence run."""
    from test_step import check_step, hf_labels_step

    monkeypatch.setenv(intervals.SWITCH, "1")
    model = hf_model("qwen3", "sdpa", torch.float64)
    step = treefx.step(hf_labels_step, backend="flex-eager", block_size=16)
    check_step(step, model, [comb(0)] + odd_forest(5, VOCAB), "mean", rtol=1e-6)
    notes = [r.note for c in step.contexts for r in c.log if r.pass_name == "attention"]
    assert notes and all("interval-mask" in n for n in notes)


def test_parts_on_intervals_match_the_oracle(monkeypatch):
    """``treefx.backward`` in parts (the inductor backend's part graph run op by op, as
    tests/test_parts.py does): every part's sites on the op, its context as the keys before
    its own; loss and every gradient equal each sequence alone, from the whole tree in one
    part to parts of 7 tokens, on a comb, on a tree with a trunk and on odd forests."""
    from test_parts import _check, comb_tree

    from treefx.run.parts import runners

    monkeypatch.setattr(treefx.run.backends, "compile_graph",
                        lambda backend, gm, ex, options=None: gm.forward)
    monkeypatch.setenv("TREEFX_INDUCTOR_ON_CPU", "1")
    monkeypatch.setenv(intervals.SWITCH, "1")
    tm = treefx.compile(hf_model("qwen3", "sdpa", torch.float64), backend="inductor",
                        verify=False, block_size=16)
    for budget in (200, 20, 7):
        _check(tm, [comb(0)], budget, rtol=1e-6)
    _check(tm, [comb_tree(3, calls=12, trunk=(5, 20))], 40, rtol=1e-6)
    _check(tm, odd_forest(3, VOCAB), 9, rtol=1e-6)
    notes = [r.note for r in runners(tm)[0].engine.contexts[-1].log
             if r.pass_name == "attention"]
    assert len(notes) == 2 and all("interval-mask" in n and "earlier parts" in n for n in notes)


@pytest.mark.parametrize("model_type,checkpointing", [("llama", True), ("deepseek_v3", False)])
def test_families_in_parts_on_intervals_match_the_oracle(model_type, checkpointing, monkeypatch):
    """Parts on the op for other families (float32, the zoo's probe forest in parts of 40 and
    9 tokens): with every layer checkpointed (the op in the checkpointed bodies, the context
    entering them as operands) and MLA's head widths; every gradient against each sequence
    alone."""
    from test_parts import _check

    from treefx.run.parts import runners
    from treefx.tools import zoo

    monkeypatch.setattr(treefx.run.backends, "compile_graph",
                        lambda backend, gm, ex, options=None: gm.forward)
    monkeypatch.setenv("TREEFX_INDUCTOR_ON_CPU", "1")
    monkeypatch.setenv(intervals.SWITCH, "1")
    model = zoo.build_model(model_type, torch.float32, checkpointing=checkpointing)
    tm = treefx.compile(model, backend="inductor", verify=False, block_size=16)
    trees = zoo.probe_forest(zoo.VOCAB, zoo.special_token_ids(model.config))
    for budget in (40, 9):
        _check(tm, trees, budget, rtol=1e-4)
    notes = [r.note for r in runners(tm)[0].engine.contexts[-1].log
             if r.pass_name == "attention"]
    assert len(notes) == 2 and all("interval-mask" in n for n in notes)


def test_a_model_on_a_gpu_starts_its_background_work_at_compile(monkeypatch):
    """treefx.compile of a model whose parameters are on a GPU starts the first call's
    background work (Inductor's compile workers, cuDNN's kernel processes) at once, for the
    inductor backend only, and the first call does not start it again; a model on the CPU
    starts nothing. (No GPU here: the device the parameters report is replaced.)"""
    from treefx.run import engine as engine_mod
    from treefx.run import model as model_mod

    started = []
    monkeypatch.setattr(engine_mod.backends, "warm_compile_workers",
                        lambda: started.append("workers"))
    monkeypatch.setattr(engine_mod.intervals, "warm_up_model",
                        lambda m, d, options=None: started.append(
                            ("kernels", type(m).__name__, str(d))))
    model = tiny_decoder(vocab_size=VOCAB)
    treefx.compile(model)  # on the CPU
    assert started == []
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(model_mod, "_parameter_device", lambda m: gpu)
    monkeypatch.setattr(engine_mod.backends, "resolve",
                        lambda backend, device, options=None: "inductor"
                        if backend in ("auto", "inductor")
                        and device.type == "cuda" else "eager")
    monkeypatch.setattr(engine_mod.backends, "check_available",
                        lambda backend, options=None: None)
    tm = treefx.compile(model)
    assert started == ["workers", ("kernels", type(model).__name__, "cuda:0")]
    treefx.compile(model, backend="eager")  # eager: nothing
    assert len(started) == 2
    tm.engine.compiled.append(object())  # once compiled, a later start does nothing
    tm.engine.warm_start(gpu, model)
    assert len(started) == 2
