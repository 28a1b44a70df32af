"""A first step in parts no slower than it must be: ``treefx.backward`` captures its part
graphs once (the capture that finds the context layout, the graph that trains, and the graph
a recompute part's first forward runs without autograd) and never again, whatever the budget
(parts of other lengths, with and without context, recompute and host parts), on the eager
backend's whole graph and on the regional path through AOTAutograd (the GPU's path, kernels
run eagerly)."""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest
import torch
from support import VOCAB, grads, hf_model
from torch._dynamo.utils import counters

import treefx
from treefx import parts
from treefx.ops.attention.flex import FlexSite
from treefx.ops.cross_entropy import fast as ce_fast
from treefx.run.engine import fresh_function
from treefx.run.parts import runners

transformers = pytest.importorskip("transformers")


def _comb(seed: int, calls: int, trunk=(4, 12), leaf=(2, 9)) -> treefx.Tree:
    """A coding agent's calls: a conversation that grows call by call, each call's
    completion a leaf off it (the open path recompute and host parts are made for)."""
    rng = np.random.default_rng(seed)
    convo, seqs = [], []
    for _ in range(calls):
        convo = convo + rng.integers(1, VOCAB, rng.integers(*trunk)).tolist()
        seqs.append(convo + rng.integers(1, VOCAB, rng.integers(*leaf)).tolist())
    return treefx.Tree.from_sequences(seqs)


def _forest() -> list[treefx.Tree]:
    return [_comb(1, 9), treefx.synth.agent_tree(3, vocab_size=VOCAB, rollouts=2,
                                                 system_len=(6, 12), prompt_len=(3, 8),
                                                 think_len=(3, 9), answer_len=(2, 5),
                                                 tool_len=(3, 9)), _comb(2, 6)]


# The first budget's plan: a first part that trains (no context) and recompute parts that
# all read a context. Then budgets whose plans have what the first did not: recompute parts
# without context (a tree's first part beyond the budget), of other lengths, host parts,
# parts of two tokens, entries from several parts.
FIRST = (40, "recompute")
LATER = ((25, "recompute"), (12, "recompute"), (7, "host"), (18, "host"), (5, "recompute"),
         (60, "host"), (1000, "recompute"))


def _plan_features(batch, budget, beyond) -> set[str]:
    plan = parts.plan(batch, budget, beyond=beyond)
    got = set()
    for p in plan.parts:
        if p.recompute:
            got.add("recompute with context" if len(p.context) else "recompute without context")
        if p.host:
            got.add("host")
        if p.num_tokens < 2:
            got.add("padded")
        if len(p.entries) >= 2:
            got.add("entries")
        if p.index == 0 and not p.recompute:
            got.add("first trains")
    return got


def _chunk_compiles(monkeypatch):
    """On the GPU the fused loss compiles its chunk function (``gpu_compiled``, dynamic in
    every length); here the same function compiled through Dynamo with the eager backend, in
    chunks of 16 rows (4 with the loss alone), so that Dynamo's graphs count it. Returns the
    rows of every chunk it was called with."""
    rows = []
    monkeypatch.setattr(ce_fast, "CHUNK_ELEMENTS", VOCAB * 4)
    monkeypatch.setattr(ce_fast, "_GPU_COMPILED", {})
    compile_ = torch.compile

    def compile_on_cpu(fn, **kw):
        if "backend" in kw:  # the engine's captures
            return compile_(fn, **kw)
        # a copy under a code object of its own: Dynamo's cache of this test alone
        return compile_(fresh_function(fn, 0), backend="eager", **kw)

    monkeypatch.setattr(torch, "compile", compile_on_cpu)
    gpu_compiled = ce_fast.gpu_compiled

    def on_cpu(fn, cuda):
        compiled = gpu_compiled(fn, True)

        def call(logits, *args):
            rows.append(logits.shape[0])
            return compiled(logits, *args)

        return call

    monkeypatch.setattr(ce_fast, "gpu_compiled", on_cpu)
    return rows


def _query_lengths(monkeypatch):
    """Whether each FlexAttention call traced with a symbolic query length (a capture) has
    one of 128 or more, statically: Inductor picks its decoding kernel for fewer than 128
    queries by a guard on that length (even where treefx forces the standard kernel), which
    a part shorter than a block would fail, and capture its graph again."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    seen = []
    call = FlexSite._call_flex

    def recording(self, q, *args):
        n = q.shape[-2]
        if isinstance(n, torch.SymInt):
            seen.append((torch.is_grad_enabled(), bool(statically_known_true(n >= 128))))
        return call(self, q, *args)

    monkeypatch.setattr(FlexSite, "_call_flex", recording)
    return seen


class _Recaptures(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []
        self.seen = 0

    def emit(self, record):
        msg = record.getMessage()
        self.seen += 1
        if "capturing again" in msg or "capturing the part graph again" in msg:
            self.lines.append(msg)


@contextlib.contextmanager
def recaptures_logged():
    """treefx's INFO lines inside the block, the captures made again among them."""
    log = logging.getLogger("treefx")
    recaptures, level = _Recaptures(), log.level
    log.addHandler(recaptures)
    log.setLevel(logging.INFO)
    try:
        yield recaptures
    finally:
        log.removeHandler(recaptures)
        log.setLevel(level)


def _model(name: str) -> torch.nn.Module:
    if name == "qwen3_next":  # test_parts' hybrid
        from test_hybrid import _gdn_config

        cfg = _gdn_config("qwen3_next")
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg)
    return hf_model(name, "sdpa")


@pytest.mark.parametrize("name,backend,regional", [
    ("qwen3", "eager", None), ("qwen3", "aot-eager", True),
    pytest.param("qwen3_next", "eager", None, marks=pytest.mark.slow),
    pytest.param("qwen3_next", "aot-eager", True, marks=pytest.mark.slow)])
def test_parts_capture_once_at_every_budget(name, backend, regional, monkeypatch):
    """One compiled model (Qwen3; with ``-m slow`` Qwen3-Next's hybrid, whose conv inputs
    and recurrent states cross the parts too), ``treefx.backward`` at one budget, then at
    budgets whose parts
    differ in every way a capture could see (lengths, contexts, entries, recompute parts with
    and without context, host parts): the first call captures the layout, the graph that
    trains and the one without autograd, once each, and the fused loss's chunk function
    once; the later calls capture nothing (the part runner's count, Dynamo's graphs, no
    regional capture again), and every loss and gradient is each sequence's alone."""
    trees = _forest()
    batch = treefx.pack(trees)
    seen = set()
    for budget, beyond in LATER:
        seen |= _plan_features(batch, budget, beyond)
    first = _plan_features(batch, *FIRST)
    assert "first trains" in first and "recompute with context" in first
    assert "recompute without context" not in first
    assert {"recompute without context", "host", "padded", "entries"} <= seen, seen
    model = _model(name)
    ref = treefx.reference.sequence_loss(model, trees, reduction="mean")
    ref.backward()
    want = grads(model)
    chunks = _chunk_compiles(monkeypatch)
    queries = _query_lengths(monkeypatch)
    with recaptures_logged() as recaptures:
        tm = treefx.compile(model, backend=backend, regional=regional, verify=False)
        graphs0 = counters["stats"]["unique_graphs"]
        for i, (budget, beyond) in enumerate((FIRST, *LATER)):
            loss = treefx.backward(tm, trees, max_tokens=budget, beyond=beyond)
            (runner,) = runners(tm)
            if i == 0:
                assert runner.num_compilations == 3  # the layout, with and without autograd
                # the part graphs and the fused loss's chunk function, once each
                assert counters["stats"]["unique_graphs"] - graphs0 == 4
                first_count = counters["stats"]["unique_graphs"]
            assert runner.num_compilations == 3, (budget, beyond)
            assert counters["stats"]["unique_graphs"] == first_count, (budget, beyond)
            torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
            for param, g in grads(model).items():
                torch.testing.assert_close(g, want[param], atol=1e-6, rtol=1e-4,
                                           msg=lambda m: f"{param} ({budget}, {beyond}): {m}")
    assert recaptures.seen and not recaptures.lines, recaptures.lines
    assert runner.engine.num_compilations == runner.no_grad_engine.num_compilations == 1
    if regional:
        assert sum(map(len, runner.engine._regional.values())) == 1
        assert sum(map(len, runner.no_grad_engine._regional.values())) == 1
        # every query row FlexAttention was traced with is a block or more, statically
        assert queries and all(ok for _, ok in queries), queries
        assert {grad for grad, _ in queries} == {True, False}
    # the fused loss's chunks: never one row alone (a size Dynamo specializes), the last
    # chunk of 16 rows and one taken together where that was left
    assert chunks and 1 not in chunks and 17 in chunks
