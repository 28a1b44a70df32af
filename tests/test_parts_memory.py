"""``treefx.backward(..., max_memory=)``: the memory model (:mod:`treefx.run.parts.memory`),
the sizes it reads, the token budget it plans, ``treefx stats --max-memory``, and a step
planned by it against the oracle."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support import VOCAB, grads, hf_model

import treefx
from treefx.models import enable_activation_checkpointing
from treefx.run.parts import memory as mem
from treefx.tools.cli import main
from treefx.tools.synth import odd_forest

GiB = 2 ** 30
# a hand-sized shape: h 8, i 16, 2 layers, 2 heads of 4, one KV head, vocabulary 32, float32
SMALL = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=4, vocab_size=32, torch_dtype="float32")


@pytest.mark.parametrize("text,expected", [
    ("40GiB", 40 * GiB), ("40 GiB", 40 * GiB), ("40gib", 40 * GiB), ("512MB", 512 * 10 ** 6),
    ("512MiB", 512 * 2 ** 20), ("1.5G", 3 * GiB // 2), ("2TB", 2 * 10 ** 12), ("1000", 1000),
    ("7B", 7), (1000, 1000), (".5KiB", 512),
])
def test_sizes(text, expected):
    assert mem.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "40 parsecs", "4 0GB", "-1GB", 0, -5, True, 1.5,
                                 None, "0.1B"])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="memory size"):
        mem.parse_size(bad)


def test_the_arithmetic_on_a_known_shape():
    """Every term by hand for SMALL (s = 4 bytes; q = 8, kv = 4)."""
    m = mem.from_config(SMALL, fixed_bytes=100)
    # a layer: 4·(4·8 + 2·8 + 2·4 + 4·16) + 4·(2 + 2) = 4·120 + 16 = 496 bytes a token;
    # the final norm 2·4·8 + 4 = 68
    assert m.per_token == 2 * 496 + 68 == 1060
    # checkpointed: the 2 layers' inputs (2·4·8) and one layer's activations
    assert mem.from_config(SMALL, checkpointing=True).per_token == 64 + 496 + 68 == 628
    # 2 attention layers × 2 × 1 KV head × 4 × 4 bytes, three times (kept, gradients, copy)
    assert m.context_per_token == 3 * 2 * 2 * 1 * 4 * 4 == 192
    # keys and values only at the softmax attention layers
    hybrid = {**SMALL, "layer_types": ["linear_attention", "full_attention"]}
    assert mem.from_config(hybrid).context_per_token == 192 // 2
    assert m.logit_row == 2 * 32 * 4 == 256
    assert m.chunk_rows == 4 * (1 << 27) // 32
    assert m.head_grad == 32 * 8 * 4 == 1024
    assert m.fixed == 100
    # each part held keeps the output weight's gradient its own loss made: 32·8·4 bytes;
    # none where a loss_fn takes the log-probabilities
    assert m.per_part == 32 * 8 * 4 == 1024
    assert mem.from_config(SMALL, fixed_bytes=100, own_loss=False).per_part == 0
    assert m.peak(10, 3) == 100 + 10 * 1060 + 1024 + 3 * 192 + 10 * 256 + 1024 == 15884
    assert m.peak(10, 3, parts=3) == 15884 + 2 * 1024
    # the per-token bytes that would have predicted a step 500 bytes heavier: 50 more a token
    assert m.calibrate(15884 + 500, 10, 3) == 1060 + 50
    assert m.calibrate(15884 + 2 * 1024 + 500, 10, 3, parts=3) == 1060 + 50
    assert m.calibrated("16384B", 10, 3).peak(10, 3) == 16384
    with pytest.raises(ValueError, match="leaves nothing"):
        m.calibrate(1000, 10, 3)
    # bfloat16 halves every activation byte but the float32 statistics
    b = mem.from_config(SMALL, dtype=torch.bfloat16)
    assert b.per_token == 2 * (2 * 120 + 16) + (2 * 2 * 8 + 4) == 548
    # the same from a transformers config object, and the short names of a shape
    cfg = pytest.importorskip("transformers").Qwen3Config(
        **{k: v for k, v in SMALL.items() if k != "torch_dtype"}, dtype="float32")
    assert mem.from_config(cfg, fixed_bytes=100) == m
    shape = mem.parse_shape("hidden=8,intermediate=16,layers=2,heads=2,kv_heads=1,head_dim=4,"
                            "vocab=32,dtype=float32")
    assert mem.from_config(shape, fixed_bytes=100) == m
    # parameters: embedding and head 2·32·8; a layer 8·(8+8) + 8·8 + 3·8·16 + 2·8 = 592
    assert mem.parameter_count(SMALL) == 512 + 2 * 592 + 8 == 1704
    assert mem.parameter_count({**SMALL, "tie_word_embeddings": True}) == 1704 - 256


def test_the_token_budget_on_a_known_shape():
    m = mem.from_config(SMALL, fixed_bytes=100)
    batch = treefx.pack(odd_forest(3, VOCAB))
    n, path = batch.num_tokens, mem.longest_path(batch)
    assert 1 < path < n
    # the whole batch in one part where it fits
    assert mem.tokens_for(m, m.peak(n, 0), batch) == n
    # else the largest T whose peak, with the longest path as the open path, fits
    budget = m.peak(7, path) + 1000
    assert mem.tokens_for(m, budget, batch) == 7 + 1000 // (1060 + 256) == 7
    assert mem.tokens_for(m, m.peak(8, path) - 1, batch) == 7
    assert mem.tokens_for(m, m.peak(8, path), batch) == 8
    with pytest.raises(ValueError, match="holds no token"):
        mem.tokens_for(m, m.peak(1, path) - 1, batch)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_larger_budget_never_gives_more_parts_and_the_peak_stays_under(seed, checkpointing):
    trees = treefx.synth.agent_tree(seed, vocab_size=VOCAB, rollouts=3, system_len=(40, 60),
                                    prompt_len=(10, 30), think_len=(20, 60),
                                    answer_len=(5, 20), tool_len=(20, 60))
    batch = treefx.pack(trees)
    m = mem.from_config(SMALL, checkpointing=checkpointing, fixed_bytes=10 ** 6)
    low, high = m.peak(4, mem.longest_path(batch)), m.peak(batch.num_tokens, 0) + 1
    last_raw, last_parts = 0, None
    for k in range(60):
        budget = low + (high - low) * k // 59
        tokens = mem.plan_tokens(m, budget, batch)
        assert tokens <= mem.tokens_for(m, budget, batch)
        plan = treefx.parts.plan(batch, tokens)
        assert m.plan_peak(plan) <= budget
        raw = mem.tokens_for(m, budget, batch)
        assert raw >= last_raw
        assert last_parts is None or plan.num_parts <= last_parts, (budget, tokens)
        last_raw, last_parts = raw, plan.num_parts
    assert last_parts == 1


def test_stats_max_memory(tmp_path, capsys):
    path = tmp_path / "trees.jsonl"
    main(["synth", "-o", str(path), "-n", "3", "--vocab-size", "128"])
    capsys.readouterr()
    config = tmp_path / "config.json"
    shape = dict(SMALL, vocab_size=128)
    config.write_text(json.dumps(shape))
    m = mem.from_config(shape, fixed_bytes=2 * mem.parameter_count(shape) * 4)
    trees = list(treefx.read_jsonl(path))
    budget = m.peak(300, max(mem.longest_path(treefx.pack(t)) for t in trees))
    for model in (str(config), str(tmp_path),
                  "hidden=8,intermediate=16,layers=2,heads=2,kv_heads=1,head_dim=4,vocab=128,"
                  "dtype=float32"):
        assert main(["stats", str(path), "--max-memory", str(budget), "--model", model]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith(f"memory model ({model}): {m.per_token:,} bytes a token held")
        header = out[1].split()
        assert header[-6:] == ["mem", "tokens", "mem", "parts", "mem", "peak"]
        rows = [line.split() for line in out[3:-2]]
        total_parts, peak = 0, 0
        for row, t in zip(rows, trees):
            batch = treefx.pack(t)
            tokens = mem.plan_tokens(m, budget, batch)
            plan = treefx.parts.plan(batch, tokens)
            assert row[-4:] == [str(tokens), str(plan.num_parts),
                                f"{m.plan_peak(plan) / GiB:.2f}", "GiB"]
            assert m.plan_peak(plan) <= budget
            total_parts += plan.num_parts
            peak = max(peak, m.plan_peak(plan))
        assert out[-1].split()[-3:] == [str(total_parts), f"{peak / GiB:.2f}", "GiB"]
    with pytest.raises(SystemExit):
        main(["stats", str(path), "--max-memory", "40GiB"])  # no --model
    assert "needs --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["stats", str(path), "--max-memory", "40 parsecs", "--model", str(config)])
    assert "not a memory size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["stats", str(path), "--model", str(config)])
    assert "--model goes with --max-memory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["stats", str(path), "--max-memory", "1KiB", "--model", str(config)])
    assert "holds no token" in capsys.readouterr().err


def test_backward_with_max_memory_matches_the_oracle():
    """The token budget max_memory plans (7 tokens here, in parts inside nodes) trains
    exactly: the loss and every gradient equal each sequence alone."""
    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, backend="eager", verify=False)
    trees = odd_forest(3, VOCAB)
    batch = treefx.pack(trees)
    m = mem.for_model(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert m.fixed == 2 * params  # on the CPU: the weights and their gradients
    assert m == mem.from_config(model.config, fixed_bytes=2 * params, dtype=torch.float32)
    enable_activation_checkpointing(model)  # by the name this transformers has
    assert mem.for_model(model) == mem.from_config(model.config, fixed_bytes=2 * params,
                                                   dtype=torch.float32, checkpointing=True)
    (getattr(model, "activation_checkpointing_disable", None)
     or model.gradient_checkpointing_disable)()
    path = mem.longest_path(batch)
    assert mem.tokens_for(m, m.peak(7, path), batch) == 7 < batch.num_tokens
    # the budget of the plan at 7 tokens, its held parts' output-weight gradients counted
    budget = m.plan_peak(treefx.parts.plan(batch, 7))
    assert budget > m.peak(7, path)  # it holds several parts at once
    planned = mem.plan_tokens(m, budget, batch)
    assert 7 <= planned < batch.num_tokens
    used = []
    real_plan = treefx.parts.plan

    def spy(batch, max_tokens, **kw):
        used.append(max_tokens)
        return real_plan(batch, max_tokens, **kw)

    loss_ref = treefx.reference.sequence_loss(model, trees, reduction="mean")
    loss_ref.backward()
    ref = grads(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(treefx.parts, "plan", spy)
        loss = treefx.backward(tm, trees, max_memory=budget)
    assert used[-1] == planned  # the executor's plan (after plan_tokens' search)
    got = grads(model)
    torch.testing.assert_close(loss, loss_ref.detach().to(loss.dtype), atol=1e-5, rtol=1e-5)
    assert set(got) == set(ref)
    for name, g in ref.items():
        err = float((got[name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err <= 1e-4, f"{name}: relative gradient error {err:.2e}"
    # both budgets: the smaller wins; a memory model given
    for kw, expected in ((dict(max_memory=budget, max_tokens=5), 5),
                         (dict(max_memory=budget, max_tokens=500), planned),
                         (dict(max_memory=f"{m.peak(9, path)}B", memory=m),
                          mem.plan_tokens(m, m.peak(9, path), batch))):
        used.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(treefx.parts, "plan", spy)
            treefx.backward(tm, trees, **kw)
        assert used[-1] == expected, kw
    model.zero_grad(set_to_none=True)
    with pytest.raises(TypeError, match="max_tokens= .* or max_memory="):
        treefx.backward(tm, trees)
    with pytest.raises(TypeError, match="memory= goes with max_memory="):
        treefx.backward(tm, trees, max_tokens=8, memory=m)
    with pytest.raises(TypeError, match="MemoryModel"):
        treefx.backward(tm, trees, max_memory="1GiB", memory=object())
    with pytest.raises(ValueError, match="holds no token"):
        treefx.backward(tm, trees, max_memory="1KiB")


@pytest.mark.parametrize("beyond", ["recompute", "host"])
def test_a_held_part_keeps_only_the_rows_later_parts_read(beyond):
    """A part keeps, of its own keys and values, only the rows later parts read as context
    (``PartPlan.exported_rows``), not every token's: the leaves [exported, W] and, where
    gradients come back, their gradients; the step stays exact."""
    from treefx.run.parts import executor

    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, backend="eager", verify=False)
    trees = [treefx.synth.agent_tree(5, vocab_size=VOCAB, rollouts=2, think_mode=True,
                                     system_len=(6, 12), prompt_len=(3, 8), think_len=(3, 9),
                                     answer_len=(2, 5), tool_len=(3, 9))]
    batch = treefx.pack(trees)
    plan = treefx.parts.plan(batch, 24, beyond=beyond)
    exported = plan.exported_rows
    # a plan whose parts read some, not all, of the rows before them
    assert 0 < sum(map(len, exported)) < batch.num_tokens - plan.parts[-1].num_tokens
    for p in plan.parts:
        owner = plan.part_of_token[p.context]
        for i in set(owner.tolist()):
            assert set((p.context[owner == i] - plan.parts[i].start).tolist()) <= \
                set(exported[i].tolist())
    kept = {}
    real_hold = executor._hold

    def spy(part, *a):
        h = real_hold(part, *a)
        kept[part.index] = (part.num_tokens, h.own_leaf.shape[0])
        return h

    loss_ref = treefx.reference.sequence_loss(model, trees, reduction="mean")
    loss_ref.backward()
    ref = grads(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(executor, "_hold", spy)
        loss = treefx.backward(tm, trees, max_tokens=24, beyond=beyond)
    assert {j: rows for j, (_, rows) in kept.items()} == \
        {j: len(r) for j, r in enumerate(exported)}
    assert sum(rows for _, rows in kept.values()) < sum(n for n, _ in kept.values())
    torch.testing.assert_close(loss, loss_ref.detach().to(loss.dtype), atol=1e-5, rtol=1e-5)
    got = grads(model)
    for name, g in ref.items():
        err = float((got[name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err <= 1e-4, f"{name}: relative gradient error {err:.2e}"


# ------------------------------------------------------------------ measured on the CPU

def test_live_bytes_counts_what_is_held_and_frees_it():
    """The CPU's measurement (:class:`treefx.tools.live_bytes.LiveBytes`): a storage counts
    from the op that makes it until no tensor, view or saved variable holds it."""
    from treefx.tools.live_bytes import LiveBytes

    mb = 4 * 2 ** 20
    with LiveBytes() as live:
        x = torch.zeros(2 ** 20, requires_grad=True)  # 4 MiB
        y = x * 2
        z = y.sin()  # saves y for its backward
        view = y[1:]
        del y
        assert live.live == 3 * mb  # y is held by z's graph and the view
        del view
        z.sum().backward()  # x.grad made
        del z
    assert live.live == 2 * mb and live.peak >= 4 * mb  # x and its gradient remain
    assert live.at_peak["zeros"] == mb


def _comb(seed: int, vocab: int) -> treefx.Tree:
    """An agent's tree: calls branching off one long trunk at random points."""
    import numpy as np

    rng = np.random.default_rng(seed)
    trunk = rng.integers(5, vocab, 300).tolist()
    return treefx.Tree.from_sequences([
        trunk[:int(rng.integers(50, 300))] + rng.integers(5, vocab, int(rng.integers(20, 120))
                                                           ).tolist() for _ in range(6)])


# without checkpointing under -m slow: the suite's time (the checkpointed case is the one the
# per-part term decides, 0.79 / 0.75 without it)
@pytest.mark.parametrize("checkpointing", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["plain", "checkpointing"])
def test_parts_hold_no_more_than_the_whole_tree_and_the_model_counts_their_parts(
        checkpointing):
    """Measured on the CPU (eager backend, float32): a step in parts holds at most what the
    whole tree's step holds, and the memory model's estimate of each plan is within 25% of
    what the step held (weights included; the eager backend's dense attention masks, which
    the GPU's kernels never build, are the rest). Without ``per_part`` (each held part's
    output-weight gradient) the estimate fell short by more as the parts got more: 0.79 and
    0.75 of the measured peak at a quarter and an eighth with checkpointing (0.93 and 0.85
    with it). Not yet true: that the peak falls as the budget falls (with checkpointing the
    quarter's parts held more than the half's, three output-weight gradients at once)."""
    from treefx.tools.live_bytes import LiveBytes

    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        attn_implementation="sdpa")).train()
    if checkpointing:
        enable_activation_checkpointing(model)
    tm = treefx.compile(model, backend="eager", verify=False)
    tree = _comb(0, 2048)
    batch = treefx.pack([tree])
    n = batch.num_tokens
    m = mem.for_model(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peaks, estimates = {}, {}
    for name, budget in (("whole", n), ("half", n // 2), ("quarter", n // 4),
                         ("eighth", n // 8)):
        model.zero_grad(set_to_none=True)
        with LiveBytes() as live:
            treefx.backward(tm, [tree], max_tokens=budget)
        peaks[name] = weights + live.peak
        plan = treefx.parts.plan(batch, budget)
        estimates[name] = m.plan_peak(plan)
        assert plan.num_parts > 1 or name == "whole"
    for name in ("half", "quarter", "eighth"):
        assert peaks[name] <= peaks["whole"], (name, peaks)
    for name, est in estimates.items():
        assert 0.8 <= est / peaks[name] <= 1.25, (name, est / peaks[name], peaks, estimates)
    without = dataclasses.replace(m, per_part=0)
    assert without.plan_peak(treefx.parts.plan(batch, n // 4)) < estimates["quarter"]


def test_the_weight_gradient_made_late_lets_the_peak_fall_with_the_budget(monkeypatch):
    """``TREEFX_PART_LOSS_GRAD_LATE=1``: a part graph's own loss makes the output weight's
    gradient in the backward, so held parts keep none. Measured on the CPU with
    checkpointing: the peak then falls as the budget falls (half, quarter, eighth; by default
    the quarter's parts held more than the half's, 15.96 against 14.80 MiB here), with the
    loss and every gradient equal to each sequence alone (float32) and the first-call check
    passed."""
    import transformers

    from treefx.ops.logprobs import fused_linear_tree_loss_and_logprobs_late
    from treefx.run.parts import runners
    from treefx.tools.live_bytes import LiveBytes

    monkeypatch.setenv("TREEFX_PART_LOSS_GRAD_LATE", "1")
    tree = _comb(0, 2048)
    n = treefx.pack([tree]).num_tokens
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        attn_implementation="sdpa")).train()
    enable_activation_checkpointing(model)
    treefx.reference.sequence_loss(model, [tree], reduction="mean").backward()
    ref = grads(model)
    tm = treefx.compile(model, backend="eager", verify=True)
    treefx.backward(tm, [tree], max_tokens=n // 2)  # the capture and first-call check
    model.zero_grad(set_to_none=True)
    (runner,) = runners(tm)
    assert runner.verification.passed
    targets = {nd.target for nd in runner.engine.contexts[-1].graph.nodes}
    assert fused_linear_tree_loss_and_logprobs_late in targets
    peaks = {}
    for name, budget in (("half", n // 2), ("quarter", n // 4), ("eighth", n // 8)):
        with LiveBytes() as live:
            loss = treefx.backward(tm, [tree], max_tokens=budget)
        peaks[name] = live.peak
        got = grads(model)
        assert got.keys() == ref.keys()
        for k, g in ref.items():
            torch.testing.assert_close(got[k], g, rtol=1e-4, atol=1e-6, msg=k)
    assert peaks["half"] >= peaks["quarter"] >= peaks["eighth"], peaks
    assert loss.item() == pytest.approx(
        treefx.reference.sequence_loss(model, [tree], reduction="mean").item(), rel=1e-5)
