"""One model size through every chosen method and tree."""

from __future__ import annotations

import math
import time
import traceback

import torch

from treefx.ops.recurrence import backward_paths, kernel_runs

from ..common import free_memory, is_oom, kernel_runs_delta, save_json
from .dry_checks import dry_checks
from .env import build_model
from .measure import matmul_rate, measure
from .methods import MAKERS, TREEFX_OBJECTS
from .profile import profile_step

START = time.perf_counter()  # reset by main(); the progress lines print seconds since


def run_hidden(env, args, hidden, trees, res, deadline) -> None:
    """Time each method on each tree at ``hidden`` (an error other than out-of-memory skips
    the method's later trees), saving the JSON after every measurement."""
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
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    out = {}
    for group in ("inductor", "aot_autograd"):
        for k, v in counters[group].items():
            if "cache" in k and ("hit" in k or "miss" in k or "bypass" in k):
                out[f"{group}.{k}"] = int(v)
    return out


def compile_metrics(top: int = 14) -> dict[str, float]:
    """torch.compile's own timers, process-wide so far (seconds; the largest ``top``)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    sums = {k: sum(v) for k, v in compilation_time_metrics.items() if not k.startswith("pass.")}
    return {k: round(v, 2) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:top]}

