"""Dead-code elimination keeps every node with an effect (in-place writes, random draws,
global state), and removes what a rewrite orphaned."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from treefx.compiler.checks.dce import draws_random, eliminate_dead_code, has_effect


def graph_of(fn, *args) -> fx.Graph:
    gms = []

    def backend(gm, example_inputs):
        gms.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return gms[0].graph


def targets(graph: fx.Graph) -> list[str]:
    return [n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            for n in graph.nodes if n.op in ("call_function", "call_method")]


def test_inplace_fill_of_a_new_tensor_is_kept():
    """Multi-head latent attention builds its key with new_empty and fills it with copy_:
    torch's own elimination drops the copy_ (its result is unused)."""

    def key(x):
        k = x.new_empty(x.shape[0], 4)
        k[:, :2].copy_(x[:, :2])
        k[:, 2:].copy_(x[:, 2:] * 2)
        return k + 1

    x = torch.randn(3, 4)
    g = graph_of(key, x)
    eliminate_dead_code(g)
    assert targets(g).count("copy_") == 2
    (out,) = fx.GraphModule(torch.nn.Module(), g)(x)  # Dynamo's graphs return a tuple
    torch.testing.assert_close(out, key(x))


def test_writes_into_a_buffer_nobody_reads_go_with_it():
    """A cache the model fills with a final state (Qwen3-Next's recurrent state under
    use_cache, which a tree recurrence does not produce): a fresh buffer whose every use,
    through views, is an in-place write changes nothing the graph returns."""

    def step(x):
        state = x * 2
        cache = torch.zeros_like(state)
        cache.copy_(state)
        cache[0].fill_(1.0)
        return x + 1

    x = torch.randn(3, 4)
    g = graph_of(step, x)
    eliminate_dead_code(g)
    assert targets(g) == ["add"], targets(g)


def test_a_buffer_read_after_its_writes_is_kept():
    """The same writes, but the buffer (or a view of it, or what copy_ returns) is read."""

    def through_view(x):
        cache = torch.zeros_like(x)
        cache.copy_(x * 2)
        return cache[0] + 1

    def through_result(x):
        cache = x.new_zeros(x.shape)
        return cache.copy_(x * 2).sum()

    def as_a_source(x):
        cache = torch.zeros_like(x)
        cache.copy_(x * 2)
        out = torch.ones_like(x)
        out.copy_(cache)
        return out

    x = torch.randn(3, 4)
    for fn in (through_view, through_result, as_a_source):
        g = graph_of(fn, x)
        eliminate_dead_code(g)
        assert "copy_" in targets(g), fn.__name__
        (out,) = fx.GraphModule(torch.nn.Module(), g)(x)
        torch.testing.assert_close(out, fn(x))


def test_scatter_into_a_mask_is_kept():
    """Group-limited MoE routers mask groups with scatter_ into a zeros tensor."""

    def route(scores, idx):
        mask = torch.zeros_like(scores)
        mask.scatter_(1, idx, 1)
        return scores.masked_fill(mask == 0, float("-inf")).softmax(-1)

    scores, idx = torch.randn(4, 6), torch.tensor([[0, 2], [1, 3], [4, 5], [0, 5]])
    g = graph_of(route, scores, idx)
    eliminate_dead_code(g)
    assert "scatter_" in targets(g)


def test_unused_pure_nodes_go_and_effects_stay():
    def f(x):
        x.sin()  # pure, unused: removed
        F.dropout(x, p=0.0, training=True)  # an identity: removed
        F.dropout(x, p=0.5, training=True)  # a draw: kept (later draws would shift)
        torch.rand(3)  # a draw: kept
        return x + 1

    g = graph_of(f, torch.randn(3))
    eliminate_dead_code(g)
    names = targets(g)
    assert "sin" not in names
    assert names.count("dropout") == 1 and "rand" in names
    drop = next(n for n in g.nodes if targets_of(n) == "dropout")
    assert draws_random(drop) and has_effect(drop)


def targets_of(n):
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
