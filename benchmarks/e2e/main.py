"""``python -m benchmarks.e2e``: arguments, trees, then each model size through every chosen
method and tree (see the package docstring for what it measures): the timing of one method's
step (first call, warm-up, timed steps, peak memory, compilations), ``--profile`` (GPU time by
kernel kind, where the GPU waits for the host), the dry run's checks."""

from __future__ import annotations

import argparse
import math
import statistics
import time
import traceback

import numpy as np
import torch

import treefx
from treefx.ops.recurrence import backward_paths, kernel_runs

from .. import common
from ..common import (counts_delta, dynamo_counts, free_memory, is_oom, kernel_runs_delta,
                      loss_vs_oracle, oracle, repeat, save_json, timed)
from ..internals import tree_block_tensors
from .methods import (ARCH_SHAPES, BLOCK, EXTRA_METHODS, HYBRID_METHODS, MAKERS, METHODS,
                      TREE_ATTN, TREEFX_OBJECTS, Env, PackedData, build_model, make_body,
                      set_attn)
from .report import conventions, print_table, summarize, tree_info


def parse_args(argv=None):
    from . import __doc__ as doc

    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e",
                                description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_args(p, "CPU, tiny float32 model and trees, eager backends, exactness checks")
    p.add_argument("--hidden", default="1024,2048", help="comma-separated hidden sizes")
    p.add_argument("--por", default="0.3,0.5,0.75,0.85", help="target POR of each tree")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies all token lengths (tree size ~ proportional)")
    p.add_argument("--methods", default=None,
                   help=f"subset of {METHODS}, plus opt-in {EXTRA_METHODS} (default: "
                        f"{','.join(METHODS)}; for the hybrids {','.join(HYBRID_METHODS)})")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16,
                   help="attention heads of the qwen3 model (head_dim 128; "
                        "Qwen3-8B: --hidden 4096 --heads 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="its key/value heads")
    p.add_argument("--arch", choices=("qwen3", "qwen3_next", "qwen3_5"), default="qwen3",
                   help="qwen3 (attention; --hidden), or Qwen3-Next-80B-A3B's and Qwen3.5's "
                        "layer shapes (Gated DeltaNet + attention, 3:1; env.ARCH_SHAPES)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    for retired in ("--mask-reps", "--stream"):
        p.add_argument(retired, type=int, default=0, help="accepted and ignored (retired)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="also profile each measured step: GPU time by kernel kind")
    p.add_argument("--pack-budget", type=int, default=0,
                   help="packed_reset: micro-batches of at most max(N, longest sequence) "
                        "tokens (first-fit decreasing), gradients accumulated, as trainers "
                        "pack; 0: every sequence in one row")
    p.add_argument("--budget", type=float, default=480.0,
                   help="seconds; measurements not started by then are skipped (recorded)")
    p.add_argument("--quick", action="store_true",
                   help="hidden 1024 only, 1 warm-up + 3 reps")
    args = p.parse_args(argv)
    if args.methods is None:
        args.methods = ",".join(HYBRID_METHODS if args.arch in ARCH_SHAPES else METHODS)
    args.methods = [m for m in args.methods.split(",") if m]
    for m in args.methods:
        if m not in METHODS + EXTRA_METHODS:
            p.error(f"unknown method {m!r}; choose from {METHODS + EXTRA_METHODS}")
    args.hiddens = [int(h) for h in args.hidden.split(",") if h]
    if args.quick:
        args.hiddens = args.hiddens[:1]
        args.warmup, args.reps = 1, 3
    if args.dry_run:
        args.hiddens = args.hiddens[:1]
        args.warmup, args.reps = 1, 2
        args.vocab = 256
    if not torch.cuda.is_available() and not args.dry_run:
        p.error("no CUDA device: use --dry-run on the CPU")
    return args


def main(argv=None):
    args = parse_args(argv)
    global START
    t_start = START = time.perf_counter()
    deadline = t_start + args.budget
    env = Env(args)
    common.resolve_out(args, "e2e", env.cuda)
    common.bump_dynamo_limits()
    if env.cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    res = {"meta": common.run_meta(env.cuda),
           "config": {k: v for k, v in vars(args).items() if k != "hiddens"},
           "conventions": conventions(args, env), "trees": {}, "models": {}, "runs": {}}
    m = res["meta"]
    print(f"device: {m['device']}; torch {m['torch']}; transformers {m['transformers']}; "
          f"backend {env.backend}; dtype {env.dtype}", flush=True)

    trees = {}
    t0 = time.perf_counter()
    for por in [float(x) for x in args.por.split(",") if x]:
        label = f"por{por:g}"
        try:
            trees[label] = common.make_tree(por, args.scale * (0.03 if args.dry_run else 1.0),
                                            args.vocab, args.seed)
            res["trees"][label] = tree_info(trees[label])
        except Exception:
            res["trees"][label] = {"error": traceback.format_exc()[-2000:]}
        print(f"tree {label}: {res['trees'][label]}", flush=True)
    print(f"trees made in {time.perf_counter() - t0:.1f} s", flush=True)
    common.save_json(res, args.out)

    for hidden in args.hiddens:
        try:
            run_hidden(env, args, hidden, trees, res, deadline)
        except Exception:
            res.setdefault("errors", {})[f"hidden{hidden}"] = traceback.format_exc()[-4000:]
            print(f"hidden {hidden}: FAILED\n{traceback.format_exc()[-2000:]}", flush=True)
        common.save_json(res, args.out)

    res["summary"] = summarize(res)
    res["total_s"] = time.perf_counter() - t_start
    common.save_json(res, args.out)
    if env.dry and "dry_run_checks" in res:
        print_dry_checks(res["dry_run_checks"])
    print_table(res, res["summary"])
    print(f"total {res['total_s']:.0f} s; JSON: {args.out}")
    return res


START = time.perf_counter()  # reset by main(); the progress lines print seconds since


def run_hidden(env, args, hidden, trees, res, deadline) -> None:
    """Each method on each tree at ``hidden`` (an error but OOM skips its later trees)."""
    model, cfg = build_model(env, hidden, args)
    key = f"hidden{cfg['hidden_size']}"
    runs = res["runs"].setdefault(key, {})
    res["models"][key] = dict(cfg, layers=cfg["num_hidden_layers"],
                              params=sum(p.numel() for p in model.parameters()),
                              dtype=str(env.dtype))
    if env.cuda:
        tokens = max((t.num_tokens for t in trees.values()), default=8192)
        res.setdefault("matmul_rate", {})[key] = matmul_rate(env, cfg, tokens)
    parts: dict = {"prepare": {}}
    for name in args.methods:
        parts["prepare"][name] = MAKERS[name](env, model, parts, args)
    warmup, reps = args.warmup, args.reps
    for name in args.methods:
        broken = None
        for label, tree in trees.items():
            slot = runs.setdefault(label, {})
            if time.perf_counter() > deadline:
                slot[name] = {"skipped": "time budget (--budget) spent"}
                continue
            if broken:
                slot[name] = {"skipped": f"failed on an earlier tree ({broken})"}
                continue
            try:
                step = parts["prepare"][name](tree)
                runs0, back0 = kernel_runs(), backward_paths()
                r = measure(env, step, warmup, reps)
                if getattr(step, "micro_batches", None):  # packed_reset --pack-budget
                    r["micro_batch_tokens"] = step.micro_batches
                r.update(recurrence_paths(runs0, kernel_runs()))
                if "recurrence_kernels" in r:  # its backward: the forward's graph or recomputed
                    r["recurrence_backward"] = {k: v - back0[k]
                                                for k, v in backward_paths().items()}
                if not math.isfinite(r["loss"]):  # a wrong result, not a timing
                    raise FloatingPointError(f"the step's loss is {r['loss']}")
                if args.profile and env.cuda:
                    r["profile"] = profile_step(env, step)
                if name in TREEFX_OBJECTS:
                    obj = parts[TREEFX_OBJECTS[name]]
                    r["treefx_compilations_total"] = obj.num_compilations
                    report = getattr(obj, "verification", None)
                    # the first-call check (the compilation on its probe included) and its
                    # stages; where the first step went (treefx's passes, the compilation)
                    r["first_call_check_s"] = getattr(report, "seconds", None)
                    r["check_stages_s"] = {k: round(v, 2) for k, v in
                                           getattr(report, "stage_seconds", {}).items()}
                    r["treefx_timings_s"] = {k: round(v, 2) for k, v in obj.timings.items()}
                    r["compile_metrics_s"] = compile_metrics()
                    r["compile_cache"] = compile_cache_counters()
                slot[name] = r
                msg = (f"{r['step_ms']:.1f} ms, first step {r['first_step_s']:.1f} s, peak "
                       f"{r.get('peak_gib', 0):.1f} GiB, {r.get('treefx_timings_s', '')}")
            except Exception as e:
                slot[name] = {"error": traceback.format_exc()[-4000:]}
                msg = "FAILED: " + (str(e).strip().splitlines() or [""])[0][:200]
                if not is_oom(e):
                    broken = label
            free_memory(model, env.cuda)
            print(f"[{time.perf_counter() - START:5.0f}s] [{key}] {name:10s} {label}: {msg}",
                  flush=True)
            save_json(res, args.out)
    if env.dry and args.arch == "qwen3":
        try:
            res["dry_run_checks"] = dry_checks(env, model, trees, parts)
        except Exception:
            res["dry_run_checks"] = {"error": traceback.format_exc()[-4000:]}
        save_json(res, args.out)
    del parts, model
    free_memory(None, env.cuda)
    try:
        torch._dynamo.reset()
    except Exception:
        pass


def recurrence_paths(before: dict, after: dict) -> dict:
    """The tree recurrences' kernel paths during a measurement: ``recurrence_kernels``
    {"name:path": runs} and ``recurrence_on``, "fla" (every run on fla's kernels), "torch"
    (none) or "mixed"; nothing for a model without a recurrence."""
    delta = kernel_runs_delta(before, after)
    if not delta:
        return {}
    fast = sum(v for k, v in delta.items() if k.endswith((":varlen", ":tree")))
    on = "fla" if fast == sum(delta.values()) else "torch" if fast == 0 else "mixed"
    return {"recurrence_kernels": delta, "recurrence_on": on}


def compile_cache_counters() -> dict[str, int]:
    """Hits and misses of Inductor's and AOTAutograd's on-disk caches, process-wide so far."""
    from torch._dynamo.utils import counters

    out = {}
    for group in ("inductor", "aot_autograd"):
        for k, v in counters[group].items():
            if "cache" in k and ("hit" in k or "miss" in k or "bypass" in k):
                out[f"{group}.{k}"] = int(v)
    return out


def compile_metrics(top: int = 14) -> dict[str, float]:
    """torch.compile's own timers, process-wide so far (seconds; the largest ``top``)."""
    from torch._dynamo.utils import compilation_time_metrics

    sums = {k: sum(v) for k, v in compilation_time_metrics.items() if not k.startswith("pass.")}
    return {k: round(v, 2) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:top]}


def measure(env, step, warmup: int, reps: int) -> dict:
    """First step (may compile), warm-up, then ``reps`` timed steps: CUDA events on the GPU,
    wall clock on the CPU. Peak memory over the timed steps."""
    c0 = dynamo_counts()
    t0 = time.perf_counter()
    loss = step()
    env.sync()
    first_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        step()
    env.sync()
    c1 = dynamo_counts()
    if env.cuda:
        torch.cuda.reset_peak_memory_stats()
    times, walls = [], []
    for _ in range(reps):
        w0 = time.perf_counter()
        loss, ms = timed(step, env.cuda)
        times.append(ms)
        walls.append((time.perf_counter() - w0) * 1e3)
    c2 = dynamo_counts()
    out = {
        "step_ms": statistics.median(times),
        "step_ms_all": times,
        "wall_ms": statistics.median(walls),
        "first_step_s": first_s,
        "loss": float(loss),
        "dynamo_warmup": counts_delta(c0, c1),
        "dynamo_timed": counts_delta(c1, c2),
        "timing": "cuda_events" if env.cuda else "cpu_wall_clock",
    }
    if env.cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def matmul_rate(env, cfg: dict, tokens: int, reps: int = 20) -> dict | None:
    """The GPU's bf16 ``torch.mm`` rate at the model's shapes for ``tokens`` rows (the MLP's up
    and down projections, the output projection) and at 8192^3, median of ``reps`` after 3
    warm-up calls, and the first shape's sustained rate (:func:`_sustained_rate`)."""
    if not env.cuda:
        return None
    h, f, v = cfg["hidden_size"], cfg.get("intermediate_size", 3 * cfg["hidden_size"]), \
        cfg["vocab_size"]
    shapes = [(tokens, h, f), (tokens, f, h), (tokens, h, v), (8192, 8192, 8192)]
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ms = statistics.median(repeat(lambda: torch.mm(a, b), reps, True, warmup=3))
        out.append({"m": m, "k": k, "n": n, "ms": ms, "tflops": 2 * m * k * n / ms / 1e9})
        del a, b
    sustained = _sustained_rate(*shapes[0], out[0]["ms"])
    torch.cuda.empty_cache()
    return {"shapes": out, "max_tflops": max(s["tflops"] for s in out), **sustained}


def _sustained_rate(m: int, k: int, n: int, ms: float, span_ms: float = 250.0) -> dict:
    """The first shape back to back for ~``span_ms``, timed as one: the sustained clock."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    reps = max(1, round(span_ms / ms))

    def run():
        for _ in range(reps):
            torch.mm(a, b)

    total = statistics.median(repeat(run, 3, True, warmup=1))
    del a, b
    return {"sustained_tflops": 2 * m * k * n * reps / total / 1e9, "sustained_ms": total,
            "sustained_shape": [m, k, n]}


# ----------------------------------------------------------------------------- --profile

_KERNEL_KINDS = (  # (category, name fragments), first match wins
    ("attention", ("flex_attention", "triton_tem", "flash", "fmha", "cudnn", "attention")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "splitk")),
    # Before copy/fill: Inductor names a fused kernel after its ops, so RoPE or SiLU fused
    # with a dtype cast is "triton_poi_fused__to_copy_...", which is pointwise work.
    ("triton pointwise/reduction", ("triton_poi", "triton_red", "triton_per")),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, frags in _KERNEL_KINDS:
        if any(f in low for f in frags):
            return kind
    return "other"


def profile_step(env, step, steps: int = 2) -> dict:
    """GPU kernel time of ``steps`` steps by kind (torch.profiler), the busiest kernels, and
    how much of the steps' span the GPU was busy (the rest: waiting for the host)."""
    from torch.profiler import ProfilerActivity, profile

    env.sync()
    w0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        env.sync()
    wall_ms = (time.perf_counter() - w0) * 1e3
    by_name: dict[str, float] = {}
    spans = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        by_name[e.name] = by_name.get(e.name, 0.0) + us
        spans.append((e.time_range.start, e.time_range.end))
    kinds: dict[str, float] = {}
    for name, us in by_name.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us
    busy = sum(by_name.values())
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    cpu = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CPU]
    return {
        "host_gaps": host_gaps(spans, cpu, steps),
        "steps": steps, "wall_ms_per_step": wall_ms / steps,
        "gpu_busy_ms_per_step": busy / 1e3 / steps,
        "gpu_span_ms_per_step": span / 1e3 / steps,
        "by_kind_ms_per_step": {k: v / 1e3 / steps for k, v in sorted(kinds.items(),
                                                                        key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": [(n[:160], us / 1e3 / steps) for n, us in top],
        "kernel_launches_per_step": sum(1 for _ in spans) / steps,
    }


def host_gaps(kernels, cpu, steps: int, min_us: float = 20.0) -> dict:
    """Where the GPU waits for the host: the gaps of at least ``min_us`` between kernels
    (``kernels``: (start, end) in µs), each CPU event's overlap with them (inclusive: a
    parent and its child both count), and the largest gaps with the innermost CPU event
    covering most of each."""
    if not kernels:
        return {}
    merged = []
    for s0, e0 in sorted(kernels):
        if merged and s0 <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e0)
        else:
            merged.append([s0, e0])
    gaps = [(a[1], b[0]) for a, b in zip(merged, merged[1:]) if b[0] - a[1] >= min_us]
    if not gaps or not cpu:
        return {"gaps": len(gaps), "gap_ms_per_step": sum(b - a for a, b in gaps) / 1e3 / steps}
    cs = np.array([c[0] for c in cpu], dtype=np.float64)
    ce = np.array([c[1] for c in cpu], dtype=np.float64)
    names = [c[2] for c in cpu]
    by_name: dict[str, float] = {}
    largest = []
    for g0, g1 in gaps:
        ov = np.clip(np.minimum(ce, g1) - np.maximum(cs, g0), 0, None)
        for i in np.flatnonzero(ov > 0):
            by_name[names[i]] = by_name.get(names[i], 0.0) + float(ov[i])
        cover = np.flatnonzero(ov >= 0.5 * (g1 - g0))
        inner = names[cover[np.argmin(ce[cover] - cs[cover])]] if cover.size else None
        largest.append((g1 - g0, inner))
    largest.sort(key=lambda x: -x[0])
    return {
        "gaps": len(gaps),
        "gap_ms_per_step": sum(b - a for a, b in gaps) / 1e3 / steps,
        "cpu_events_in_gaps_ms_per_step": [
            (n[:120], us / 1e3 / steps)
            for n, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:30]],
        "largest_gaps_us": [(round(us, 1), n and n[:120]) for us, n in largest[:15]],
    }


def dry_checks(env, model, trees, parts) -> dict:
    """The dry run's exactness checks (CPU, float32): every method's loss and gradients against
    the per-sequence oracle (through its loss and ``.grad``: not always a treefx model), and the
    FlexAttention forward of the packed and tree BlockMasks against the dense masks the CPU
    steps use."""
    out = {}
    for label, tree in trees.items():
        set_attn(model, TREE_ATTN)
        ref = oracle(model, tree, reduction="mean")
        entry = {"reference_loss": ref[0]}
        for name in parts["prepare"]:
            step = parts["prepare"][name](tree)
            loss = step()
            entry[name] = loss_vs_oracle(model, loss, ref)
        out[label] = entry

    # FlexAttention's forward (no backward on the CPU) through the same HF plumbing
    flex_body = make_body(env, model, "flex")
    dense_body = make_body(env, model, "dense")
    for label, tree in trees.items():
        batch = treefx.pack(tree, reduction="mean")
        data = PackedData(tree)
        ids, pos, ends, _, _ = data.layout()
        rows = {
            "tree": (batch.input_ids, batch.position_ids, batch.subtree_end),
            "packed": (torch.from_numpy(ids)[None], torch.from_numpy(pos)[None],
                       torch.from_numpy(ends)),
        }
        res = {}
        c0 = dynamo_counts()
        with torch.no_grad():
            for kind, (i, p, e) in rows.items():
                blocks = tree_block_tensors(e, BLOCK)[:4]
                set_attn(model, TREE_ATTN)
                h_dense = dense_body(i, p, e, blocks)
                set_attn(model, "flex_attention")
                h_flex = flex_body(i, p, e, blocks)
                res[f"{kind}_flex_vs_dense_max_abs"] = (h_flex - h_dense).abs().max().item()
        set_attn(model, TREE_ATTN)
        res["dynamo"] = counts_delta(c0, dynamo_counts())
        out[label]["flex_forward"] = res
    return out


def print_dry_checks(checks: dict) -> None:
    """Per tree: each method's loss and worst gradient errors, FlexAttention's difference."""
    for label, e in checks.items():
        print(f"dry-run check {label}: " + ("FAILED" if label == "error" else str(
            {m: [v[k] for k in ("loss_rel_err", "max_rel_grad_err")] if "loss_rel_err" in v
             else v for m, v in e.items() if isinstance(v, dict)})))
