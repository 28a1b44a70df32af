"""The output layer's log-probabilities at an 8B model's shape (BENCHMARKS.md, "Log-probs
without logits"; benchmarks/README.md for the modes and what was retired)."""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmarks import common


def run_paths(n: int, hidden: int, vocab: int, dev: str, dtype, reps: int) -> dict:
    """The output layer's paths at ``n`` tokens: the logits materialized, the fused log-probs
    and the fused loss, forward + backward and no-grad, beside the matrix products alone."""
    from treefx.ops.cross_entropy import fused_linear_tree_cross_entropy, tree_token_logprobs
    from treefx.ops.logprobs import fused_linear_tree_logprobs, tree_logprobs_from_logits

    cuda = dev == "cuda"
    g = torch.Generator(device=dev).manual_seed(n)
    h = torch.randn(n, hidden, device=dev, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, device=dev, dtype=dtype, generator=g) / hidden ** 0.5
         ).requires_grad_()
    ids = torch.randint(0, vocab, (n,), device=dev, generator=g)
    parent = torch.arange(n, device=dev) - 1
    weights = torch.full((n,), 1.0 / n, device=dev)
    upstream = -weights  # d(-Σ w·lp)/d lp: every token trained

    def materialized_plain(x, wt):
        return tree_token_logprobs(F.linear(x, wt), ids, parent)

    mat_inductor = torch.compile(materialized_plain, dynamic=False) if cuda \
        else materialized_plain

    def mat(x, wt):
        return tree_logprobs_from_logits(F.linear(x, wt), ids, parent)

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
        "materialized_inductor": fwd_bwd(lambda: mat_inductor(h, w)),
        "fused_logprobs": fwd_bwd(lambda: fused_linear_tree_logprobs(h, w, None, ids, parent)),
        "fused_loss": fwd_bwd(lambda: fused_linear_tree_cross_entropy(h, w, None, ids, parent,
                                                                      weights)),
        "materialized_no_grad": no_grad(lambda: mat(h, w)),
        "materialized_inductor_no_grad": no_grad(lambda: mat_inductor(h, w)),
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
        times = common.repeat(fn, reps, cuda, warmup=2)
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
            out[f"{name}_dh_vs_materialized"] = common.norm_rel(dh, ref[0])
            out[f"{name}_dw_vs_materialized"] = common.norm_rel(dw, ref[1])
    for name in ("materialized_inductor", "fused_logprobs", "fused_loss"):
        out[f"{name}_x_materialized"] = out[f"{name}_ms"] / out["materialized_ms"]
    out["fused_logprobs_no_grad_x_materialized"] = (out["fused_logprobs_no_grad_ms"]
                                                    / out["materialized_no_grad_ms"])
    print(f"{n:6d} tokens: Inductor's materialized path "
          f"{out['materialized_inductor_x_materialized']:.3f}x, "
          f"fused log-probs {out['fused_logprobs_x_materialized']:.3f}x, "
          f"fused loss {out['fused_loss_x_materialized']:.3f}x, no-grad log-probs "
          f"{out['fused_logprobs_no_grad_x_materialized']:.3f}x the materialized path",
          flush=True)
    return out


def forest_row(n: int, seed: int) -> torch.Tensor:
    """[n] predecessor rows of a random forest in DFS order (``random_parent_row``), cut."""
    from treefx.tools.synth import random_parent_row

    roots = max(2, n // 500)
    while True:
        row = random_parent_row(seed, roots=roots, children=5)
        if len(row) >= n:
            return torch.as_tensor(row[:n], dtype=torch.long)
        roots *= 2


def check_from_logits(dev: str, n: int = 517, vocab: int = 10007) -> list[dict]:
    """``tree_logprobs_from_logits`` (the Triton kernels, or Triton's interpreter) against the
    plain form in float64: log-probabilities and the logits' gradient on random forests with
    duplicated labels on a branching row, a row of -inf but one entry and an odd vocabulary,
    bf16 and float32 logits; absolute errors, bounded by the inputs' rounding."""
    from treefx.ops.cross_entropy import tree_token_logprobs
    from treefx.ops.logprobs import from_logits

    if from_logits.triton is None:
        raise SystemExit("--check-from-logits needs Triton (on the CPU with TRITON_INTERPRET=1)")
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(n)
        parent = forest_row(n, n)
        ids = torch.randint(0, vocab, (n,), generator=gen)
        readers = torch.bincount(parent[parent >= 0], minlength=n)
        branch = int(torch.nonzero(readers >= 2)[0, 0])
        ids[parent == branch] = ids[parent == branch][0]  # one label for a row's children
        logits = (torch.randn(1, n, vocab, generator=gen) * 4).to(dtype)
        logits[0, 7] = float("-inf")
        logits[0, 7, 3] = 1.0
        ids[parent == 7] = 3  # (another label there would have log-probability -inf)
        up = torch.randn(n, generator=gen)
        x = logits.to(dev)
        if from_logits.available(x):
            lp_dev = x.detach().requires_grad_()
            lp = from_logits.tree_logprobs_from_logits(lp_dev, ids.to(dev), parent.to(dev))
            (lp * up.to(dev)).sum().backward()
            lp, grad = lp.detach().cpu().double(), lp_dev.grad.cpu().double()
        else:  # the kernels themselves (Triton's interpreter on the CPU)
            lse = from_logits.lse_rows(x)
            row = parent.clamp(min=0)
            lp = torch.where(parent >= 0, x[0, row, ids].double() - lse[row].double(),
                             torch.zeros(n, dtype=torch.float64))
            grad = from_logits.rows_gradient(x, lse, ids, parent, up).double()
        ref_in = logits.double().requires_grad_()
        ref = tree_token_logprobs(ref_in, ids, parent)
        (ref * up.double()).sum().backward()
        ref_grad = ref_in.grad.to(dtype).double()  # rounded as the kernel's result is
        r = {"case": f"from_logits {str(dtype).split('.')[-1]}", "tokens": n, "vocab": vocab,
             "logprob_err": float((lp - ref.detach()).abs().max()),
             "grad_err": float((grad - ref_grad).abs().max()),
             "grad_max": float(ref_grad.abs().max())}
        # float32 logits: float32 sums; bf16 logits: the gradient's one bf16 rounding (a unit
        # in the last place of its largest entries, 2^-8 relative)
        tol_g = 1e-5 if dtype == torch.float32 else r["grad_max"] / 128
        out.append(_report(r, 1e-4, tol_g))
    out.append(_check_own_rows(dev, n, vocab))
    if dev == "cuda":
        out.append(_check_fused(n, vocab))
    return out


def _report(r: dict, tol_lp: float, tol_g: float) -> dict:
    r["ok"] = r.get("logprob_err", 0.0) <= tol_lp and r["grad_err"] <= tol_g
    lp = f"log-prob err {r['logprob_err']:.2e}, " if "logprob_err" in r else ""
    top = f" (max {r['grad_max']:.2e})" if "grad_max" in r else " (relative)"
    print(f"{r['case']}: {lp}grad err {r['grad_err']:.2e}{top} "
          f"{'ok' if r['ok'] else 'FAILED'}", flush=True)
    return r


def _check_own_rows(dev: str, n: int, vocab: int) -> dict:
    """``own_rows_gradient`` (the fused log-probabilities' slice gradient on the GPU) against
    the float64 one-hot minus softmax: labels inside and outside the slice, float32."""
    from treefx.ops.logprobs import from_logits

    gen = torch.Generator().manual_seed(n + 1)
    logits = torch.randn(n, vocab, generator=gen) * 4
    labels = torch.randint(-vocab // 4, vocab + vocab // 4, (n,), generator=gen)
    up = torch.randn(n, generator=gen)
    lse = torch.logsumexp(logits.double(), -1)
    got = from_logits.own_rows_gradient(logits.to(dev), lse.float().to(dev), labels.to(dev),
                                        up.to(dev)).cpu().double()
    inside = (labels >= 0) & (labels < vocab)
    onehot = torch.zeros(n, vocab, dtype=torch.float64)
    onehot[inside, labels[inside]] = 1
    ref = up.double()[:, None] * (onehot - torch.exp(logits.double() - lse[:, None]))
    return _report({"case": "own rows float32", "grad_err": float((got - ref).abs().max()),
                    "grad_max": float(ref.abs().max())}, 0.0, 1e-5)


def _check_fused(n: int, vocab: int) -> dict:
    """The fused log-probabilities on the GPU (``fused_linear_tree_logprobs``: Triton's
    log-sum-exp per chunk and slice gradients) against the plain form in float64 on the same
    float32 inputs (a random forest's rows, some tokens untrained)."""
    from treefx.ops.logprobs import fused_linear_tree_logprobs, linear_tree_logprobs_reference

    gen = torch.Generator().manual_seed(n + 2)
    h = torch.randn(n, 64, generator=gen)
    w = torch.randn(vocab, 64, generator=gen) / 8
    ids = torch.randint(0, vocab, (n,), generator=gen)
    parent = forest_row(n, n + 2)
    up = torch.randn(n, generator=gen)
    up[::5] = 0
    got = []
    for dev, dt in (("cuda", torch.float32), ("cpu", torch.float64)):
        hh, ww = (x.to(dev, dt).requires_grad_() for x in (h, w))
        fn = fused_linear_tree_logprobs if dev == "cuda" else linear_tree_logprobs_reference
        lp = fn(hh, ww, None, ids.to(dev), parent.to(dev))
        gh, gw = torch.autograd.grad((lp * up.to(dev, lp.dtype)).sum(), (hh, ww))
        got.append((lp.detach().cpu().double(), gh.cpu().double(), gw.cpu().double()))
    (lp, gh, gw), (rlp, rgh, rgw) = got
    rel = max(float((gh - rgh).norm() / rgh.norm()), float((gw - rgw).norm() / rgw.norm()))
    return _report({"case": "fused log-probs float32", "logprob_err":
                    float((lp - rlp).abs().max()), "grad_err": rel}, 1e-4, 1e-5)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--paths", default="17187,35530",
                   help="comma-separated token counts: compare the output layer's paths there")
    p.add_argument("--check-from-logits", action="store_true",
                   help="only check tree_logprobs_from_logits against the float64 plain form "
                        "(exit status 1 on a difference); on the CPU under "
                        "TRITON_INTERPRET=1 the Triton kernels run in Triton's interpreter")
    common.add_run_args(p, "CPU, tiny shapes")
    args = p.parse_args(argv)
    if args.check_from_logits:
        cuda = torch.cuda.is_available()
        rows = check_from_logits("cuda" if cuda else "cpu")
        print(f"{sum(r['ok'] for r in rows)} of {len(rows)} cases ok", flush=True)
        raise SystemExit(0 if all(r["ok"] for r in rows) else 1)
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    hidden, vocab = (4096, 151936) if cuda else (64, 1024)
    res = {"meta": common.run_meta(cuda), "args": vars(args), "hidden": hidden, "vocab": vocab}
    paths = [int(x) for x in args.paths.split(",")] if cuda else [300]
    res["paths"] = [run_paths(n, hidden, vocab, dev, torch.bfloat16 if cuda else
                              torch.float32, args.reps) for n in paths]
    common.save_json(res, common.resolve_out(args, "logprobs", cuda))


if __name__ == "__main__":
    main()
