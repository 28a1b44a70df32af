"""AOTAutograd's on-disk cache for treefx's graphs (``treefx.run.backends.cacheable_patch``):
a restarted job finds its compiled graphs again, and a graph whose sites differ in anything
that changes what they compute never gets another's.

Inductor itself is replaced by a recorder here (its CPU code does not compile tree graphs):
what is checked is the setting treefx hands it and how the sites are named for the cache's
key; a slow test reads the key itself in two fresh processes. The restart's time on the GPU
is in BENCHMARKS.md ("First step and compile time").
"""

from __future__ import annotations

import sys

import pytest
import torch
from support import VOCAB, hf_model

import treefx
from treefx.run import backends
from treefx.tools.synth import odd_forest

transformers = pytest.importorskip("transformers")


@pytest.fixture
def recorded(monkeypatch):
    """Compile through the inductor backend's path on the CPU, Inductor replaced by a
    recorder of the config patches treefx passes: a list of (graph, patches)."""
    import torch._inductor.compile_fx as cfx

    seen = []

    def record(gm, example_inputs, config_patches=None):
        seen.append((gm, dict(config_patches or {})))
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", record)
    monkeypatch.setenv("TREEFX_INDUCTOR_ON_CPU", "1")
    return seen


def _run(model, **options):
    tm = treefx.compile(model, backend="inductor", verify=False, regional=False, **options)
    with torch.no_grad():
        tm(treefx.pack(odd_forest(2, VOCAB)))


def _marked(seen) -> dict:
    return seen[-1][1].get("unsafe_marked_cacheable_functions", {})


def _sites(gm) -> list:
    """The graph's site objects (named for the cache), in node order."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function"
            and "__reduce__" in getattr(n.target, "__dict__", {})]


def _site_names(gm) -> list[str]:
    """The names the cache's pickler gives the graph's site objects, in node order."""
    return [t.__reduce__() for t in _sites(gm)]


def test_sites_are_named_by_their_state_under_treefx_source_key(recorded):
    """A plain model's graph is marked cacheable under treefx's source key, its sites bound
    in their modules under names of their state, one per occurrence. The same model compiled
    again names them the same (the key a restart finds); another block size or kernel option
    names them otherwise (another key)."""
    _run(hf_model("qwen3", "sdpa"))
    gm, _ = recorded[-1]
    marked = _marked(recorded)
    assert marked and set(marked.values()) == {backends.source_key()}
    first = _site_names(gm)
    assert first and len(set(first)) == len(first)  # the attention sites, one name each
    for t in _sites(gm):
        owner = sys.modules[type(t).__module__]
        assert getattr(owner, t.__reduce__()) is t
        assert f"{type(t).__module__}.{t.__name__}" in marked
    _run(hf_model("qwen3", "sdpa"))
    assert _site_names(recorded[-1][0]) == first
    _run(hf_model("qwen3", "sdpa"), block_size=64)
    assert not set(_site_names(recorded[-1][0])) & set(first)
    _run(hf_model("qwen3", "sdpa"), kernel_options={"BLOCK_M": 64, "BLOCK_N": 64})
    assert not set(_site_names(recorded[-1][0])) & set(first)


def test_sites_holding_functions_are_not_cached(recorded):
    """A site holding a callable (Mistral's sliding window as its mask function) cannot be
    named by its state: the graph goes without the setting (AOTAutograd's cache bypasses it,
    as it did before)."""
    _run(hf_model("mistral", "sdpa"))
    assert _marked(recorded) == {}


_KEY_SCRIPT = """
import logging, sys, torch, treefx
sys.path.insert(0, "tests")
from support import VOCAB, hf_model
from treefx.tools.synth import odd_forest
logging.basicConfig(level=logging.WARNING)
logging.getLogger("torch._functorch._aot_autograd.autograd_cache").setLevel(logging.INFO)
tm = treefx.compile(hf_model("qwen3", "sdpa"), backend="inductor", verify=False,
                    regional=False)
try:  # Inductor's CPU code does not compile tree graphs: the key is logged before
    with torch.no_grad():
        tm(treefx.pack(odd_forest(2, VOCAB)))
except Exception:
    pass
"""


@pytest.mark.slow  # two fresh processes, ~40 s each on 2 cores
def test_a_fresh_process_computes_the_same_cache_key(tmp_path):
    """The key AOTAutograd's cache files a treefx graph under is the same in a fresh process
    (what a restarted job looks up), and it is a key, not a bypass. Read from the cache's log
    line, in two processes with empty caches of their own."""
    import os
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    keys = []
    for i in range(2):
        env = dict(os.environ, TREEFX_INDUCTOR_ON_CPU="1", PYTHONPATH=str(root),
                   TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"cache{i}"))
        out = subprocess.run([sys.executable, "-c", _KEY_SCRIPT], cwd=root, env=env,
                             capture_output=True, text=True, timeout=600)
        log = out.stdout + out.stderr
        assert "Bypassing autograd cache" not in log, log[-2000:]
        found = re.findall(r"AOTAutograd cache miss for key (\w+)", log)
        assert found, log[-2000:]
        keys.append(found[0])
    assert keys[0] == keys[1]


# ------------------------------------------------ a cached graph's guards cover its sizes

def _symbolic(x: torch.Tensor, shape_env, dynamic: list[bool]):
    """A fake of ``x`` in ``shape_env``'s fake mode, its dims in ``dynamic`` symbolic."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=shape_env)
    return mode, mode.from_tensor(x, source=ConstantSource("x"), symbolic_context=(
        StatelessSymbolicContext(dynamic_sizes=[
            DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic])))


def test_size_inputs_name_each_symbol_of_the_tensors_once():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    _, x = _symbolic(torch.randn(7, 4), ShapeEnv(), [True, False])
    assert backends.size_inputs([x]) == [(0, 0)]
    assert backends.size_inputs([x, x.shape[0]]) == []  # an integer input carries it
    assert backends.size_inputs([torch.randn(3), x, x[1:]]) == [(1, 0)]
    assert backends.size_inputs([torch.randn(3)]) == []
    # a symbol only inside another size (s0 * 4) and no input's dimension: cannot be passed
    assert backends.size_inputs([x.reshape(-1)]) is None


class _Sin(torch.nn.Module):
    def forward(self, x):
        return (x.sin(),)


def _compile_cold_then_again(tmp_path, monkeypatch, first: int, second: int, limit: int):
    """Compile ``_Sin`` through the inductor backend on a tensor of ``first`` rows under the
    guard rows <= ``limit`` (as Inductor's 32-bit indexing takes one), then in a fresh shape
    environment on ``second`` rows; (Inductor's FX-graph-cache hits of the second, its
    output on real data)."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    from torch._inductor.sizevars import SizeVarAllocator
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gm = torch.fx.symbolic_trace(_Sin())
    fns = []
    with inductor_config.patch(fx_graph_cache=True, force_disable_caches=False):
        for rows, guard in ((first, True), (second, False)):
            mode, fake = _symbolic(torch.randn(rows, 4), ShapeEnv(), [True, False])
            if guard:
                SizeVarAllocator(mode.shape_env).check_leq(fake.shape[0].node.expr, limit)
            counters.clear()
            with torch._guards.tracing(torch._guards.TracingContext(mode)):
                fns.append(backends.compile_graph("inductor", gm, [fake]))
    x = torch.randn(second, 4)
    return counters["inductor"]["fxgraph_cache_hit"], fns[-1](x)[0], x


def test_a_cached_graph_is_not_handed_out_past_its_guards(tmp_path, monkeypatch):
    """A graph on a tensor of symbolic size and no integer inputs (a regional piece) keeps
    the guards its compilation took in Inductor's cache: a later compilation at a size past
    them compiles anew (before, the entry had no guards and was handed out at any size: on
    the H100 a 32-bit output layer ran a 68,762-token row, an illegal memory access)."""
    hits, out, x = _compile_cold_then_again(tmp_path, monkeypatch, 7, 50, 10)
    assert hits == 0
    torch.testing.assert_close(out, x.sin())


def test_a_cached_graph_is_found_again_within_its_guards(tmp_path, monkeypatch):
    """The sizes passed for the guards leave the cache working: the same graph within the
    guards is a hit."""
    hits, out, x = _compile_cold_then_again(tmp_path, monkeypatch, 7, 9, 10)
    assert hits == 1
    torch.testing.assert_close(out, x.sin())


@pytest.mark.parametrize("env, expected", [(None, False), ("0", False), ("1", True),
                                           ("yes", True)])
def test_pointwise_kernels_are_autotuned_only_when_asked(recorded, monkeypatch, env, expected):
    """Tree graphs go to Inductor with pointwise autotuning off (each such kernel compiled in
    one configuration, nothing timed on its first run: the first step's cost, BENCHMARKS.md),
    unless TREEFX_AUTOTUNE_POINTWISE asks for Inductor's default; and treefx starts Inductor's
    compile workers before Dynamo traces the model."""
    import torch._inductor.async_compile as ac

    if env is None:
        monkeypatch.delenv("TREEFX_AUTOTUNE_POINTWISE", raising=False)
    else:
        monkeypatch.setenv("TREEFX_AUTOTUNE_POINTWISE", env)
    warmed = []
    monkeypatch.setattr(ac, "maybe_warm_pool", lambda: warmed.append(len(recorded)))
    _run(hf_model("qwen3", "sdpa"))
    assert recorded[-1][1]["triton.autotune_pointwise"] is expected
    assert warmed == [0]  # once, before the graph reached Inductor


@pytest.mark.parametrize("env, expected", [(None, False), ("0", False), ("1", True)])
def test_mix_order_reductions_only_when_asked(recorded, monkeypatch, env, expected):
    """Tree graphs go to Inductor with mix-order reductions off (their fused norm backward
    sums the rows past the last token, pytorch#195845: NaN in Gemma 4's norm weights on an
    H100), unless TREEFX_MIX_ORDER_REDUCTION asks for them (a torch that masks those rows)."""
    from torch._inductor import config

    if not hasattr(config.triton, "mix_order_reduction"):
        pytest.skip("this torch has no mix-order reductions")
    if env is None:
        monkeypatch.delenv("TREEFX_MIX_ORDER_REDUCTION", raising=False)
    else:
        monkeypatch.setenv("TREEFX_MIX_ORDER_REDUCTION", env)
    _run(hf_model("qwen3", "sdpa"))
    assert recorded[-1][1]["triton.mix_order_reduction"] is expected


class _Cos(torch.nn.Module):
    def forward(self, x):
        return (x.cos() * 2,)


def _wait_spy(monkeypatch) -> list:
    """Inductor's wait for a generated module's kernels, recorded (as the module's kernel
    names at the time of the call) and then made."""
    from torch._inductor.async_compile import AsyncCompile

    calls = []
    real = AsyncCompile.wait

    def wait(self, scope):
        calls.append(sorted(k for k in scope if "kernel" in k or k.startswith("cpp_fused")))
        return real(self, scope)

    monkeypatch.setattr(AsyncCompile, "wait", wait)
    return calls


def _compile_two(tmp_path, monkeypatch, defer: str, during: list) -> list:
    """``_Sin`` then ``_Cos`` through the inductor backend (Inductor's code on the CPU, caches
    off) inside one deferral block; the spy's calls are appended to ``during`` after each
    compilation, inside the block. The two compiled functions."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TREEFX_DEFER_KERNEL_WAITS", defer)
    calls = _wait_spy(monkeypatch)
    fns = []
    with inductor_config.patch(fx_graph_cache=False), backends.kernel_waits_deferred():
        for module in (_Sin(), _Cos()):
            mode, fake = _symbolic(torch.randn(9, 4), ShapeEnv(), [True, False])
            with torch._guards.tracing(torch._guards.TracingContext(mode)):
                fns.append(backends.compile_graph(
                    "inductor", torch.fx.symbolic_trace(module), [fake]))
            during.append(len(calls))
    assert len(calls) == 2, calls  # one wait per generated module, each made once
    return fns


def test_kernel_waits_are_made_once_after_the_last_graph(tmp_path, monkeypatch):
    """Inductor's waits for its compile workers (one per generated module) are deferred to the
    end of the block (the workers compile one graph's kernels while the next is generated:
    the first step's cost, BENCHMARKS.md), then made; the compiled graphs compute the right
    values. TREEFX_DEFER_KERNEL_WAITS=0 waits graph by graph, as Inductor does."""
    during = []
    sin, cos = _compile_two(tmp_path / "a", monkeypatch, "1", during)
    assert during == [0, 0]
    x = torch.randn(11, 4)
    torch.testing.assert_close(sin(x)[0], x.sin())
    torch.testing.assert_close(cos(x)[0], x.cos() * 2)

    during = []
    _compile_two(tmp_path / "b", monkeypatch, "0", during)
    assert during == [1, 2]


def _done(value):
    from concurrent.futures import Future

    f = Future()
    f.set_result(value)
    return f


def test_kernel_waits_nest_and_are_dropped_on_an_error(monkeypatch):
    """A block inside another joins it (its waits are made when the outer one ends); a block
    left by an error makes none of its waits (the error propagates as it was)."""
    from torch._inductor.async_compile import AsyncCompile

    monkeypatch.delenv("TREEFX_DEFER_KERNEL_WAITS", raising=False)
    calls = _wait_spy(monkeypatch)
    done = _done("compiled")
    scopes = [{"kernel_a": done}, {"kernel_b": done}]
    with backends.kernel_waits_deferred():
        AsyncCompile().wait(scopes[0])
        with backends.kernel_waits_deferred():
            AsyncCompile().wait(scopes[1])
        assert calls == [] and scopes[1]["kernel_b"].future is done
    assert calls == [["kernel_a"], ["kernel_b"]]
    assert scopes == [{"kernel_a": "compiled"}, {"kernel_b": "compiled"}]

    calls.clear()
    done = _done("compiled")
    with pytest.raises(RuntimeError, match="in the middle"):
        with backends.kernel_waits_deferred():
            AsyncCompile().wait({"kernel_c": done})
            raise RuntimeError("in the middle")
    assert calls == []
    AsyncCompile().wait({"kernel_d": done})  # the patch is gone: waits are made at once
    assert calls == [["kernel_d"]]


def test_a_kernel_used_before_the_deferred_wait_waits_for_itself(monkeypatch):
    """Code that runs a kernel of a module whose wait is deferred (Inductor's compile-time
    autotuning block runs its kernels right after its wait) gets the kernel: its use waits
    for its own compilation and puts it in the module; the module's wait is still made at the
    end, for the rest."""
    import types

    from torch._inductor.async_compile import AsyncCompile

    monkeypatch.delenv("TREEFX_DEFER_KERNEL_WAITS", raising=False)
    calls = _wait_spy(monkeypatch)
    kernel = types.SimpleNamespace(run=lambda *args: sum(args))
    scope = {"kernel_used": _done(kernel), "kernel_later": _done("later"), "other": 3}
    with backends.kernel_waits_deferred():
        AsyncCompile().wait(scope)
        assert scope["kernel_used"].run(1, 2) == 3  # waits for this kernel alone
        assert scope["kernel_used"] is kernel
        assert isinstance(scope["kernel_later"], backends._PendingKernel)
        assert calls == []
    assert calls == [["kernel_later", "kernel_used"]]
    assert scope == {"kernel_used": kernel, "kernel_later": "later", "other": 3}


def test_sizes_near_the_int32_bound_are_indexed_in_64_bits():
    """A symbolic size within a factor 2 of 2**31 at the capture counts as near the bound:
    GRPO's micro-batches of Qwen3-1.7B (vocab 151,936) at 13,550 and 15,235 tokens straddle
    the output layer's bound of 14,135 tokens; static sizes and sizes far below keep
    Inductor's own choice."""
    import sympy

    s = sympy.Symbol("s0", positive=True, integer=True)

    def at(n):
        return lambda e: e.subs(s, n)

    near = backends.near_int32_bound
    assert near([151936 * s], at(13550))  # below the bound, within the margin
    assert not near([151936 * s], at(15235))  # past it: Inductor indexes in 64 bits itself
    assert not near([151936 * s], at(6000))  # far below: 32 bits, under its guard
    assert not near([151936 * 13550], at(1))  # a static size: no later call differs
    assert near([4096 * s, 151936 * s], at(13550))
    assert not near([151936 * s], lambda e: 1 / 0)  # no hint: Inductor's own choice


def test_wide_indexing_wraps_inductors_choice_and_restores_it(monkeypatch):
    """Inside ``wide_indexing_near_bound`` Inductor's ``can_use_32bit_indexing`` says no for
    sizes near the bound without asking the original (which would guard them); other sizes
    go to the original; on exit the original is back."""
    import sympy
    from torch._inductor.codegen.simd import SIMDScheduling

    asked = []

    def original(numel, buffers):
        asked.append(numel)
        return True

    monkeypatch.setattr(SIMDScheduling, "can_use_32bit_indexing", staticmethod(original))
    s = sympy.Symbol("s0", positive=True, integer=True)
    hint = {"n": 13550}
    monkeypatch.setattr(backends, "_size_hint", lambda: (lambda e: e.subs(s, hint["n"])))
    with backends.wide_indexing_near_bound():
        assert SIMDScheduling.can_use_32bit_indexing(151936 * s, iter(())) is False
        assert asked == []
        hint["n"] = 2000
        assert SIMDScheduling.can_use_32bit_indexing(151936 * s, iter(())) is True
        assert asked == [151936 * s]
    assert SIMDScheduling.__dict__["can_use_32bit_indexing"].__func__ is original
