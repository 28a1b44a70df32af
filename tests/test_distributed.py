"""Several processes: FSDP2 (``fully_shard`` per decoder layer) and DDP with ``treefx.compile``
and ``@treefx.step``, two CPU processes on the gloo backend, different trees per rank.

The oracle is the unmodified model run on each sequence of the union of all ranks' trees in one
process, with the global mean over sequences: every rank's gathered gradients
(``full_tensor()`` under FSDP, the reduced ``.grad`` under DDP) must equal its gradients.
One spawn runs every case (the processes start once); each test reads its case's result.
"""

from __future__ import annotations

import copy
import os
import socket
import traceback

import pytest
import torch
from test_checkpointing import HF  # the tiny Qwen3 and Qwen3-Next configs

import treefx
from treefx.models import enable_activation_checkpointing

transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

VOCAB = 64
WORLD = 2
# gradients: max |g - g_ref| / max |g_ref| per parameter within GRAD_TOL, or within
# FLOOR_FACTOR times the oracle's own floor for that parameter where that is larger
GRAD_TOL = 1e-5
FLOOR_FACTOR = treefx.verification.FLOOR_FACTOR
# (case, model, wrapper, how the step runs, activation checkpointing, reduction)
CASES = [
    ("fsdp-qwen3-compile", "qwen3", "fsdp", "compile", False, "mean"),
    ("fsdp-qwen3-step", "qwen3", "fsdp", "step", False, "mean"),
    ("fsdp-qwen3-checkpointing", "qwen3", "fsdp", "compile", True, "sum"),
    ("fsdp-qwen3_next-compile", "qwen3_next", "fsdp", "compile", False, "mean"),
    ("fsdp-qwen3_next-step", "qwen3_next", "fsdp", "step", True, "mean"),
    ("ddp-qwen3-compile", "qwen3", "ddp", "compile", False, "mean"),
    ("ddp-qwen3_next-step", "qwen3_next", "ddp", "step", True, "mean"),
]


def _model(name: str, checkpointing: bool):
    cfg = transformers.AutoConfig.for_model(name, vocab_size=VOCAB, **HF[name])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    if checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
        model.train()  # dropout is 0 in these configs
    return model


def _trees() -> list[treefx.Tree]:
    from treefx.tools.synth import odd_forest

    return odd_forest(3, VOCAB) + odd_forest(5, VOCAB) + odd_forest(7, VOCAB)[:1]


@treefx.step
def hf_step(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 labels=batch["labels"]).loss


def _case(rank, name, model_name, wrapper, how, checkpointing, reduction):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    trees = _trees()
    mine = treefx.distributed.assign(trees, WORLD)[rank]
    model = _model(model_name, checkpointing)
    oracle = copy.deepcopy(model)
    # one process on the union of all ranks' trees, the global mean over sequences
    treefx.reference.sequence_loss(oracle, trees, reduction=reduction).backward()
    if wrapper == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        held, inner = model, model
    else:
        held = DistributedDataParallel(model)
        inner = model
    batch = treefx.distributed.pack(mine, reduction=reduction)
    if how == "compile":
        tm = treefx.compile(held, backend="eager")
        loss = treefx.tree_loss(tm(batch), batch)
    else:
        if reduction != "mean":
            raise ValueError("the HF step computes the mean")
        loss = hf_step(held, batch)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    ref = dict(oracle.named_parameters())
    # The oracle's own floor per parameter: its gradients computed another way (other
    # shapes, one rounding more or less). Hugging Face's Gated DeltaNet runs in float32 with
    # cancellation on A_log and dt_bias: a fixed 1e-5 there is below that floor on some CPUs.
    spread = treefx.verification.oracle_floor_gradients(oracle, trees, reduction=reduction)

    def rel(a, r):
        return float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))

    worst, where = 0.0, None  # error / tolerance, worst over the parameters
    for n, p in inner.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        r = ref[n].grad
        tol = max(GRAD_TOL, FLOOR_FACTOR * rel(spread[n], r))
        if rel(g, r) / tol > worst:
            worst, where = rel(g, r) / tol, (n, rel(g, r), tol)
    ref_loss = treefx.reference.sequence_loss(oracle, trees, reduction=reduction)
    return {"loss": float(total) / WORLD, "ref_loss": float(ref_loss), "grad_err_over_tol": worst,
            "worst_param": where, "my_trees": len(mine), "params": len(ref)}


def _worker(rank: int, port: int, queue, case_fn, cases, world: int = WORLD) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case in cases:
            try:
                result = case_fn(rank, *case)
            except Exception:
                result = {"error": traceback.format_exc()}
            queue.put((rank, case[0], result))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# In CI: FSDP2 with checkpointing (compile), FSDP2 on the hybrid (step), DDP; the rest: -m slow.
CI_CASES = {"fsdp-qwen3-checkpointing", "fsdp-qwen3_next-step", "ddp-qwen3-compile"}


def run_cases(request, all_cases, case_fn, world: int = WORLD) -> dict:
    """``case_fn(rank, *case)`` on ``world`` gloo processes (default WORLD) for each case of
    ``all_cases`` (name first) that this session selected from the requesting test module, the
    processes started once for all of them: {(rank, name): result}. A case that no selected
    test names is not run; none selected: no processes."""
    import multiprocessing as mp

    wanted = {item.callspec.params["case"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    cases = [c for c in all_cases if c[0] in wanted]
    if not cases:
        return {}

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue, case_fn, cases, world))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    try:
        for _ in range(world * len(cases)):
            rank, name, result = queue.get(timeout=600)
            out[(rank, name)] = result
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


@pytest.fixture(scope="module")
def results(request):
    return run_cases(request, CASES, _case)


@pytest.mark.parametrize("case", [c[0] if c[0] in CI_CASES else
                                  pytest.param(c[0], marks=pytest.mark.slow) for c in CASES])
def test_gradients_equal_one_process_on_all_trees(results, case):
    for rank in range(WORLD):
        r = results[(rank, case)]
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["my_trees"] >= 1
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
        assert r["grad_err_over_tol"] <= 1.0, r  # (name, relative error, tolerance)
