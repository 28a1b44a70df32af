"""How close a profiled e2e step can come to the matmul rate without new kernels: the step split
into GEMMs and the rest, and the model FLOP/s with the host's idle time gone and the log-probs'
kernels at ``--bandwidth`` TB/s (BENCHMARKS.md, "Training step against sequence packing")."""

from __future__ import annotations

import argparse
import json

from benchmarks.e2e import report

_LOGPROB_KERNELS = ("_lse_kernel", "_grad_kernel")
_BYTES = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}


def budget(result: dict, method: str = "treefx", bandwidth_tb_s: float = 3.35) -> list[dict]:
    """One entry per (model, tree) the result profiled for ``method``: the step's FLOP/s share
    of the matmul rate as timed, without idle time, with the log-probs at ``bandwidth_tb_s``."""
    out = []
    for model, trees in result["runs"].items():
        m = result["models"][model]
        rate = result["matmul_rate"][model]
        for tree, methods in trees.items():
            run = methods.get(method)
            if not run or "profile" not in run:
                continue
            t = result["trees"][tree]
            prof = run["profile"]
            kinds = prof["by_kind_ms_per_step"]
            step = run["step_ms"]
            flops = report.model_flops(t, m, method)
            if flops is None:
                raise ValueError(f"{model}: the e2e report has no FLOP count for arch "
                                 f"{m.get('arch')!r} (or this tree's windowed pairs)")
            model_tflop = flops / 1e12
            # the report's own count without attention (its pairs weighted 0): the GEMMs'
            gemm_tflop = report._step_flops(t, m, "tree", 0.0) / 1e12
            logprob_ms = sum(ms for name, ms in prof["top_kernels_ms_per_step"]
                             if name in _LOGPROB_KERNELS)
            nbytes = 3 * t["tokens"] * m["vocab_size"] * _BYTES.get(m["dtype"], 2)
            logprob_floor_ms = nbytes / (bandwidth_tb_s * 1e12) * 1e3
            idle_ms = prof["host_gaps"]["gap_ms_per_step"]
            steps = {"as timed": step, "no idle time": step - idle_ms,
                     "no idle, log-probs at peak bandwidth":
                         step - idle_ms - max(logprob_ms - logprob_floor_ms, 0.0),
                     "the GEMMs' time alone (the rest free)": kinds["gemm"]}
            entry = {"model": model, "tree": tree, "step_ms": step,
                     "model_tflop": model_tflop, "attention_tflop": model_tflop - gemm_tflop,
                     "gemm_ms": kinds["gemm"], "gemm_tflops": gemm_tflop / kinds["gemm"] * 1e3,
                     "other_ms": {k: v for k, v in kinds.items() if k != "gemm"},
                     "idle_ms": idle_ms, "logprob_ms": logprob_ms,
                     "logprob_floor_ms": logprob_floor_ms,
                     "burst_tflops": rate["max_tflops"],
                     "sustained_tflops": rate.get("sustained_tflops"), "steps": {}}
            for name, ms in steps.items():
                tflops = model_tflop / ms * 1e3
                entry["steps"][name] = {
                    "ms": ms, "tflops": tflops, "of_burst": tflops / rate["max_tflops"],
                    "of_sustained": (tflops / rate["sustained_tflops"]
                                     if rate.get("sustained_tflops") else None)}
            out.append(entry)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.flop_budget",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="a benchmarks.e2e JSON with --profile")
    p.add_argument("--method", default="treefx")
    p.add_argument("--bandwidth", type=float, default=3.35, help="TB/s (default: H100 SXM)")
    args = p.parse_args(argv)
    with open(args.result) as f:
        entries = budget(json.load(f), args.method, args.bandwidth)
    if not entries:
        raise SystemExit(f"{args.result}: no profiled {args.method} run (benchmarks.e2e "
                         "--profile makes one)")
    for e in entries:
        print(f"{e['model']} {e['tree']}: {e['model_tflop']:.1f} TFLOP a step "
              f"({e['attention_tflop']:.1f} attention); GEMMs {e['gemm_ms']:.1f} ms at "
              f"{e['gemm_tflops']:.0f} TFLOP/s; the rest "
              + ", ".join(f"{k} {v:.1f}" for k, v in e["other_ms"].items())
              + f" ms; idle {e['idle_ms']:.1f} ms; log-probs' kernels {e['logprob_ms']:.1f} ms "
              f"(floor {e['logprob_floor_ms']:.1f}); matmul rate {e['burst_tflops']:.0f} burst"
              + (f", {e['sustained_tflops']:.0f} sustained" if e["sustained_tflops"] else ""))
        for name, s in e["steps"].items():
            sus = f", {100 * s['of_sustained']:.1f}% of sustained" if s["of_sustained"] else ""
            print(f"  {name:42s} {s['ms']:7.1f} ms  {s['tflops']:6.1f} TFLOP/s  "
                  f"{100 * s['of_burst']:5.1f}% of burst{sus}")
    return entries


if __name__ == "__main__":
    main()
