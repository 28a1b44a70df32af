"""The fused per-token log-probability op (``treefx.ops.logprobs.fast``) at an 8B model's output
shape: its backward over vocabulary slices (each slice of the weight's gradient one matrix
product, written once) against the token-chunked backward it replaced (every chunk of ~900
tokens added a [vocab, hidden] float32 product into the weight's gradient).

    python -m benchmarks.logprobs                    # GPU: hidden 4096, vocab 151,936, bf16
    python -m benchmarks.logprobs --dry-run          # CPU: tiny shapes
    python -m benchmarks.logprobs --paths 17187      # GPU: the output layer's three paths

``--paths N``: at N tokens, the output layer of a training step (hidden states and the
projection's weight requiring grad, every token trained) three ways, forward + backward and
forward alone under ``torch.no_grad()``: the logits materialized (``F.linear``, then
``tree_token_logprobs``, compiled by Inductor as in ``treefx.compile``'s default), the fused
log-probabilities (``logits=False``: the backward recomputes the logits, four matrix
products against three), and the fused loss (``@treefx.step``: its gradients made in the
forward, three products); the matrix products alone (the three a materialized step needs) as
the floor. Median of ``--reps`` after two warm-up calls, CUDA events; peak memory above the
inputs.

Per token count: the median time of forward + backward over ``--reps`` (after a warm-up), the
peak memory above the inputs, and each backward's gradients against a float32 computation of
the same bf16 inputs (relative Frobenius error, so both are judged on the same scale).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks import common
from treefx.ops.cross_entropy import fast as ce
from treefx.ops.logprobs import fast as lp_ops


def _token_chunked_backward(grad, h, weight, ids, parent, lse):
    """The replaced backward (no bias): chunks of tokens over the whole vocabulary, the
    weight's gradient summed in float32 chunk by chunk."""
    acc = torch.float32
    g = torch.where(parent >= 0, grad.float(), torch.zeros_like(grad, dtype=acc))
    dh = torch.zeros(h.shape, dtype=acc, device=h.device)
    dw = torch.zeros(weight.shape, dtype=acc, device=h.device)
    tokens = torch.nonzero(g).reshape(-1)
    step = max(1, ce.CHUNK_ELEMENTS // weight.shape[0])
    for s in range(0, tokens.shape[0], step):
        t = tokens[s:s + step]
        rows = parent[t]
        hc = h[rows]
        logits = F.linear(hc, weight).float()
        gt = g[t]
        d = torch.exp(logits - lse[t, None]) * -gt[:, None]
        d.scatter_add_(1, ids[t, None], gt[:, None])
        dc = d.to(weight.dtype)
        dh.index_add_(0, rows, (dc @ weight).float())
        dw += (dc.t() @ hc).float()
    return dh.to(h.dtype), dw.to(weight.dtype)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_case(n: int, hidden: int, vocab: int, dev: str, dtype, reps: int) -> dict:
    g = torch.Generator(device=dev).manual_seed(n)
    h = torch.randn(n, hidden, device=dev, dtype=dtype, generator=g)
    w = (torch.randn(vocab, hidden, device=dev, dtype=dtype, generator=g) / hidden ** 0.5)
    ids = torch.randint(0, vocab, (n,), device=dev, generator=g)
    parent = torch.arange(n, device=dev) - 1
    upstream = torch.randn(n, device=dev, generator=g)
    lp, lse = torch.ops.treefx.linear_tree_logprobs(h, w, None, ids, parent)

    def new():
        return lp_ops._backward(upstream, h, w, None, ids, parent, lse, True, True, False)[:2]

    def old():
        return _token_chunked_backward(upstream, h, w, ids, parent, lse)

    out = {"tokens": n}
    ref = _token_chunked_backward(upstream, h.float(), w.float(), ids, parent, lse)
    for name, fn in (("vocab_slices", new), ("token_chunks", old)):
        dh, dw = fn()
        out[f"{name}_dh_err"], out[f"{name}_dw_err"] = _rel(dh, ref[0]), _rel(dw, ref[1])
        del dh, dw
        times = []
        for _ in range(reps + 1):
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            r = fn()
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del r
        out[f"{name}_ms"] = statistics.median(times[1:]) * 1e3
        if dev == "cuda":
            out[f"{name}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"{n:6d} tokens {name:13s} {out[f'{name}_ms']:8.1f} ms  d/dh err "
              f"{out[f'{name}_dh_err']:.2e}  d/dW err {out[f'{name}_dw_err']:.2e}", flush=True)
    return out


def run_paths(n: int, hidden: int, vocab: int, dev: str, dtype, reps: int) -> dict:
    """The output layer's paths at ``n`` tokens (see the module's docstring)."""
    from benchmarks.timing import repeat
    from treefx.ops.cross_entropy import fused_linear_tree_cross_entropy, tree_token_logprobs
    from treefx.ops.logprobs import fused_linear_tree_logprobs

    cuda = dev == "cuda"
    g = torch.Generator(device=dev).manual_seed(n)
    h = torch.randn(n, hidden, device=dev, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, device=dev, dtype=dtype, generator=g) / hidden ** 0.5
         ).requires_grad_()
    ids = torch.randint(0, vocab, (n,), device=dev, generator=g)
    parent = torch.arange(n, device=dev) - 1
    weights = torch.full((n,), 1.0 / n, device=dev)
    upstream = -weights  # d(-Σ w·lp)/d lp: every token trained

    def materialized(x, wt):
        return tree_token_logprobs(F.linear(x, wt), ids, parent)

    mat = torch.compile(materialized, dynamic=False) if cuda else materialized

    def fwd_bwd(fn):
        def call():
            h.grad = w.grad = None
            out = fn()
            (out if out.dim() == 0 else (out * upstream).sum()).backward()
        return call

    def no_grad(fn):
        def call():
            with torch.no_grad():
                fn()
        return call

    h_nograd = h.detach()

    def matmuls():  # the three products of a materialized step, nothing else
        with torch.no_grad():
            z = F.linear(h_nograd, w)
            z @ w
            z.t() @ h_nograd

    cases = {
        "materialized": fwd_bwd(lambda: mat(h, w)),
        "fused_logprobs": fwd_bwd(lambda: fused_linear_tree_logprobs(h, w, None, ids, parent)),
        "fused_loss": fwd_bwd(lambda: fused_linear_tree_cross_entropy(h, w, None, ids, parent,
                                                                      weights)),
        "materialized_no_grad": no_grad(lambda: mat(h, w)),
        "fused_logprobs_no_grad": no_grad(
            lambda: fused_linear_tree_logprobs(h, w, None, ids, parent)),
        "three_matmuls": matmuls,
    }
    out = {"tokens": n, "hidden": hidden, "vocab": vocab}
    grads = {}
    for name, fn in cases.items():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times = repeat(fn, reps, cuda, warmup=2)
        out[f"{name}_ms"] = statistics.median(times)
        if cuda:
            out[f"{name}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        if h.grad is not None and not name.endswith("no_grad"):
            grads[name] = (h.grad.clone(), w.grad.clone())
        print(f"{n:6d} tokens {name:24s} {out[f'{name}_ms']:8.1f} ms"
              + (f"  peak +{out[f'{name}_peak_gib']:.2f} GiB" if cuda else ""), flush=True)
        h.grad = w.grad = None
    ref = grads.get("materialized")
    for name, (dh, dw) in grads.items():
        if name != "materialized" and ref is not None:
            out[f"{name}_dh_vs_materialized"] = _rel(dh, ref[0])
            out[f"{name}_dw_vs_materialized"] = _rel(dw, ref[1])
    for name in ("fused_logprobs", "fused_loss"):
        out[f"{name}_x_materialized"] = out[f"{name}_ms"] / out["materialized_ms"]
    out["fused_logprobs_no_grad_x_materialized"] = (out["fused_logprobs_no_grad_ms"]
                                                    / out["materialized_no_grad_ms"])
    print(f"{n:6d} tokens: fused log-probs {out['fused_logprobs_x_materialized']:.3f}x, "
          f"fused loss {out['fused_loss_x_materialized']:.3f}x, no-grad log-probs "
          f"{out['fused_logprobs_no_grad_x_materialized']:.3f}x the materialized path",
          flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="883,8192,35530")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile", type=int, default=0,
                   help="also print the top kernels of the new backward at this many tokens")
    p.add_argument("--paths", default="",
                   help="comma-separated token counts: compare the output layer's paths there "
                        "(see the module's docstring) instead of the two backwards")
    common.add_run_args(p, "CPU, tiny shapes")
    args = p.parse_args(argv)
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    hidden, vocab = (4096, 151936) if cuda else (64, 1024)
    tokens = [int(x) for x in args.tokens.split(",")] if cuda else [50, 300]
    res = {"meta": common.run_meta(cuda), "args": vars(args), "hidden": hidden, "vocab": vocab}
    if args.paths:
        paths = [int(x) for x in args.paths.split(",")] if cuda else [300]
        res["paths"] = [run_paths(n, hidden, vocab, dev, torch.bfloat16 if cuda else
                                  torch.float32, args.reps) for n in paths]
    else:
        res["cases"] = [run_case(n, hidden, vocab, dev, torch.bfloat16, args.reps)
                        for n in tokens]
    if args.profile and cuda:
        res["profile"] = profile_backward(args.profile, hidden, vocab)
    common.save_json(res, common.resolve_out(args, "logprobs", cuda))


def profile_backward(n: int, hidden: int, vocab: int) -> list:
    from torch.profiler import ProfilerActivity, profile

    h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    ids = torch.randint(0, vocab, (n,), device="cuda")
    parent = torch.arange(n, device="cuda") - 1
    up = torch.randn(n, device="cuda")
    _, lse = torch.ops.treefx.linear_tree_logprobs(h, w, None, ids, parent)
    for _ in range(2):
        lp_ops._backward(up, h, w, None, ids, parent, lse, True, True, False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lp_ops._backward(up, h, w, None, ids, parent, lse, True, True, False)
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    top = [(e.key[:80], e.count, round(e.self_device_time_total / 1e3, 2))
           for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:15]]
    for row in top:
        print("profile", n, row, flush=True)
    return top


if __name__ == "__main__":
    main()
