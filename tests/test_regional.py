"""Regional execution (``treefx.compile(..., regional=True)``; the path FSDP2 and DDP models
take, see test_distributed.py): the rewritten graph cut at the decoder layers, each layer type
compiled once, each layer run through its module's call. In one process, against the oracle,
and the checks that keep it from being silently wrong."""

from __future__ import annotations

import pytest
import torch
from support import HF_CONFIGS, VOCAB, check_against_oracle, hf_model
from test_model_positions import model_of
from trees import check_forward, odd_forest

import treefx
from treefx.run import regional
from treefx.models import enable_activation_checkpointing

transformers = pytest.importorskip("transformers")


def _graphs(tm):
    return [g for gs in tm.engine._regional.values() for g in gs]


@pytest.mark.parametrize("name,backend,checkpointing", [
    pytest.param("qwen3", "aot-eager", True, marks=pytest.mark.slow),
    pytest.param("gpt2", "eager", True, marks=pytest.mark.slow), ("mistral", "eager", False)])
def test_regional_matches_oracle(name, backend, checkpointing):
    model = hf_model(name, "sdpa")
    if checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
        model.train()
    tm = treefx.compile(model, backend=backend, regional=True, verify=False)
    check_against_oracle(tm, odd_forest(3, VOCAB))
    # no grad: a model in training mode runs its training graph (TREEFX_SHARE_NO_GRAD)
    assert model.training
    check_forward(tm, odd_forest(11, VOCAB)[:1], atol=1e-4)
    graphs = _graphs(tm)
    assert len(graphs) == 1
    graph = graphs[0]
    layers = HF_CONFIGS[name].get("num_hidden_layers") or HF_CONFIGS[name]["n_layer"]
    assert sum(p.block is not None for p in graph.pieces) == layers


def test_layers_of_one_type_share_one_compiled_piece():
    cfg = dict(HF_CONFIGS["qwen3"], num_hidden_layers=5)
    cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), vocab_size=VOCAB, **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    tm = treefx.compile(model, backend="eager", regional=True, verify=False)
    check_against_oracle(tm, odd_forest(5, VOCAB))
    (graph,) = _graphs(tm)
    blocks = [p for p in graph.pieces if p.block is not None]
    assert len(blocks) == 5
    # the first layer reads the embeddings (other strides), the other four share one
    assert len({id(p.compiled) for p in blocks}) <= 2
    assert graph.num_compiled <= 4


def test_logits_false_and_no_grad():
    model = hf_model("qwen3", "sdpa")
    full = treefx.compile(model, backend="eager", verify=False)
    tm = treefx.compile(model, backend="eager", regional=True, logits=False, verify=False)
    batch = treefx.pack(odd_forest(3, VOCAB))
    with torch.no_grad():
        out, ref = tm(batch), full(batch)
    assert out.logits is None
    torch.testing.assert_close(out.token_logprobs, ref.token_logprobs)


def test_step_result_structure_is_kept():
    @treefx.step(backend="eager", regional=True)
    def step(model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    labels=batch["labels"])
        return {"loss": out.loss, "tag": "sft", "n": 3}

    model = hf_model("qwen3", "sdpa")
    trees = odd_forest(3, VOCAB)
    result = step(model, treefx.pack(trees, reduction="mean"))
    assert set(result) == {"loss", "tag", "n"} and result["tag"] == "sft" and result["n"] == 3
    ref = treefx.reference.sequence_loss(model, trees, reduction="mean")
    torch.testing.assert_close(result["loss"], ref, atol=1e-5, rtol=1e-5)


def test_a_changed_parameter_is_an_error_not_a_misread():
    """A piece reads each parameter from its module when it runs: one that is not the tensor it
    was captured as (an FSDP shard, a parameter of another unit) is refused by name."""
    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, backend="eager", regional=True, verify=False)
    batch = treefx.pack(odd_forest(3, VOCAB))
    tm(batch)
    model.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(treefx.TreeCompileError, match=r"block model\.layers\.1 reads "
                                                      r"mlp\.up_proj\.weight"):
        tm(batch)


def test_hooks_on_a_layer_are_refused():
    model = hf_model("qwen3", "sdpa")
    model.model.layers[0].register_forward_hook(lambda m, a, o: None)
    tm = treefx.compile(model, backend="eager", regional=True, verify=False)
    with pytest.raises(treefx.TreeCompileError, match="forward hooks"):
        tm(treefx.pack(odd_forest(3, VOCAB)))


def test_hugging_faces_input_require_grads_hook_acts_once_in_the_graph():
    """``enable_input_require_grads`` (what reentrant activation checkpointing, and verl's and
    PEFT's set-ups, register) hooks the input embeddings: traced into the graph, left out of the block's
    own call (where the output is the graph piece's tuple); exact with a frozen embedding,
    where the hook is what gives the checkpointed layers an input that needs gradients."""
    model = hf_model("qwen3", "sdpa")
    model.get_input_embeddings().weight.requires_grad_(False)
    enable_activation_checkpointing(model, use_reentrant=True)  # registers the hook
    model.train()
    hooks = dict(model.get_input_embeddings()._forward_hooks)
    assert hooks and all("make_inputs_require_grads" in h.__qualname__ for h in hooks.values())
    tm = treefx.compile(model, backend="eager", regional=True, verify=False)
    check_against_oracle(tm, odd_forest(3, VOCAB))
    assert dict(model.get_input_embeddings()._forward_hooks) == hooks  # put back after the call


def test_shape_guards_are_checked_on_every_call():
    """GPT-Neo cuts its 48-position table to the row: Dynamo guards the row length. A row
    within the guard reuses the capture; a longer one is captured anew, which fails clearly
    (the same error as without regions), never run on the old capture."""
    model = model_of("gpt_neo", max_position_embeddings=48)
    tm = treefx.compile(model, backend="eager", regional=True, verify=False)
    small = [treefx.Tree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])]
    tm(treefx.pack(small))
    (graph,) = _graphs(tm)
    assert graph.guards, "the table cut guards the token count"
    long = [treefx.Tree.from_sequences([[1 + (i + j) % 60 for j in range(30)]
                                        for i in range(4)])]
    batch = treefx.pack(long)
    def call_args(b):  # as the engine calls a capture: the model, the ids, the tree tensors
        return (tm.model, b.input_ids, treefx.run.engine.tree_info(b))

    fits = treefx.pack(small)
    assert graph.accepts(call_args(fits)) and graph.failed_guard(call_args(fits)) is None
    # refused for its shape guard (not for anything else), which the log then names
    assert not graph.accepts(call_args(batch))
    assert "<=" in graph.failed_guard(call_args(batch)) or \
        "outside" in graph.failed_guard(call_args(batch))
    with pytest.raises(treefx.TreeCompileError, match=r"row of \d+ tokens.*table's length"):
        tm(batch)


def test_a_guard_added_after_the_capture_is_checked():
    """Compiling can add shape guards after the capture's were read (a backward AOTAutograd
    compiles at its first call: Inductor's 32-bit indexing guard ``V*s0 <= 2**31-1``). Such a
    guard, taken here on the capture's shape environment as Inductor takes it, refuses a call
    that fails it."""
    import sympy

    model = hf_model("mistral", "sdpa")
    tm = treefx.compile(model, backend="eager", regional=True, verify=False)
    small = treefx.pack([treefx.Tree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])])
    tm(small)
    (graph,) = _graphs(tm)
    args = (tm.model, small.input_ids, treefx.run.engine.tree_info(small))
    assert graph.accepts(args)
    (sym,) = [s for s, (i, d) in graph.symbols.items() if (i, d) == graph.dims[0]]
    limit = small.input_ids.shape[-1] + 5
    from torch._inductor.sizevars import SizeVarAllocator

    SizeVarAllocator(graph.fake_mode.shape_env).check_leq(sym, limit)  # as Inductor guards
    longer = treefx.pack([treefx.Tree.from_sequences([list(range(1, limit + 3))])])
    assert not graph.accepts((tm.model, longer.input_ids, treefx.run.engine.tree_info(longer)))
    assert "<=" in graph.failed_guard((tm.model, longer.input_ids,
                                       treefx.run.engine.tree_info(longer)))
    assert graph.accepts(args)


def test_the_backward_is_compiled_with_the_forward():
    """treefx's backends compile a graph's backward when they compile its forward, before any
    backward runs, so its guards are among those a capture reads (see the test above). Here a
    graph on a tensor of symbolic size and no size inputs, as regional execution compiles a
    piece: AOTAutograd would otherwise compile its backward at the first backward call."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    class Sin(torch.nn.Module):
        def forward(self, x):
            return (x.sin(),)

    calls = []
    real = treefx.run.backends._as_is

    def recording(gm, example_inputs):
        calls.append(gm)
        return real(gm, example_inputs)

    x = torch.randn(7, 4, requires_grad=True)
    fake = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(
        x, source=ConstantSource("x"), symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    assert isinstance(fake.shape[0], torch.SymInt)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(treefx.run.backends, "_as_is", recording)
        fn = treefx.run.backends.compile_graph("aot-eager", torch.fx.symbolic_trace(Sin()),
                                               [fake])
        assert len(calls) == 2, "forward and backward, before anything runs"
        fn(x)[0].sum().backward()
    assert len(calls) == 2
    torch.testing.assert_close(x.grad, x.detach().cos())


def test_blocks_are_the_decoder_layers():
    model = hf_model("qwen3", "sdpa")
    assert list(regional.find_blocks(model)) == ["model.layers.0", "model.layers.1"]
    gpt2 = hf_model("gpt2", "sdpa")
    assert list(regional.find_blocks(gpt2)) == ["transformer.h.0", "transformer.h.1"]


def test_regional_false_is_the_whole_graph():
    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, backend="eager", regional=False, verify=False)
    tm(treefx.pack(odd_forest(3, VOCAB)))
    assert not _graphs(tm)
    with pytest.raises(TypeError, match="regional"):
        treefx.compile(model, regional="yes")


def test_regional_is_the_default_through_inductor(monkeypatch, caplog):
    """``regional=None``: a compiled model runs layer by layer on Inductor (the GPU), the whole
    graph on the eager backend; a step function keeps the whole graph (parts run regionally:
    tests/test_parts.py::test_parts_run_regionally_by_default_where_whole_batches_do). A default
    regional capture that regional execution refuses (hooks on a layer) falls back to the whole
    graph, with a warning. On the CPU the eager backend stands in for Inductor."""
    from treefx.run import engine as engine_mod

    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, verify=False)
    assert tm.engine.uses_regions(model, None, "inductor")
    assert not tm.engine.uses_regions(model, None, "eager")
    assert not treefx.compile(model, regional=False).engine.uses_regions(model, None, "inductor")
    step = treefx.step(lambda m, b: m(**b).loss)
    assert not step.engine.uses_regions(model, None, "inductor")

    monkeypatch.setattr(engine_mod, "REGIONAL_BY_DEFAULT", ("eager",))
    trees = odd_forest(3, VOCAB)
    tm = treefx.compile(model, backend="eager", verify=False)
    assert treefx.verify(tm, trees, params="all").passed
    assert _graphs(tm)

    hooked = hf_model("qwen3", "sdpa")
    hooked.model.layers[0].register_forward_hook(lambda m, a, o: None)
    tm = treefx.compile(hooked, backend="eager", verify=False)
    with caplog.at_level("WARNING", logger="treefx"):
        assert treefx.verify(tm, trees, params="all").passed
    assert not _graphs(tm)
    assert "whole graph, not layer by layer" in caplog.text and "forward hooks" in caplog.text


def test_a_refused_call_names_the_argument_and_the_difference():
    """The log of a capture again says what the earlier capture refused: an argument's
    requires_grad, dtype or static size, a constant argument (not "?")."""
    model = hf_model("mistral", "sdpa")
    tm = treefx.compile(model, backend="eager", regional=True, verify=False)
    small = treefx.pack([treefx.Tree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])])
    tm(small)
    (graph,) = _graphs(tm)
    ids, info = small.input_ids, treefx.run.engine.tree_info(small)
    assert graph.failed_guard((tm.model, ids, info)) is None
    cases = {
        "argument 1 requires_grad True, captured False":
            (tm.model, ids.float().requires_grad_(), info),
        "argument 1 dtype torch.int32, captured torch.int64": (tm.model, ids.int(), info),
        "argument 2 size 4 in dim 0, captured 3 (static)":
            (tm.model, ids, torch.cat([info, info[:1]])),
        "argument 1 rank 1, captured 2": (tm.model, ids[0], info),
        "argument 2 a list, captured a tensor": (tm.model, ids, info.tolist()),
        f"argument 0 another {type(model).__name__} than the capture's":
            (hf_model("mistral", "sdpa"), ids, info),
    }
    for want, args in cases.items():
        assert not graph.accepts(args)
        assert graph.failed_guard(args) == want


@pytest.mark.slow
def test_other_step_arguments_are_guarded():
    """A step's other arguments are constants of the capture (numbers) or static shapes
    (tensors): a call with other values is captured anew, never run on the old capture."""
    @treefx.step(backend="eager", regional=True)
    def step(model, batch, scale, bias):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    labels=batch["labels"])
        return out.loss * scale, bias * 2

    model = hf_model("qwen3", "sdpa")
    batch = treefx.pack(odd_forest(3, VOCAB), reduction="mean")
    with torch.no_grad():
        a = step(model, batch, 1.0, torch.zeros(3))
        b = step(model, batch, 2.0, torch.zeros(3))
        c = step(model, batch, 1.0, torch.ones(5))
    torch.testing.assert_close(b[0], 2 * a[0])
    torch.testing.assert_close(c[0], a[0])
    torch.testing.assert_close(c[1], torch.full((5,), 2.0))
    assert len(_graphs(step)) == 3


def _autocast_forward(model):
    """``model.forward`` wrapped in autocast, as accelerate's mixed precision (Trainer's and
    TRL's ``bf16=True``) wraps it: the autocast region opens in the glue before the first
    layer and closes after the last."""
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    return model


@pytest.mark.parametrize("grad", [False, True])
def test_an_autocast_region_around_the_layers_runs_layer_by_layer(grad):
    model = _autocast_forward(hf_model("qwen3", "sdpa"))
    trees = odd_forest(3, VOCAB)
    tm = treefx.compile(model, backend="aot-eager", regional=True, verify=False)
    whole = treefx.compile(model, backend="aot-eager", regional=False, verify=False)
    batch = treefx.pack(trees)
    outs = []
    for m in (tm, whole):
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad):
            out = m(batch)
            if grad:
                treefx.tree_loss(out, batch).backward()
        outs.append((out.token_logprobs.detach(),
                     {n: p.grad.clone() for n, p in model.named_parameters()} if grad else {}))
    (graph,) = _graphs(tm)
    assert sum(p.block is not None for p in graph.pieces) == HF_CONFIGS["qwen3"]["num_hidden_layers"]
    # every piece computes under the region: the same values as the whole graph, where the
    # matmuls run in bfloat16 (without the region, float32: far from these)
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=0, rtol=0)
    for n, g in outs[1][1].items():
        torch.testing.assert_close(outs[0][1][n], g, atol=0, rtol=0, msg=n)
    check_forward(tm, trees, atol=0.05, grad=grad)  # the oracle under the same autocast
    if grad:  # log-probs and every gradient against each sequence alone (bf16 autocast:
        # measured 1.9e-3 and 1.3e-2 relative; float32 without the region 5e-7 and 6e-7)
        check_against_oracle(tm, trees, atol=0.05, rtol=0.05)
    with torch.no_grad():
        plain = treefx.reference.sequence_logprobs(hf_model("qwen3", "sdpa"), trees)
    err = max(float((outs[0][0][batch.sequence_index(i)[1:]] - lp).abs().max())
              for i, lp in enumerate(plain) if lp.numel())
    assert err > 1e-3  # the region made a difference that the equalities above checked
