"""Trees larger than the token budget, in parts (``treefx.backward``): every token computed
once, loss and every gradient equal to each sequence alone (the oracle), with part boundaries
inside nodes, windows and recurrent state crossing them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import VOCAB, MaskedAttention, grads, hf_model

import treefx
from treefx import parts
from treefx.run.parts import runners
from treefx.models import enable_activation_checkpointing
from treefx.ops.attention import TreePartFlexAttention
from treefx.ops.embedding import part_embedding
from treefx.tools.synth import odd_forest, odd_tree

transformers = pytest.importorskip("transformers")


def _oracle(model, trees, reduction="mean"):
    loss = treefx.reference.sequence_loss(model, trees, reduction=reduction)
    loss.backward()
    return loss.detach(), grads(model)


def _check(tm, trees, max_tokens, *, rtol=1e-4):
    model = tm.model
    ref_loss, ref = _oracle(model, trees)
    loss = treefx.backward(tm, trees, max_tokens=max_tokens)
    got = grads(model)
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype), atol=1e-5, rtol=1e-5)
    assert set(got) == set(ref)
    for name, g in ref.items():
        err = float((got[name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err <= rtol, f"{name}: relative gradient error {err:.2e} (budget {max_tokens})"


@pytest.mark.parametrize("name,budgets", [
    ("qwen3", (3, 7, 1000)),   # from "shorter than most sequences" to "the whole tree"
    ("gpt2", (5,)),
    # a window of 3 positions crossing part boundaries (in CI through FlexAttention's part
    # graph: test_flex_part_sites_leave_blocks_beyond_the_window_out)
    pytest.param("mistral", (3,), marks=pytest.mark.slow),
])
def test_parts_match_the_oracle(name, budgets, shared):
    if name == "qwen3":
        tm = shared("qwen3")
    else:
        tm = treefx.compile(hf_model(name, "sdpa"), backend="eager", verify=False)
    trees = odd_forest(3, VOCAB)
    for b in budgets:
        _check(tm, trees, b)


def _hybrid():
    from test_hybrid import _gdn_config

    cfg = _gdn_config("qwen3_next")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def _compiled():
    return {}


@pytest.fixture
def shared(_compiled):
    """``shared(name)``: one compiled model per name (``"qwen3"``, ``"qwen3_next"``: the
    hybrid above) for the tests of this module that only train it in parts, eager, unchecked
    (no hook, no frozen weight, no autocast, no ``.grad`` given beforehand: nothing a capture
    sees differs between them). Its part graph is captured once, by whichever of them runs
    first: finding the layout, the graph, its recompute twin, ~15 s of CPU for Qwen3 and more
    for the hybrid. Built as each test would build it (the same seed, the same weights; not
    trained), its ``.grad`` cleared for each test; each test runs its own trees, budgets and
    checks. Tests that capture under other conditions build their own."""
    def get(name):
        tm = _compiled.get(name)
        if tm is None:
            model = _hybrid() if name == "qwen3_next" else hf_model(name, "sdpa")
            tm = _compiled[name] = treefx.compile(model, backend="eager", verify=False)
        tm.model.zero_grad(set_to_none=True)
        return tm
    return get


def test_hybrid_conv_and_state_cross_part_boundaries(shared):
    tm = shared("qwen3_next")
    trees = [odd_tree(5, VOCAB), *odd_forest(6, VOCAB)]
    for b in (3, 13):
        _check(tm, trees, b)
    notes = [r.note for r in runners(tm)[0].engine.contexts[-1].log if r.pass_name == "ssm"]
    assert len(notes) == 4  # 2 convs, 2 recurrences: all in part mode


@pytest.mark.slow
def test_hybrid_through_aot_autograd():
    """The inductor lowering's part graph (FlexAttention, the recurrence as one custom op
    with its own backward) traced by AOTAutograd, kernels run eagerly."""
    tm = treefx.compile(_hybrid(), backend="aot-eager", verify=False)
    _check(tm, odd_forest(3, VOCAB), 7)
    sites = [r.after for r in runners(tm)[0].engine.contexts[-1].log if r.pass_name == "ssm"]
    assert sum("tree_recurrence_part_op" in s for s in sites) == 2


def test_layers_sharing_a_compiled_piece_keep_their_state_gradients():
    """Regional execution (every FSDP2 model) compiles Gated DeltaNet layers of one shape once
    for all. In parts, each of those layers hands its exit states on, and each must get their
    gradients back: a shared piece's outputs were once described to the pieces after it by
    the capture's example values, made without requires_grad, so AOTAutograd (Inductor on the
    GPU) compiled the glue to drop the exit states' gradients of every layer but the first
    (gradients 4e-3 to 5e-2 off; found by benchmarks/gdn_parts_check.py on an H200)."""
    from test_hybrid import _gdn_config

    cfg = _gdn_config("qwen3_next")
    cfg.layer_types = ["linear_attention"] * 3 + ["full_attention"]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tm = treefx.compile(model, backend="aot-eager", regional=True, verify=False)
    # dt_bias's gradient in parts is 1.1e-4 off (the eager backend's too, without sharing:
    # rounding of its cancelling sums); the dropped gradients were 5e-2 off
    _check(tm, odd_forest(3, VOCAB), 16, rtol=5e-4)
    (graph,) = [g for gs in runners(tm)[0].engine._regional.values() for g in gs]
    gdn = [p for p in graph.pieces if p.block in ("model.layers.1", "model.layers.2")]
    assert gdn[0].compiled is gdn[1].compiled  # the case: one compiled piece, two layers


def test_every_token_is_embedded_once_and_gradients_accumulate(monkeypatch, shared):
    tm = shared("qwen3")
    model = tm.model
    # agent trees: no single-token nodes, so no part of one token (those get an inert pad)
    trees = [treefx.synth.agent_tree(i, vocab_size=VOCAB, rollouts=2, system_len=(6, 12),
                                     prompt_len=(3, 8), think_len=(3, 9), answer_len=(2, 5),
                                     tool_len=(3, 9)) for i in range(2)]
    batch = treefx.pack(trees)
    plan = parts.plan(batch, 24)
    assert all(p.num_tokens > 1 for p in plan.parts)
    assert plan.recompute_tokens > 0  # some parts run their forward again at their backward
    embedded, again = [], []
    call = treefx.run.parts.PartRunner.__call__
    backward_of = treefx.run.parts.executor.backward_part
    in_backward = []

    def counting(self, t, *rest):
        (again if in_backward else embedded).append(t["input_ids"].clone())
        return call(self, t, *rest)

    def backward(h, *rest, **kwargs):
        in_backward.append(True)
        try:
            return backward_of(h, *rest, **kwargs)
        finally:
            in_backward.pop()

    monkeypatch.setattr(treefx.run.parts.PartRunner, "__call__", counting)
    monkeypatch.setattr(treefx.run.parts.executor, "backward_part", backward)
    treefx.backward(tm, trees, max_tokens=24)
    # Each part's graph embeds its own ids, and nothing else: one lookup, whose gradient goes
    # to the part's rows (added into .grad at its ids, not a dense gradient per part)
    gm = runners(tm)[0].engine.contexts[-1].gm
    lookups = [n for n in gm.graph.nodes
               if n.target in (torch.nn.functional.embedding, part_embedding)]
    assert len(lookups) == 1 and lookups[0].args[0].name == "l_input_ids_"
    assert lookups[0].target is part_embedding
    # ... and the parts' ids are the row's, each token once (the capture that finds the
    # context widths is not a call of a part), and once more in a recompute part's backward
    ids = [e for e in embedded if e.shape[1] > 0]
    row = torch.cat([e[0] for e in ids])
    assert row.shape[0] == batch.num_tokens and torch.equal(row, batch.input_ids[0])
    assert sorted(e.shape[1] for e in again) == \
        sorted(p.num_tokens for p in plan.parts if p.recompute)
    once = grads(model)
    treefx.backward(tm, trees, max_tokens=24)
    treefx.backward(tm, trees, max_tokens=40)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n], atol=1e-6, rtol=1e-4)


def test_rl_objective_in_parts_equals_the_whole_batch(shared):
    tm = shared("qwen3")
    model = tm.model
    trees = odd_forest(5, VOCAB)
    batch = treefx.pack(trees, reduction="mean")
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(batch.num_sequences, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        old = tm(batch).token_logprobs + 0.1 * torch.randn(batch.num_tokens, generator=gen)

    def ppo(out, b):
        return treefx.rl.ppo_clip_loss(out, b, adv, old, clip_eps=0.05)

    whole = ppo(tm(batch), batch)
    whole.backward()
    ref = grads(model)
    loss = treefx.backward(tm, trees, max_tokens=6, loss_fn=ppo)
    torch.testing.assert_close(loss.double(), whole.detach().double(), atol=1e-6, rtol=1e-5)
    got = grads(model)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, atol=1e-6, rtol=1e-4)


def test_plan_even_keeps_the_count_and_evens_the_parts():
    """plan_even: at most the given number of parts, the largest no larger than plan's at
    the budget (and smaller where the trees allow), every token in one part, within the
    budget; a count below plan's gives plan's own; trained in parts it is exact (FSDP2's
    rounds use it, tests/test_distributed_parts.py)."""
    trees = [treefx.synth.agent_tree(i, vocab_size=VOCAB, rollouts=2, system_len=(6, 12),
                                     prompt_len=(3, 8), think_len=(3, 9), answer_len=(2, 5),
                                     tool_len=(3, 9)) for i in range(3)]
    batch = treefx.pack(trees)
    budget = batch.num_tokens // 2
    first = parts.plan(batch, budget, recompute=False)
    assert first.num_parts >= 2
    largest = max(p.num_tokens for p in first.parts)
    gained = False
    for k in range(first.num_parts, first.num_parts + 4):
        even = parts.plan_even(batch, budget, k, recompute=False)
        assert even.num_parts <= k and even.max_tokens <= budget
        assert even.parts[0].start == 0 and even.parts[-1].end == batch.num_tokens
        assert all(a.end == b.start for a, b in zip(even.parts, even.parts[1:]))
        assert max(p.num_tokens for p in even.parts) <= largest
        assert even.peak_held_tokens() <= max(first.peak_held_tokens(), budget)
        gained |= max(p.num_tokens for p in even.parts) < largest
    assert gained
    assert parts.plan_even(batch, budget, 1, recompute=False).num_parts == first.num_parts
    with pytest.raises(ValueError, match="num_parts"):
        parts.plan_even(batch, budget, 0)


@pytest.mark.parametrize("seed", range(6))
def test_plan_covers_the_row_and_bounds_memory(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    trees = odd_forest(seed, VOCAB) + [odd_tree(seed + 50, VOCAB)]
    batch = treefx.pack(trees)
    budget = int(rng.integers(3, 30))
    plan = parts.plan(batch, budget, block_size=8)
    parent = batch.parent_token.numpy()
    assert plan.parts[0].start == 0 and plan.parts[-1].end == batch.num_tokens
    predicted = []
    for a, b in zip(plan.parts, plan.parts[1:]):
        assert a.end == b.start
    for p in plan.parts:
        assert 1 <= p.num_tokens <= budget  # a part of one token runs padded
        # the context is the path from the root to the part's first token
        path, t = [], parent[p.start]
        while t >= 0:
            path.append(t)
            t = parent[t]
        assert p.context.tolist() == sorted(path)
        assert p.context_pad % 8 == 0 and p.context_pad >= max(len(path), 8)
        predicted += p.label_tokens.tolist()
        assert np.all(parent[p.label_tokens] - p.start == p.label_rows)
    assert sorted(predicted) == np.flatnonzero(parent >= 0).tolist()
    # every part runs its backward once; what is held stays within one part plus a path
    done = []
    for j, held in parts.schedule(plan):
        assert j in held
    held = []
    for part in plan.parts:
        held.append(part.index)
        for i in parts.ready(plan, held, part.end):
            held.remove(i)
            done.append(i)
    assert sorted(done) == list(range(plan.num_parts)) and not held
    assert plan.peak_held_tokens() <= budget
    # nothing is recomputed while every root-to-leaf path leaves a quarter of the budget
    longest = max(t.sequence_lengths.max() for t in trees)
    if longest <= budget - max(1, budget // 4):
        assert plan.recompute_tokens == 0
    _check_held(plan)
    # merging parts never raises the peak past the budget
    monkeypatch.setattr(parts.planner, "fewer_parts", lambda ranges, *_: ranges)
    unmerged = parts.plan(batch, budget, block_size=8)
    assert plan.num_parts <= unmerged.num_parts
    assert unmerged.peak_held_tokens() <= budget


def _check_held(plan):
    """The planner's closed form of what is held (used to merge parts) is the schedule's,
    and the recompute parts held at any time hold keys and values of the current part's
    context only (so ``peak_context_tokens`` bounds them)."""
    starts, ends, release, rec = (np.array([getattr(q, a) for q in plan.parts])
                                  for a in ("start", "end", "release", "recompute"))
    held_model = parts.merge.held_tokens(starts, ends, release, rec)
    held_run = [sum(plan.parts[i].num_tokens for i in h if i == j or not rec[i])
                for j, h in parts.schedule(plan)]
    assert held_model.tolist() == held_run
    assert max(held_run) == plan.peak_held_tokens() <= plan.max_tokens
    for j, h in parts.schedule(plan):
        ctx = set(plan.parts[j].context.tolist())
        for i in h:
            if i != j and rec[i]:
                assert set(range(starts[i], ends[i])) <= ctx, (i, j)


def comb_tree(seed: int, calls: int = 8, trunk=(2, 7), leaf=(1, 6)):
    """A coding agent's calls as one tree: a trunk (the conversation) that grows call by
    call, each call's completion a leaf off it. Some trunk and leaf nodes are one token, and
    the conversation half-way is a sequence of its own (a prefix of every later call)."""
    rng = np.random.default_rng(seed)
    convo, seqs = [], []
    for i in range(calls):
        convo = convo + rng.integers(1, VOCAB, 1 if i % 3 == 1 else rng.integers(*trunk)).tolist()
        seqs.append(convo + rng.integers(1, VOCAB, 1 if i % 4 == 2 else rng.integers(*leaf)).tolist())
        if i == calls // 2:
            seqs.append(list(convo))
    return treefx.Tree.from_sequences(seqs)


@pytest.mark.parametrize("seed", range(8))
def test_comb_trees_hold_at_most_the_budget(seed):
    """Every trunk node's subtree is over the budget, so the whole trunk is open: the parts
    past what the budget holds are recomputed, the activations held stay within it, and the
    keys and values kept for later parts are the longest open path's."""
    rng = np.random.default_rng(seed)
    trees = [comb_tree(seed, calls=int(rng.integers(6, 30)))]
    if seed % 2:
        trees.append(comb_tree(seed + 100, calls=5))
    batch = treefx.pack(trees)
    pos = batch.position_ids[0].numpy()
    path = int(pos[:batch.num_real_tokens].max()) + 1  # the longest root-to-leaf path
    for budget in (1, 2, 3, 5, 8, 13, 40):
        plan = parts.plan(batch, budget, block_size=8)
        assert plan.peak_held_tokens() <= budget
        _check_held(plan)
        # the longest context a part reads: the deepest token's path, but for the tokens of
        # its own part
        assert plan.peak_context_tokens() == max(int(pos[p.start]) for p in plan.parts)
        assert plan.peak_context_tokens() >= path - budget
        # a path longer than the budget cannot be held: recomputed is what it lacks at least
        assert plan.recompute_tokens >= path - budget > 0
        assert plan.recompute_tokens == sum(p.num_tokens for p in plan.parts if p.recompute)
        assert all(p.open for p in plan.parts if p.recompute)
        # only nodes with children are recomputed while every leaf fits the smallest room
        leaf_len = batch.node_length[batch.subtree_end[batch.node_offset] ==
                                     batch.node_offset + batch.node_length]
        if leaf_len.max() <= max(1, budget // 4):
            has_child = np.zeros(batch.num_tokens, dtype=bool)
            par = batch.parent_token.numpy()
            has_child[par[par >= 0]] = True
            node_of = np.repeat(np.arange(len(batch.node_offset)), batch.node_length.numpy())
            inner = np.zeros(len(batch.node_offset), dtype=bool)
            inner[node_of[par[par >= 0]]] = True
            for p in plan.parts:
                if p.recompute:
                    assert inner[node_of[p.start:p.end]].all()


def _count_forwards(monkeypatch):
    """Each part graph call, as whether it built a graph (grad mode)."""
    calls = []
    call = treefx.run.parts.PartRunner.__call__

    def counting(self, t, *rest):
        calls.append(torch.is_grad_enabled())
        return call(self, t, *rest)

    monkeypatch.setattr(treefx.run.parts.PartRunner, "__call__", counting)
    return calls


@pytest.mark.parametrize("name,checkpointing,budgets", [
    ("qwen3", False, (4, 9)),
    pytest.param("qwen3", True, (6,), marks=pytest.mark.slow),  # ~20 s each: checkpointed
    ("qwen3_next", False, (7,)),    # conv inputs and GDN states of recomputed parts
    pytest.param("qwen3_next", True, (5,), marks=pytest.mark.slow),
])
def test_comb_trees_recompute_parts_and_match_the_oracle(name, checkpointing, budgets,
                                                         monkeypatch, shared):
    """Recompute parts on comb trees: their forward runs without a graph, their backward
    runs it again with one (each once), and the loss and every gradient are each
    sequence's alone, with activation checkpointing too."""
    if checkpointing:
        model = _hybrid() if name == "qwen3_next" else hf_model(name, "sdpa")
        enable_activation_checkpointing(model, use_reentrant=False)
        model.train()
        tm = treefx.compile(model, backend="eager", verify=False)
    else:
        tm = shared(name)
        model = tm.model
    trees = [comb_tree(1, calls=9), comb_tree(2, calls=4)]
    calls = _count_forwards(monkeypatch)
    for b in budgets:
        plan = parts.plan(treefx.pack(trees), b)
        assert plan.recompute_tokens > 0 and plan.peak_held_tokens() <= b
        calls.clear()
        model.zero_grad(set_to_none=True)
        _check(tm, trees, b)
        recomputed = sum(p.recompute for p in plan.parts)
        assert calls.count(False) == recomputed  # the forward without a graph, once
        assert calls.count(True) == plan.num_parts  # the others and each recompute again


def test_recompute_parts_refuse_random_draws():
    """A second forward would draw other dropout masks: a plan that recomputes parts of a
    model with dropout in training mode is an error before any gradient is added."""
    model = hf_model("gpt2", "sdpa")
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Dropout) and "attn" not in n:  # (attention dropout is refused)
            m.p = 0.1
    model.train()
    tm = treefx.compile(model, backend="eager", verify=False)
    trees = [comb_tree(3, calls=6)]
    assert parts.plan(treefx.pack(trees), 6).recompute_tokens > 0
    with pytest.raises(treefx.TreeCompileError, match="draws random numbers.*dropout"):
        treefx.backward(tm, trees, max_tokens=6)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    # a budget that holds every path recomputes nothing and runs
    treefx.backward(tm, trees, max_tokens=1000)


@pytest.mark.parametrize("name,reentrant,budgets", [
    # in CI: the hybrid, whose checkpointed layers hand on keys and values (its attention
    # layers) as well as conv inputs and GDN states; Qwen3's attention-only layers -m slow
    pytest.param("qwen3", False, (3, 1000), marks=pytest.mark.slow),
    pytest.param("qwen3", True, (7,), marks=pytest.mark.slow),
    ("qwen3_next", False, (13,)),   # conv inputs and GDN states leave checkpointed layers
])
def test_activation_checkpointing_in_parts_matches_the_oracle(name, reentrant, budgets):
    """Hugging Face gradient checkpointing (either form): each layer is a checkpointed body;
    its keys, values, conv inputs and exit states leave the body as extra outputs for later
    parts, and the context enters it as extra operands, so a part's backward recomputes its
    layers and nothing else."""
    model = _hybrid() if name == "qwen3_next" else hf_model(name, "sdpa")
    enable_activation_checkpointing(model, use_reentrant=reentrant)
    model.train()
    tm = treefx.compile(model, backend="eager", verify=False)
    trees = [odd_tree(5, VOCAB), *odd_forest(4, VOCAB)] if name == "qwen3_next" else \
        odd_forest(3, VOCAB)
    for b in budgets:
        model.zero_grad(set_to_none=True)
        _check(tm, trees, b)
    ctx = runners(tm)[0].engine.contexts[-1]
    bodies = [c for c in ctx.scopes() if c.parent is not None]
    assert len(bodies) == model.config.num_hidden_layers  # every layer checkpointed
    assert all(r.pass_name != "attention" or "context" in r.note for r in ctx.log)


@pytest.mark.parametrize("name,form", [  # in CI: gpt-oss (sinks and windows); the others slow
    pytest.param("gemma2", "score_mod", marks=pytest.mark.slow), ("gpt_oss", "sink"),
    pytest.param("granite_swa", "log-sum-exp", marks=pytest.mark.slow)])
def test_scored_attention_in_parts_matches_the_oracle(name, form):
    """Scores the model transforms itself, across part boundaries: Gemma 2's softcap and
    window (a score_mod and a mask_mod at the extended row's positions), gpt-oss's sinks
    and Granite-SWA's ``sigmoid(lse - sink)`` (both from the part's log-sum-exp over
    [context; part])."""
    from test_scored_attention import scored_model

    tm = treefx.compile(scored_model(name), backend="eager", verify=False)
    _check(tm, odd_forest(3, VOCAB), 3)
    notes = [r.note for r in runners(tm)[0].engine.contexts[-1].log
             if r.pass_name == "attention" and "not attention" not in r.note]
    assert len(notes) == 2 and all("context" in n and "scored" in n for n in notes), notes
    if form != "score_mod":
        assert all(form in n for n in notes), notes
    else:
        assert all("score_mod" in n for n in notes), notes


def test_a_packed_batch_keeps_its_normalization(shared):
    """A batch packed with a global count and a scale (as treefx.distributed.pack packs a
    rank's share) trains in parts to the same loss and gradients as those trees given with
    the same options."""
    tm = shared("qwen3")
    model = tm.model
    trees = odd_forest(3, VOCAB)
    opts = dict(reduction="sum", num_sequences=40, loss_scale=2.0)
    loss = treefx.backward(tm, trees, max_tokens=5, **opts)
    ref = grads(model)
    got_loss = treefx.backward(tm, treefx.pack(trees, **opts), max_tokens=5)
    got = grads(model)
    assert float(got_loss) == pytest.approx(float(loss), rel=1e-6)
    own = sum(t.num_sequences for t in trees)
    ref_loss = treefx.reference.sequence_loss(model, trees, reduction="sum").detach()
    model.zero_grad(set_to_none=True)
    assert float(loss) == pytest.approx(float(ref_loss) * own * 2.0 / 40, rel=1e-5)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-7)


def test_regional_parts_match_the_oracle():
    """regional=True: the part graph cut at the decoder layers (several sizes vary per call:
    tokens, context, labels, states), its gradients through autograd only (no .grad buffers
    passed to a regional graph)."""
    tm = treefx.compile(hf_model("qwen3", "sdpa"), backend="eager", regional=True,
                        verify=False)
    _check(tm, odd_forest(3, VOCAB), 7, rtol=1e-5)
    (runner,) = runners(tm)
    assert runner.engine.plan.grad_params == () and runner.embedding is None
    assert len(runner.engine._regional) == 1


# Through AOTAutograd (Inductor's path) -m slow: 45 s of CI on its own, 11 s eagerly.
@pytest.mark.parametrize("backend", ["eager", pytest.param("aot-eager", marks=pytest.mark.slow)])
def test_parts_make_their_own_loss_fused_with_the_output_projection(backend):
    """treefx.backward's own objective (no ``loss_fn``): each part's graph makes its tree loss
    with the output projection (its gradients made in the forward: three products with the
    output weight, not four), the log-probabilities a by-product the first-call check reads;
    with a ``loss_fn`` the graph hands out differentiable log-probabilities. Both equal the
    oracle, and each other."""
    from treefx.ops.cross_entropy import fused_linear_tree_loss_and_logprobs
    from treefx.ops.logprobs import fused_linear_tree_logprobs

    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, backend=backend, verify=True)
    trees = odd_forest(3, VOCAB)
    _check(tm, trees, 7, rtol=1e-5)
    (own,) = runners(tm)
    assert own.own_loss and own.verification.passed
    targets = {n.target for n in own.engine.contexts[-1].graph.nodes}
    assert fused_linear_tree_loss_and_logprobs in targets
    assert fused_linear_tree_logprobs not in targets
    own_loss = treefx.backward(tm, trees, max_tokens=7)
    first = grads(model)
    loss = treefx.backward(tm, trees, max_tokens=7, loss_fn=treefx.tree_loss)
    lp_runner = [r for r in runners(tm) if not r.own_loss]
    assert len(lp_runner) == 1 and lp_runner[0].verification.passed
    targets = {n.target for n in lp_runner[0].engine.contexts[-1].graph.nodes}
    assert fused_linear_tree_logprobs in targets
    second = grads(model)
    assert set(second) == set(first) and first
    for name, g in second.items():
        torch.testing.assert_close(g, first[name], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss, own_loss, rtol=1e-6, atol=0)


def test_parts_own_loss_on_logits_the_model_transforms():
    """A final softcap: the logits are not the output projection's, so the part's own loss is
    made from the built logits (with a warning), and still equals the oracle (Gemma 2's
    softcaps and window)."""
    tm = treefx.compile(hf_model("gemma2", "eager"), backend="aot-eager", verify=True)
    _check(tm, odd_forest(3, VOCAB), 7)
    (runner,) = runners(tm)
    assert runner.own_loss and runner.verification.passed
    notes = [r.note for r in runner.engine.contexts[-1].log if r.pass_name == "logprobs"]
    assert notes and all(n.startswith("the loss, the logits are built") for n in notes), notes


def test_parts_run_regionally_by_default_where_whole_batches_do(monkeypatch):
    """``regional=None``: where a compiled model's whole batches run layer by layer (Inductor,
    two decoder layers or more), so do its parts (measured 1-4% faster per step on the GPU,
    and the first step no longer compiles the whole stack); their gradients then go through
    autograd. The eager backend stands in for Inductor on the CPU; the first call's probe
    check runs on the regional part graph too."""
    from treefx.run import engine as engine_mod

    monkeypatch.setattr(engine_mod, "REGIONAL_BY_DEFAULT", ("eager",))
    tm = treefx.compile(hf_model("qwen3", "sdpa"), backend="eager", verify=True)
    _check(tm, odd_forest(3, VOCAB), 7, rtol=1e-5)
    (runner,) = runners(tm)
    assert runner.autograd_only and runner.engine.plan.grad_params == ()
    assert len(runner.engine._regional) == 1 and runner.verification.passed
    step = treefx.step(lambda m, b: m(**b).loss, backend="eager")
    assert not step.engine.uses_regions(tm.model, None, "eager")  # a step keeps the whole graph


def test_a_default_regional_capture_that_fails_falls_back_to_the_whole_graph(monkeypatch,
                                                                                caplog):
    """Regional execution chosen by default whose capture fails to compile (before any of it
    ran): the part runs as the whole graph, with a warning, and equals the oracle; asked for
    (``regional=True``), the error stands."""
    from treefx.run import engine as engine_mod
    from treefx.run import regional as regional_mod

    def fail(*args, **kwargs):
        raise RuntimeError("a capture that does not compile")

    monkeypatch.setattr(engine_mod, "REGIONAL_BY_DEFAULT", ("eager",))
    monkeypatch.setattr(regional_mod, "build", fail)
    tm = treefx.compile(hf_model("qwen3", "sdpa"), backend="eager", verify=False)
    with caplog.at_level("WARNING", logger="treefx"):
        _check(tm, odd_forest(3, VOCAB), 7, rtol=1e-5)
    assert "whole graph, not layer by layer" in caplog.text
    (runner,) = runners(tm)
    assert not any(runner.engine._regional.values()) and runner.engine.num_compilations >= 1
    tm = treefx.compile(hf_model("qwen3", "sdpa"), backend="eager", verify=False,
                        regional=True)
    with pytest.raises(Exception, match="does not compile"):
        treefx.backward(tm, odd_forest(3, VOCAB), max_tokens=7)


def test_regional_parts_with_a_sliding_window(monkeypatch):
    """A part's FlexAttention site lists only the key blocks within a sliding window, a block
    count known when the op runs: regional execution's fake run of the piece pads by it (with
    ``F.pad`` it failed: ``constant_pad_nd``'s kernel wants concrete sizes outside a trace)."""
    from test_window_blocks import long_trees

    monkeypatch.setattr(treefx.run.backends, "compile_graph",
                        lambda backend, gm, ex, options=None: gm.forward)
    monkeypatch.setenv("TREEFX_INDUCTOR_ON_CPU", "1")
    tm = treefx.compile(hf_model("mistral", "sdpa"), backend="inductor", verify=False,
                        block_size=16, regional=True)
    _check(tm, long_trees(VOCAB), 48)
    (runner,) = runners(tm)
    assert runner.engine._regional


@pytest.mark.slow  # in CI: tests/test_distributed_parts.py, FSDP2 and DDP on two processes
def test_ddp_and_fsdp2_models_train_in_parts(tmp_path):
    """In a group of one process (gloo): a DDP model's parts run on its inner module and its
    first call is probed there (no collective); an FSDP2 model's parts run regionally, not
    probed. Both equal the oracle. Two processes, different numbers of parts per rank and a
    rank without trees: tests/test_distributed_parts.py."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        trees = odd_forest(3, VOCAB)
        tm = treefx.compile(DistributedDataParallel(hf_model("qwen3", "sdpa")),
                            backend="eager", verify=True)
        _check(tm, trees, 5, rtol=1e-5)
        assert runners(tm)[0].verification.passed
        model = hf_model("qwen3", "sdpa")
        ref_loss, ref = _oracle(model, trees)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        tm = treefx.compile(model, backend="eager", verify=True)
        # under FSDP2 the plan has no recompute parts (their second forward would gather the
        # layers once more than other ranks' backwards): what the budget cannot hold is held
        assert treefx.parts.plan(treefx.pack(trees), 5).recompute_tokens > 0
        assert treefx.parts.plan(treefx.pack(trees), 5, recompute=False).peak_held_tokens() > 5
        loss = treefx.backward(tm, trees, max_tokens=5)
        assert "not checked" in runners(tm)[0].verification
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), ref[name], rtol=1e-5, atol=1e-7)
        with pytest.raises(ValueError, match="no trees"):
            treefx.backward(treefx.compile(hf_model("qwen3", "sdpa"), backend="eager",
                                           verify=False), [], max_tokens=5)
    finally:
        dist.destroy_process_group()


def test_bad_arguments():
    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, backend="eager", verify=False)
    with pytest.raises(ValueError, match="max_tokens"):
        treefx.backward(tm, odd_forest(3, VOCAB), max_tokens=0)
    with pytest.raises(TypeError, match="treefx.compile"):
        treefx.backward(model, odd_forest(3, VOCAB), max_tokens=8)
    step = treefx.step(lambda m, b: m(**b).loss)
    with pytest.raises(TypeError, match="needs the model it trains as model="):
        treefx.backward(step, odd_forest(3, VOCAB), max_tokens=8)
    with pytest.raises(TypeError, match="computes its own loss"):
        treefx.backward(step, odd_forest(3, VOCAB), max_tokens=8, model=model,
                        reduction="sum")
    with pytest.raises(TypeError, match="model= goes with a @treefx.step"):
        treefx.backward(tm, odd_forest(3, VOCAB), max_tokens=8, model=model)
    with pytest.raises(TypeError, match="carries its own reduction"):
        treefx.backward(tm, treefx.pack(odd_forest(3, VOCAB)), max_tokens=8, reduction="sum")


# slow: in CI the window case below runs Mistral's part graph this way (and checks the layout)
@pytest.mark.parametrize("name", [pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("mistral", marks=pytest.mark.slow)])
def test_flex_attention_part_sites_match_the_oracle(name, monkeypatch):
    """The inductor backend's part graph (FlexAttention over [context; part], the window as
    its mask_mod), run op by op on the CPU: FlexAttention's eager form differentiates there,
    Inductor's kernels need a GPU (gpu_check --cases trunk,intervals checks parts there)."""
    monkeypatch.setattr(treefx.run.backends, "compile_graph",
                        lambda backend, gm, ex, options=None: gm.forward)
    monkeypatch.setenv("TREEFX_INDUCTOR_ON_CPU", "1")  # the inductor backend's graph on the CPU
    model = hf_model(name, "sdpa")
    tm = treefx.compile(model, backend="inductor", verify=False)
    _check(tm, odd_forest(3, VOCAB), 7)
    sites = [r.after for r in runners(tm)[0].engine.contexts[-1].log
             if r.pass_name == "attention"]
    assert sites and all("tree_part_flex_attention" in s for s in sites)
    # in training the KV heads are interleaved along the query and key rows, as whole trees
    # (run regionally, as the inductor backend runs by default, layers alike share one
    # compiled piece: only the first one's sites run)
    ops = [n.target for n in runners(tm)[0].engine.contexts[-1].graph.nodes
           if isinstance(n.target, TreePartFlexAttention)]
    assert ops and ops[0].layouts == {"interleaved"}
    assert all(op.layouts <= {"interleaved"} for op in ops)


def test_flex_part_sink_sites_keep_the_usual_layout(monkeypatch):
    """gpt-oss's sinks in parts, the inductor backend's part graph run op by op: the sites
    that return their log-sum-exp keep the usual layout (the interleaved one failed in
    Inductor's backward on the H100), and match the oracle."""
    from test_scored_attention import scored_model

    monkeypatch.setattr(treefx.run.backends, "compile_graph",
                        lambda backend, gm, ex, options=None: gm.forward)
    monkeypatch.setenv("TREEFX_INDUCTOR_ON_CPU", "1")  # the inductor backend's graph on the CPU
    tm = treefx.compile(scored_model("gpt_oss"), backend="inductor", verify=False)
    _check(tm, odd_forest(3, VOCAB), 7)
    ops = [n.target for n in runners(tm)[0].engine.contexts[-1].graph.nodes
           if isinstance(n.target, TreePartFlexAttention)]
    assert ops and all(op.return_lse and op.layouts == {"standard"} for op in ops)


def test_flex_part_sites_leave_blocks_beyond_the_window_out(monkeypatch):
    """Mistral's window of 3 with blocks of 16 over trees of long sequences: the part sites
    list only the key blocks (of the context and of the part) within the window, and the
    gradients still match the oracle."""
    from test_window_blocks import long_trees

    monkeypatch.setattr(treefx.run.backends, "compile_graph",
                        lambda backend, gm, ex, options=None: gm.forward)
    monkeypatch.setenv("TREEFX_INDUCTOR_ON_CPU", "1")  # the inductor backend's graph on the CPU
    tm = treefx.compile(hf_model("mistral", "sdpa"), backend="inductor", verify=False,
                        block_size=16)
    _check(tm, long_trees(VOCAB), 48)
    notes = [r.note for r in runners(tm)[0].engine.contexts[-1].log
             if r.pass_name == "attention"]
    assert notes and all("beyond its window (2)" in n for n in notes), notes
    # in training the KV heads are interleaved along the query and key rows, as whole trees
    ops = [n.target for n in runners(tm)[0].engine.contexts[-1].graph.nodes
           if isinstance(n.target, TreePartFlexAttention)]
    assert ops and all(op.layouts == {"interleaved"} for op in ops)


def test_first_call_checks_the_part_graph(monkeypatch):
    """With verification on (the default), the first treefx.backward of a model runs the
    probe forest in parts against the oracle: a part graph that reads its context wrongly
    is refused before any training."""
    import treefx.compiler.lower.parts as part_mode

    def zeros(buf, offset, heads, dim, dtype):  # every context key and value read as 0
        return torch.zeros(1, heads, buf.shape[0], dim, dtype=dtype, device=buf.device)

    monkeypatch.setattr(part_mode, "columns_to_heads", zeros)
    tm = treefx.compile(hf_model("qwen3", "sdpa"), backend="eager", verify=True)
    with pytest.raises(treefx.TreeVerificationError, match="differs from each sequence"):
        treefx.backward(tm, odd_forest(3, VOCAB), max_tokens=7)


def _hf_labels_step(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 labels=batch["labels"]).loss


def _hand_sum_step(model, batch):
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum")
    return 0.5 * ce


@pytest.mark.parametrize("name,fn,reduction,scale,budgets", [
    ("qwen3", _hf_labels_step, "mean", 1.0, (3, 7, 1000)),  # HF's loss: fused projection
    pytest.param("qwen3_next", _hand_sum_step, "sum", 0.5, (5,),  # hand-written, conv + GDN
                 marks=pytest.mark.slow),
])
def test_step_in_parts_matches_the_oracle(name, fn, reduction, scale, budgets):
    """A @treefx.step function trains in parts: the step runs per part, its cross-entropy
    reads the part's predicted tokens (the first tokens of later parts included) with their
    weights, and the loss and every gradient are the per-sequence oracle's (the step's own
    reduction and constant factor kept)."""
    model = _hybrid() if name == "qwen3_next" else hf_model(name, "sdpa")
    step = treefx.step(fn, backend="eager")
    trees = odd_forest(3, VOCAB)
    ref = treefx.reference.sequence_loss(model, trees, reduction=reduction) * scale
    ref.backward()
    want = grads(model)
    for b in budgets:
        loss = treefx.backward(step, trees, model=model, max_tokens=b)
        got = grads(model)
        torch.testing.assert_close(loss, ref.detach().to(loss.dtype), atol=1e-5, rtol=1e-5)
        for pname, g in want.items():
            err = float((got[pname] - g).abs().max() / g.abs().max().clamp(min=1e-12))
            assert err <= 1e-4, f"{pname}: relative gradient error {err:.2e} (budget {b})"
    (runner,) = runners(step)
    notes = [r.note for r in runner.engine.contexts[-1].log if r.pass_name == "loss"]
    assert len(notes) == 1


def test_step_in_parts_refuses_a_result_that_is_not_the_loss():
    model = hf_model("qwen3", "sdpa")
    step = treefx.step(lambda m, b: (_hf_labels_step(m, b), 1.0), backend="eager")
    with pytest.raises(TypeError, match="must return its loss alone"):
        treefx.backward(step, odd_forest(3, VOCAB), model=model, max_tokens=7)


def test_part_embedding_gradient_rows_equal_the_dense_gradient():
    """The part's rows of the embedding gradient, summed per id and added at its ids, equal
    F.embedding's dense gradient (duplicates summed, the padding id's row left out)."""
    from treefx.run.parts.executor import add_embedding_grad

    torch.manual_seed(0)
    weight = torch.randn(11, 6, requires_grad=True)
    ids = torch.tensor([[3, 5, 3, 0, 7, 5, 3]])
    upstream = torch.randn(1, 7, 6)
    (F.embedding(ids, weight, padding_idx=0) * upstream).sum().backward()
    want = weight.grad.clone()
    weight.grad = torch.ones_like(weight)  # added to, like AccumulateGrad
    sink = torch.zeros(7, 6, requires_grad=True)
    (part_embedding(ids, weight, sink, 0) * upstream).sum().backward()
    assert weight.grad.eq(1).all()  # no gradient to the weight itself
    rows, inverse = ids[0].unique(return_inverse=True)
    add_embedding_grad(weight, sink.grad, rows, inverse)
    torch.testing.assert_close(weight.grad, want + 1)


def _routed(tm):
    """The linear layers and fused log-prob sites of the last part graph (its bodies too)
    that add their weight's gradient into ``.grad`` themselves."""
    from treefx.ops.grad_into import linear_grad_into
    from treefx.ops.logprobs import fused_linear_tree_logprobs

    ctx = runners(tm)[0].engine.contexts[-1]
    nodes = [n for c in ctx.scopes() for n in c.graph.nodes]
    return (sum(n.target is linear_grad_into for n in nodes),
            sum(n.target is fused_linear_tree_logprobs and n.kwargs.get("grad_into") is not None
                for n in nodes))


@pytest.mark.parametrize("own_loss", [True, False], ids=["own-loss", "loss_fn"])
def test_weight_gradients_are_added_into_grad_by_the_parts_backward(own_loss):
    """Every linear layer's weight adds its gradient into the parameter's ``.grad`` in a
    part's backward (autograd gets no per-part gradient of them to add), and so does the
    output projection of the fused log-probabilities (with a ``loss_fn``); that of
    treefx.backward's own loss, made in the forward, goes through autograd. The same ``.grad``
    tensors, holding what was there plus the oracle's gradient."""
    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, backend="eager", verify=False)
    trees = odd_forest(3, VOCAB)
    _, ref = _oracle(model, trees)
    gen = torch.Generator().manual_seed(1)
    before = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = before[n].clone()
    held = {n: p.grad for n, p in model.named_parameters()}
    treefx.backward(tm, trees, max_tokens=5,
                    loss_fn=None if own_loss else treefx.tree_loss)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert _routed(tm) == (linears - 1, 0 if own_loss else 1)
    for n, p in model.named_parameters():
        assert p.grad is held[n], n
        # each part's addition into a .grad of N(0, 1) values rounds by up to 2.4e-7 (36
        # parts at this budget, some recomputed): within 1e-4 of the largest gradients (~3e-2)
        torch.testing.assert_close(p.grad - before[n], ref[n], atol=3e-6, rtol=1e-4)


def test_a_weight_with_a_gradient_hook_gets_its_gradient_through_autograd():
    """A hook on a parameter (``register_hook``) sees its gradient: treefx adds neither its
    part rows (the input embedding) nor a linear layer's product into ``.grad`` past it."""
    model = hf_model("qwen3", "sdpa")
    seen: dict[str, list] = {}
    names = ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight")
    params = dict(model.named_parameters())
    for n in names:
        params[n].register_hook(lambda g, n=n: seen.setdefault(n, []).append(g.clone()))
    tm = treefx.compile(model, backend="eager", verify=False)
    trees = odd_forest(3, VOCAB)
    ref_loss, ref = _oracle(model, trees)
    seen.clear()
    loss = treefx.backward(tm, trees, max_tokens=5)
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype), atol=1e-5, rtol=1e-5)
    got = grads(model)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-6, rtol=1e-4)
    for n in names:
        assert len(seen[n]) > 1  # once per part that reads it
        torch.testing.assert_close(sum(seen[n]), ref[n], atol=1e-6, rtol=1e-4)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert _routed(tm)[0] == linears - 2


def test_freezing_a_weight_between_calls_captures_the_part_graph_again(shared):
    # The first call on the shared model (its part graph captured here or by an earlier test
    # of this module: the last of them in the file), the second after freezing a weight; the
    # weight trains again afterwards, and a later call captures once more.
    tm = shared("qwen3")
    model = tm.model
    trees = odd_forest(3, VOCAB)
    _check(tm, trees, 5)
    first = runners(tm)[0].engine
    weight = model.model.layers[0].mlp.up_proj.weight
    weight.requires_grad_(False)
    try:
        _check(tm, trees, 5)  # the frozen weight gets no .grad, as in the oracle
        assert runners(tm)[0].engine is not first
        assert weight.grad is None
    finally:
        weight.requires_grad_(True)


@pytest.mark.slow
def test_checkpointed_layers_add_their_weight_gradients_into_grad_under_aot_autograd():
    """Under AOTAutograd an activation-checkpointed layer's linear layers add into ``.grad``
    too (the ``.grad`` enters the body as an operand; eagerly run bodies are left alone: the
    checkpoint checks its operands are unchanged when it recomputes)."""
    model = hf_model("qwen3", "sdpa")
    enable_activation_checkpointing(model, use_reentrant=False)
    model.train()
    tm = treefx.compile(model, backend="aot-eager", verify=False)
    _check(tm, odd_forest(3, VOCAB), 5)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert _routed(tm) == (linears - 1, 0)  # the output projection: treefx.backward's own loss


def test_parts_under_autocast_leave_the_weight_gradients_to_autograd():
    """Under the caller's ``torch.autocast`` the linear layers compute in bf16 as the whole
    tree's do; a custom op would run them in float32, so none adds into ``.grad`` itself."""
    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, backend="eager", verify=False)
    trees = odd_forest(3, VOCAB)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref = _oracle(model, trees)  # each sequence alone, under the same autocast
        loss = treefx.backward(tm, trees, max_tokens=5)
    assert _routed(tm) == (0, 0)
    got = grads(model)
    assert set(got) == set(ref)
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype), atol=2e-2, rtol=2e-2)
    for n, g in ref.items():
        err = float((got[n] - g).norm() / g.norm().clamp(min=1e-12))
        assert err <= 5e-2, f"{n}: {err:.2e}"


def test_parts_copy_no_row_back_and_forget_their_rows(monkeypatch):
    """Every part's rows the ops read on the host (here the leading chain's length,
    TREEFX_TRUNK_ATTENTION=1) are found in the host copies kept for it until its backward:
    nothing is copied back from the device (on a GPU each copy waits for its queue), and no
    row stays kept after the call."""
    from treefx import layout
    from treefx.ops import host_row

    monkeypatch.setattr(treefx.run.backends, "compile_graph",
                        lambda backend, gm, ex, options=None: gm.forward)
    monkeypatch.setenv("TREEFX_INDUCTOR_ON_CPU", "1")
    monkeypatch.setenv("TREEFX_TRUNK_ATTENTION", "1")
    copies = []
    copy = host_row.host_row
    monkeypatch.setattr(host_row, "host_row", lambda t: copies.append(t.shape) or copy(t))
    tm = treefx.compile(hf_model("qwen3", "sdpa"), backend="inductor", verify=False,
                        block_size=16)
    trees = [comb_tree(3, calls=12, trunk=(5, 20))]
    assert treefx.parts.plan(treefx.pack(trees), 40, block_size=16).num_parts > 16
    _check(tm, trees, 40)
    assert copies == [] and layout._PINNED_ROWS == {}


def test_inert_padding_tokens_keep_gradients_finite():
    """A part shorter than two tokens is padded with inert tokens. Their id was 0, Gemma 3n's
    padding id, whose zero embedding row made its AltUp take sqrt(0) and every gradient
    below it NaN in parts of 9 tokens (the loss itself exact). The pad is the part's own
    last token now: gradients finite and equal to each sequence alone."""
    from treefx.tools import zoo

    model = zoo.build_model("gemma3n_text", torch.float32)
    tm = treefx.compile(model, backend="eager", verify=False)
    trees = zoo.probe_forest(zoo.VOCAB, zoo.special_token_ids(model.config))
    plan = parts.plan(treefx.pack(trees), 9)
    assert any(p.num_tokens < 2 for p in plan.parts)  # some part is padded
    _check(tm, trees, 9, rtol=1e-4)


class AddsIntoItsProjections(torch.nn.Module):
    """Adds into its embedding's and a projection's outputs in place (``+=``), as RoCBert's
    and Git's embeddings do: in parts those are treefx's custom ops, whose outputs must not be
    views (autograd forbids modifying a custom function's view output in place)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.pos = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, VOCAB)

    def get_input_embeddings(self):  # what treefx.backward routes to the part's rows
        return self.emb

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None]
        x = self.emb(input_ids)
        x += self.pos(position_ids)
        h = self.proj(x)
        h += x
        q, k, v = (t[:, None] for t in self.qkv(h).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]
        return self.head(out + h)


def test_in_place_adds_into_part_embeddings_and_projections():
    torch.manual_seed(0)
    tm = treefx.compile(AddsIntoItsProjections(), backend="eager", verify=False)
    _check(tm, odd_forest(3, VOCAB), 7)
    ctx = runners(tm)[0].engine.contexts[-1]
    targets = [n.target for c in ctx.scopes() for n in c.graph.nodes]
    assert part_embedding in targets and _routed(tm)[0] > 0  # both custom ops took part


class ChunkedFromZeros(MaskedAttention):
    """Llama 4's chunked mask: its left padding counted as ``zeros_like(..).sum(-1)`` (a
    reduction of a filled tensor: its one value, 0) and key chunks of 4 positions."""

    def mask(self, input_ids, x, b, qi, ki):
        pad = torch.zeros_like(input_ids).sum(-1)[:, None, None, None]
        return (ki <= qi) & ((ki - pad) // 4 == (qi - pad) // 4)


def test_a_mask_reading_a_reduced_filled_tensor_runs_in_parts():
    """In parts a model's mask is evaluated for the context's keys; the reduction of a filled
    tensor was refused there (Llama 4 in parts), and is its value now."""
    torch.manual_seed(0)
    tm = treefx.compile(ChunkedFromZeros(), backend="flex-eager", block_size=16, verify=False)
    _check(tm, odd_forest(3, VOCAB), 7)
