"""Trees over the budget in parts: a part's fixed cost in the planner's objective (no small
parts where a merge fits the budget), and every tree token computed once at every budget the
open path fits in (host parts hold what the budget cannot, instead of recomputing it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import VOCAB

import treefx
from treefx import parts
from treefx.models import tiny_decoder
from treefx.tools.synth import odd_forest

EMBEDDED: list[torch.Tensor] = []


@torch.library.custom_op("treefx_test::counting_embedding", mutates_args=())
def counting_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An embedding the compiler cannot see into, which records the ids it embeds."""
    EMBEDDED.append(ids.detach().flatten().clone())
    return weight[ids]


@counting_embedding.register_fake
def _(ids, weight):
    return weight.new_empty(*ids.shape, weight.shape[1])


def _setup(ctx, inputs, output):
    ids, weight = inputs
    ctx.save_for_backward(ids)
    ctx.rows = weight.shape[0]


def _backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    g = grad.new_zeros(ctx.rows, grad.shape[-1])
    g.index_add_(0, ids.flatten(), grad.reshape(-1, grad.shape[-1]))
    return None, g


counting_embedding.register_autograd(_backward, setup_context=_setup)


class CountingEmbedding(torch.nn.Module):
    def __init__(self, emb: torch.nn.Embedding):
        super().__init__()
        self.weight = emb.weight

    def forward(self, ids):
        return counting_embedding(ids, self.weight)


def swe_like(seed: int, calls: int = 20, tokens: int = 42000, vocab: int = 32000):
    """An agent task's calls as one tree, shaped like the SWE-agent tasks of the issue: a
    system prompt and task of 2-6k tokens, then a conversation that grows call by call (the
    action of each completion, then a tool's output: lengths drawn log-normal), each call's
    completion (its thinking) a leaf off it."""
    rng = np.random.default_rng(seed)
    convo = rng.integers(1, vocab, int(rng.integers(2000, 6000))).tolist()
    seqs = []
    per = (tokens - len(convo)) / calls
    for _ in range(calls):
        think = int(rng.lognormal(np.log(per * 0.25), 0.8)) + 5
        tool = int(rng.lognormal(np.log(per * 0.6), 0.9)) + 5
        comp = rng.integers(1, vocab, think).tolist()
        seqs.append(convo + comp)
        convo = convo + comp[-max(1, think // 3):] + rng.integers(1, vocab, tool).tolist()
    return treefx.Tree.from_sequences(seqs)


def _held_peak(plan, ranges) -> int:
    """The most tokens held on the device at once if the plan's parts were ``ranges``
    (start, end, beyond the budget)."""
    se = plan.batch.subtree_end.numpy()
    starts = [r[0] for r in ranges]
    ends = [r[1] for r in ranges]
    release = np.maximum.reduceat(se[:ends[-1]], starts).tolist()
    return int(parts.merge.held_tokens(starts, ends, release, [r[2] for r in ranges]).max())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_small_parts_where_a_merge_fits(seed):
    """With host parts, on SWE-shaped trees (about 43-50k tokens, 20 calls) at half, a quarter,
    16k and 8k:
    no part below ``min_part`` (an eighth of the budget) whose merge with a neighbour fits
    the budget (the merged part within ``max_tokens``, the tokens held on the device at once
    within it too); the plan covers the row, holds at most ``max_tokens``, and has at most
    the parts of the plan without the merges. Before, at 16k: 20-22 parts, of 12 tokens and
    more (host: 9-12 parts, the smallest over 2,000)."""
    batch = treefx.pack(swe_like(seed))
    n = batch.num_tokens
    for budget in (n // 2, n // 4, 16384, 8192):
        plan = parts.plan(batch, budget, beyond="host")
        base = parts.plan(batch, budget, beyond="host", min_part=0)
        assert plan.num_parts <= base.num_parts
        assert plan.recompute_tokens == 0
        assert plan.parts[0].start == 0 and plan.parts[-1].end == n
        assert all(a.end == b.start for a, b in zip(plan.parts, plan.parts[1:]))
        assert max(p.num_tokens for p in plan.parts) <= budget
        assert plan.peak_held_tokens() <= budget
        min_part = budget // 8
        ranges = [(p.start, p.end, p.host) for p in plan.parts]
        for k, p in enumerate(plan.parts):
            if p.num_tokens >= min_part:
                continue
            for i in (k - 1, k):
                if i < 0 or i + 1 >= len(ranges):
                    continue
                a, b = ranges[i], ranges[i + 1]
                merged = ranges[:i] + [(a[0], b[1], a[2] or b[2])] + ranges[i + 2:]
                assert b[1] - a[0] > budget or _held_peak(plan, merged) > budget, \
                    (budget, k, p.num_tokens)


def test_small_parts_merge_with_host_parts_only_by_default():
    """The merges come with host parts; with recompute parts (the default) the plan is the
    planner's without them (merging there would hold recompute parts' keys and values past the
    current part's context); held on the device, merges are asked for by ``min_part``."""
    batch = treefx.pack(swe_like(3))
    spans = lambda plan: [(p.start, p.end, p.recompute) for p in plan.parts]  # noqa: E731
    assert spans(parts.plan(batch, 16384)) == spans(parts.plan(batch, 16384, min_part=0))
    plan = parts.plan(batch, 16384, beyond="device", min_part=16384 // 8)
    base = parts.plan(batch, 16384, beyond="device", min_part=0)
    assert plan.num_parts <= base.num_parts and plan.host_tokens == 0


def _model(dtype):
    torch.manual_seed(0)
    model = tiny_decoder(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4).to(dtype)
    model.tok_embeddings = CountingEmbedding(model.tok_embeddings)
    return model


def _forest():
    return [treefx.synth.agent_tree(i, vocab_size=VOCAB, rollouts=2, system_len=(20, 30),
                                    prompt_len=(3, 8), think_len=(3, 9), answer_len=(2, 5),
                                    tool_len=(3, 9)) for i in range(2)] + odd_forest(0, VOCAB)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_tree_token_is_embedded_once_at_every_budget(dtype):
    """A model whose input embedding is an opaque custom op that records the ids it embeds:
    ``treefx.backward(..., beyond="host")`` embeds each tree token once at budgets from a handful of tokens to the
    whole forest (host parts where the open path does not fit beside the current part), and
    the loss and every gradient equal each sequence run alone. ``beyond="recompute"`` embeds
    the recompute parts' tokens twice (the default until host parts are measured on a GPU)."""
    model = _model(dtype)
    trees = _forest()
    batch = treefx.pack(trees)
    n = batch.num_tokens
    ref = treefx.reference.sequence_loss(model, trees, reduction="mean")
    ref.backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    tm = treefx.compile(model, verify=False)
    row = batch.input_ids[0]
    tol = dict(atol=1e-9, rtol=1e-9) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-4)
    hosted = 0
    for budget in (24, 40, 64, n // 3, n + 1):
        plan = parts.plan(batch, budget, beyond="host")
        hosted += plan.host_tokens
        EMBEDDED.clear()
        loss = treefx.backward(tm, trees, max_tokens=budget, beyond="host")
        got = torch.cat([e for e in EMBEDDED])
        # the part graphs' lookups: every token of the row once, in order (a part of one
        # token is padded with an inert copy of it: counted and left out here)
        pads = sum(max(0, 2 - p.num_tokens) for p in plan.parts)
        assert got.numel() == n + pads, (budget, got.numel(), n, pads)
        keep = torch.ones(got.numel(), dtype=torch.bool)
        at = 0
        for p in plan.parts:
            keep[at + p.num_tokens:at + max(2, p.num_tokens)] = False
            at += max(2, p.num_tokens)
        assert torch.equal(got[keep], row)
        torch.testing.assert_close(loss, ref.detach().to(loss.dtype), **tol)
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[k], **tol, msg=lambda m: f"{k}: {m}")
        model.zero_grad(set_to_none=True)
    assert hosted > 0  # some budgets put open parts on the host
    plan = parts.plan(batch, 24)
    assert plan.recompute_tokens > 0 and plan.beyond == "recompute"  # the default
    EMBEDDED.clear()
    treefx.backward(tm, trees, max_tokens=24)
    pads = sum(max(0, 2 - p.num_tokens) for p in plan.parts)
    rec_pads = sum(max(0, 2 - p.num_tokens) for p in plan.parts if p.recompute)
    assert sum(e.numel() for e in EMBEDDED) == n + pads + plan.recompute_tokens + rec_pads
    model.zero_grad(set_to_none=True)


def test_host_parts_copy_their_saved_tensors_out_and_back(monkeypatch):
    """On the CPU the device is the host and nothing is copied; forced to copy, a host part's
    saved tensors are copied out as its forward saves them and back at its backward, and the
    gradients are those of each sequence alone (float64)."""
    from treefx.run.parts import host as host_mod

    made = []
    real = host_mod.HostStore.__init__

    def copying(self, device, keep=(), *, copy=None):
        real(self, device, keep, copy=True)
        made.append(self)

    monkeypatch.setattr(host_mod.HostStore, "__init__", copying)
    model = _model(torch.float64)
    trees = _forest()
    ref = treefx.reference.sequence_loss(model, trees, reduction="mean")
    ref.backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    tm = treefx.compile(model, verify=False)
    assert parts.plan(treefx.pack(trees), 24, beyond="host").host_tokens > 0
    loss = treefx.backward(tm, trees, max_tokens=24, beyond="host")
    store = made[-1]
    assert store.copied > 0 and store.peak_bytes > 0 and store.bytes == 0
    torch.testing.assert_close(loss, ref.detach(), atol=1e-9, rtol=1e-9)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], atol=1e-9, rtol=1e-9)
