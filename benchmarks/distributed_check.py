"""Several GPUs: FSDP2 on a Qwen3-Next hybrid and DDP on Qwen3, exact against one process and
timed against sequence packing (issue 37; BENCHMARKS.md, "Several GPUs"). One process per GPU:

    torchrun --nproc_per_node=2 -m benchmarks.distributed_check
    torchrun --nproc_per_node=2 -m benchmarks.distributed_check --cases fsdp-hybrid-exact,ddp-exact
    torchrun --nproc_per_node=2 -m benchmarks.distributed_check --dry-run   # CPU, gloo, tiny

- ``fsdp-hybrid-exact`` / ``ddp-exact``: float32 Qwen3-Next under FSDP2 (checkpointed) / Qwen3
  under DDP; odd forests (and on the GPU an agent tree) assigned over the ranks, trained whole
  and in parts of (rank + 1) × 256 tokens; the gathered gradients against one process running
  every sequence alone, per parameter within max(1e-5, 4 × the oracle's floor), reported per
  parameter group; the loss within 1e-5.
- ``fsdp-hybrid-speed`` / ``ddp-speed``: a Qwen3-Next-shaped model under FSDP2 (bf16 compute)
  / Qwen3-1.7B's layers under DDP, synthetic agent trees; treefx whole or in parts of
  ``--budget`` against packing's micro-batches of the same budget (zero-weight padding ones
  under FSDP2), lr 0: first step, median step, peak memory, share of the token-count bound.

Rank 0 writes the JSON after every case; ``--time-limit`` skips what would start past it; the
exit status is 1 when a case fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import re
import statistics
import time
import traceback

import torch
import torch.distributed as dist

import treefx

from . import common
from .common import SHAPES, check_forest, odd_forest
from .gpu_check import SMALL, TINY, _kernels
from .real_trees import packing_batches

GRAD_TOL = 1e-5  # per parameter, or FLOOR_FACTOR × the oracle's own floor where larger
FLOOR_FACTOR = treefx.verification.FLOOR_FACTOR
# A parameter's gradient is compared relative to its largest entry, or to this share of the
# model's largest where that is more (treefx.verify's floor): with Hugging Face's random
# initialization most Gated DeltaNet heads decay to ~0 at once: their A_log and dt_bias
# gradients are ~1e-5 of the model's largest, sums that cancel down to rounding error
SCALE_FLOOR = treefx.verification.Tolerance.floor
LOSS_TOL = 1e-5
# treefx's loss against packing's in the speed cases (a sanity check: the same data and
# normalization), float32 (dry run) and bf16
SPEED_LOSS_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PAD_TOKENS = 16  # a zero-weight micro-batch's length (FSDP2 packing: ranks in step)


def _hybrid(hidden, intermediate, layers, heads, kv_heads, head_dim, k_heads, v_heads, k_dim,
            vocab) -> dict:
    """A Qwen3-Next config: a full-attention layer after every three linear-attention ones
    (the last layer full), dense MLPs."""
    types = ["full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "linear_attention"
             for i in range(layers)]
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
                linear_key_head_dim=k_dim, linear_value_head_dim=k_dim,
                linear_conv_kernel_dim=4, layer_types=types, num_experts=0,
                mlp_only_layers=list(range(layers)), vocab_size=vocab,
                tie_word_embeddings=False)


EXACT_HYBRID = _hybrid(256, 512, 4, 8, 2, 32, 4, 8, 32, 1024)
DRY_HYBRID = _hybrid(32, 64, 2, 4, 2, 8, 2, 4, 8, 1024)
PARTS_BUDGET = {False: 256, True: 8}  # rank r: (r + 1) × this (GPU, dry run)


def _say(msg: str, t0: float) -> None:
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)


def _gathered(values) -> list:
    """One value per rank (every rank calls it)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def _mean_over_ranks(x: torch.Tensor, dev) -> float:
    t = x.detach().to(dev, torch.float64).reshape(1).clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _grads(model) -> dict:
    """Every parameter's whole gradient (FSDP2's shards gathered: every rank calls it), the
    ``.grad`` then cleared."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[n] = None if g is None else g.detach().clone()
    model.zero_grad(set_to_none=True)
    return out


def _float64_oracle_grads(model, trees) -> dict:
    """The oracle's gradients computed in float64 throughout (a float64 copy of ``model``,
    with Hugging Face's casts to float32 lifted: ``treefx.tools.zoo.float64_throughout``):
    the true values the float32 oracle rounds. Gated DeltaNet's kernels compute in float32 with
    cancellation on A_log and dt_bias; perturbing the oracle's inputs by one rounding
    (``oracle_floor_gradients``) gave a floor of 2e-7 there while the float32 oracle was
    1.3e-5 from these values (tests/test_hybrid.py, BENCHMARKS.md)."""
    from treefx.tools.zoo import float64_throughout

    wide = copy.deepcopy(model).double()
    wide.zero_grad(set_to_none=True)
    if getattr(wide, "is_gradient_checkpointing", False):
        # the same gradients; a recomputation in the backward would run outside the mode
        wide.gradient_checkpointing_disable()
    with float64_throughout():
        treefx.reference.sequence_loss(wide, trees, reduction="mean").backward()
    out = {n: torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad
           for n, p in wide.named_parameters()}
    del wide
    return out


def _verdict(grads: dict, loss: float, oracle, ref_loss: float, floors: list) -> dict:
    """Rank 0: the gathered gradients and the loss against the one-process oracle's. A
    parameter's error is max |g - g_ref| over max(max |g_ref|, SCALE_FLOOR × the largest
    |g_ref| of the model); the oracle's floor likewise, the largest over ``floors`` (the
    oracle's gradients computed another way: perturbed by one rounding, and in float64)."""
    refs = {n: torch.zeros_like(p) if p.grad is None else p.grad
            for n, p in oracle.named_parameters()}
    scale = SCALE_FLOOR * max(float(r.abs().max()) for r in refs.values())
    groups, worst, where = {}, 0.0, None
    for n, r in refs.items():
        g = torch.zeros_like(r) if grads[n] is None else grads[n]
        err = common.max_rel(g, r, scale)
        fl = max(common.max_rel(f[n].to(r.dtype), r, scale) for f in floors)
        tol = max(GRAD_TOL, FLOOR_FACTOR * fl)
        grp = groups.setdefault(re.sub(r"\.\d+\.", ".*.", n),
                                {"max_rel_err": 0.0, "max_oracle_floor": 0.0,
                                 "max_err_over_tol": 0.0})
        grp["max_rel_err"] = max(grp["max_rel_err"], err)
        grp["max_oracle_floor"] = max(grp["max_oracle_floor"], fl)
        grp["max_err_over_tol"] = max(grp["max_err_over_tol"], err / tol)
        if err / tol >= worst:
            worst, where = err / tol, [n, err, tol]
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    return {"loss": loss, "ref_loss": ref_loss, "loss_rel_err": loss_err,
            "max_err_over_tol": worst, "worst_param": where, "groups": groups,
            "passed": loss_err <= LOSS_TOL and worst <= 1.0}


def _wrap(model, wrapper: str, dev, mp_policy=None):
    """FSDP2 (the model itself, sharded) or its DDP wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    if wrapper == "fsdp":
        return common.fsdp_shard(model, mp_policy)
    return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)


def exact(ctx, model_type: str, config: dict, wrapper: str, checkpointing: bool) -> dict:
    """Whole trees and parts on every rank against one process on all trees (rank 0)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev, rank, world = ctx["dev"], dist.get_rank(), dist.get_world_size()
    vocab = config["vocab_size"]
    trees = odd_forest(3, vocab) + odd_forest(5, vocab)
    if not ctx["dry_run"]:  # two odd trees more and an agent tree of 6,098 tokens
        trees += check_forest(vocab)
    mine = treefx.distributed.assign(trees, world)[rank]
    model = common.dist_build(model_type, config, dev, checkpointing)
    out = {"model": model_type, "config": config, "wrapper": wrapper,
           "checkpointing": checkpointing, "trees": len(trees),
           "tokens": sum(t.num_tokens for t in trees),
           "sequences": sum(t.num_sequences for t in trees),
           "trees_per_rank": _gathered(len(mine))}
    if rank == 0:
        oracle = copy.deepcopy(model)
        ref_loss = treefx.reference.sequence_loss(oracle, trees, reduction="mean")
        ref_loss.backward()
        floors = [treefx.verification.oracle_floor_gradients(oracle, trees, reduction="mean"),
                  _float64_oracle_grads(model, trees)]
        _say(f"  oracle: {out['sequences']} sequences alone, and its floors (perturbed, "
             "float64)", ctx["t0"])
    held = _wrap(model, wrapper, dev)
    tm = treefx.compile(held, backend=ctx["backend"], verify=False)

    batch = treefx.distributed.pack(mine, reduction="mean")
    b = batch.to(dev)
    loss = treefx.tree_loss(tm(b), b)
    loss.backward()
    runs = {"whole": (_mean_over_ranks(loss, dev), _grads(model))}
    _say("  whole trees: done", ctx["t0"])

    budget = PARTS_BUDGET[ctx["dry_run"]] * (rank + 1)
    plan = treefx.parts.plan(batch, budget, recompute=wrapper != "fsdp")
    out["parts_budget_per_rank"] = _gathered(budget)
    out["parts_per_rank"] = _gathered(plan.num_parts)
    loss = treefx.backward(tm, batch, max_tokens=budget)
    runs["parts"] = (_mean_over_ranks(loss, dev), _grads(model))
    _say(f"  parts: {out['parts_per_rank']} per rank", ctx["t0"])
    if rank == 0:
        for how, (loss, grads) in runs.items():
            out[how] = _verdict(grads, loss, oracle, float(ref_loss), floors)
            print(f"  {how}: loss rel err {out[how]['loss_rel_err']:.2e}, worst gradient "
                  f"{out[how]['worst_param']} (name, rel err, tol) -> "
                  f"{'PASS' if out[how]['passed'] else 'FAIL'}", flush=True)
        out["passed"] = all(out[how]["passed"] for how in runs)
    return out


def _packing(mine, budget: int, batch, fsdp: bool, dev) -> tuple[list, int]:
    """The rank's packed micro-batches on ``dev`` (every sequence a chain, the global mean) and
    how many zero-weight ones were added (FSDP2: as many micro-batches on every rank)."""
    micro = packing_batches(mine, budget, num_sequences=batch.num_sequences_normalizer,
                            loss_scale=batch.loss_scale)
    pad = 0
    if fsdp:
        pad = max(_gathered(len(micro))) - len(micro)
        zero = treefx.Tree.from_sequences([[0] * PAD_TOKENS], weights=[0.0])
        micro += [treefx.pack(zero, reduction="mean", num_sequences=batch.num_sequences_normalizer,
                              loss_scale=batch.loss_scale)] * pad
    return [m.to(dev) for m in micro], pad


def _timed(step, ctx) -> dict:
    """The first step (compiles), one more, then the median of ``--steps``: seconds, with the
    ranks synchronized around each; the first step's loss (mean over ranks) and peak memory."""
    dev = ctx["dev"]
    common.dist_sync(dev)
    t0 = time.perf_counter()
    loss = step()
    common.dist_sync(dev)
    first = time.perf_counter() - t0
    step()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(ctx["steps"]):
        common.dist_sync(dev)
        t0 = time.perf_counter()
        step()
        common.dist_sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    return {"first_step_s": round(first, 2), "step_s": round(statistics.median(times), 4),
            "loss": _mean_over_ranks(loss, dev), "peak_gib_per_rank": _gathered(peak)}


def speed(ctx, model_type: str, config: dict, wrapper: str) -> dict:
    """treefx against packing, the same model, data and budget."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.backends.cuda.matmul.allow_tf32 = True
    dev, rank, world = ctx["dev"], dist.get_rank(), dist.get_world_size()
    fsdp = wrapper == "fsdp"
    low = torch.bfloat16 if dev.type == "cuda" else torch.float32
    trees = common.tree_pool(world, ctx["tokens"], ctx["por"], config["vocab_size"], **ctx["lengths"])
    mine = treefx.distributed.assign(trees, world)[rank]
    t0 = time.perf_counter()
    model = common.dist_build(model_type, config, dev, True, dtype=torch.float32 if fsdp else low)
    held = _wrap(model, wrapper, dev,
                 MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32))
    build_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # its cost; the weights stay
    tm = treefx.compile(held, backend=ctx["backend"], logits=False, verify=False)

    batch = treefx.distributed.pack(mine, reduction="mean")
    tree_tokens = _gathered(batch.num_tokens)
    seq_tokens = _gathered(sum(t.num_baseline_tokens for t in mine))
    budget = ctx["budget"] or max(tree_tokens)
    micro, pad = _packing(mine, budget, batch, fsdp, dev)
    whole = None if ctx["budget"] else batch.to(dev)

    def treefx_step():
        if ctx["budget"]:
            loss = treefx.backward(tm, batch, max_tokens=budget)
        else:
            loss = treefx.tree_loss(tm(whole), whole)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def packing_step():
        total = torch.zeros((), device=dev)
        for i, m in enumerate(micro):
            last = i == len(micro) - 1
            if fsdp:
                model.set_requires_gradient_sync(last)
            with contextlib.nullcontext() if fsdp or last else held.no_sync():
                loss = treefx.tree_loss(tm(m), m)
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    out = {"model": model_type, "config": config, "wrapper": wrapper,
           "precision": f"float32 masters, {str(low)[6:]} compute (FSDP2 mixed precision)"
           if fsdp else f"{str(low)[6:]} parameters", "checkpointing": True,
           "build_s": round(build_s, 1),
           "trees": len(trees), "trees_per_rank": _gathered(len(mine)),
           "tree_tokens_per_rank": tree_tokens, "sequence_tokens_per_rank": seq_tokens,
           "por": round(1 - sum(tree_tokens) / sum(seq_tokens), 3),
           "treefx_mode": f"parts of {budget}" if ctx["budget"] else "whole trees",
           "packing_budget": budget, "micro_batches_per_rank": _gathered(len(micro)),
           "padding_micro_batches_per_rank": _gathered(pad)}
    out["treefx"] = _timed(treefx_step, ctx)
    _say(f"  treefx: {out['treefx']}", ctx["t0"])
    if _past_limit(ctx):
        out["packing"] = "skipped: time limit"
        return out
    out["packing"] = _timed(packing_step, ctx)
    _say(f"  packing: {out['packing']}", ctx["t0"])
    out["captures"] = [x.num_compiled for v in tm.engine._regional.values() for x in v]
    bound = sum(seq_tokens) / sum(tree_tokens)
    speedup = out["packing"]["step_s"] / out["treefx"]["step_s"]
    loss_diff = abs(out["treefx"]["loss"] - out["packing"]["loss"]) / abs(out["packing"]["loss"])
    out.update(token_bound=round(bound, 3), speedup=round(speedup, 3),
               share_of_bound=round(speedup / bound, 3), loss_rel_diff=loss_diff,
               passed=loss_diff <= SPEED_LOSS_TOL[low])
    return out


CASES = {
    "fsdp-hybrid-exact": lambda ctx: exact(ctx, "qwen3_next", ctx["shapes"]["exact_hybrid"],
                                           "fsdp", checkpointing=True),
    "ddp-exact": lambda ctx: exact(ctx, "qwen3", ctx["shapes"]["exact_qwen3"], "ddp",
                                   checkpointing=False),
    "fsdp-hybrid-speed": lambda ctx: speed(ctx, "qwen3_next", ctx["shapes"]["speed_hybrid"],
                                           "fsdp"),
    "ddp-speed": lambda ctx: speed(ctx, "qwen3", ctx["shapes"]["speed_qwen3"], "ddp"),
}


def _past_limit(ctx) -> bool:
    """Rank 0's clock decides for every rank (they must skip the same work)."""
    flag = [ctx["time_limit"] is not None
            and time.perf_counter() - ctx["t0"] > ctx["time_limit"]]
    dist.broadcast_object_list(flag, src=0)
    return flag[0]


def main(argv=None):
    p = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m benchmarks.distributed_check",
                                description=__doc__.split("\n\n")[0])
    common.add_run_args(p, "CPU, gloo, tiny shapes, eager backend, every case")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    p.add_argument("--tokens", type=int, default=16384, help="speed: unique tree tokens per rank")
    p.add_argument("--por", type=float, default=0.8, help="speed: the trees' POR")
    p.add_argument("--layers", type=int, default=8, help="speed: decoder layers of both models")
    p.add_argument("--budget", type=int, default=None,
                   help="speed: treefx in parts of this many tokens and packing's micro-batch "
                        "budget (default: trees whole, packing at the largest rank's tokens)")
    p.add_argument("--steps", type=int, default=3, help="speed: timed steps after the first two")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds: a case (or packing's timing) that would start later is skipped")
    args = p.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; of {', '.join(CASES)}")

    t0 = time.perf_counter()
    dev = common.dist_setup(args.dry_run)
    cuda = dev.type == "cuda"
    if args.dry_run:
        torch.set_num_threads(1)
    rank = dist.get_rank()
    qwen3 = dict(SHAPES["tiny" if args.dry_run else "qwen3-1.7b"], num_hidden_layers=(
        SHAPES["tiny"]["num_hidden_layers"] if args.dry_run else args.layers))
    ctx = {"dev": dev, "dry_run": args.dry_run, "t0": t0, "backend": "inductor" if cuda
           else "eager", "tokens": 300 if args.dry_run else args.tokens,
           "lengths": common.scaled_lengths(0.03) if args.dry_run else {},
           "por": args.por, "budget": args.budget, "steps": 1 if args.dry_run else args.steps,
           "time_limit": args.time_limit,
           "shapes": {"exact_hybrid": DRY_HYBRID if args.dry_run else EXACT_HYBRID,
                      "exact_qwen3": dict(TINY if args.dry_run else SMALL),
                      "speed_hybrid": DRY_HYBRID if args.dry_run else
                      _hybrid(2048, 5632, args.layers, 16, 2, 256, 16, 32, 128, 151936),
                      "speed_qwen3": qwen3}}
    if rank == 0:
        common.resolve_out(args, "distributed_check", cuda)
    res = {**common.run_meta(cuda), "world_size": dist.get_world_size(),
           "gdn_varlen_fast_path": _kernels(),
           "fla_installed": importlib.util.find_spec("fla") is not None}
    _say(f"world {res['world_size']} on {res['device']}; Gated DeltaNet: "
         f"{'fla' if res['fla_installed'] else 'the Hugging Face torch kernel (no fla)'}", t0)
    failed = []
    for name in args.cases.split(","):
        if _past_limit(ctx):
            res[name] = "skipped: time limit"
            _say(f"{name}: skipped (time limit)", t0)
            continue
        _say(f"{name}: start", t0)
        c0 = time.perf_counter()
        try:
            res[name] = CASES[name](ctx)
            ok = rank != 0 or res[name].get("passed", False)
        except Exception:
            res[name] = {"error": traceback.format_exc()}
            ok = False
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        res[name]["seconds"] = round(time.perf_counter() - c0, 1)
        if not ok:
            failed.append(name)
        _say(f"{name}: {'ok' if ok else 'FAILED'} in {res[name]['seconds']} s", t0)
        if rank == 0:
            common.save_json(res, args.out)
    for rank_failed in _gathered(failed):
        failed += [n for n in rank_failed if n not in failed]
    if rank == 0:
        print(json.dumps({k: v for k, v in res.items() if isinstance(v, dict)}, indent=1,
                         default=str), flush=True)
        verdicts = {n: (res[n] if isinstance(res[n], str) else
                        "FAILED" if n in failed else "passed") for n in args.cases.split(",")}
        print("verdicts: " + ", ".join(f"{n} {v}" for n, v in verdicts.items()), flush=True)
        print(f"written to {args.out}", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
