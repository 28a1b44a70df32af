"""Gated DeltaNet over a tree on fla in one pass per stage (treefx.families.fla_tree) against
fla depth by depth and a float64 walk along the tree; then both paths timed (BENCHMARKS.md,
"Hybrids on fla's kernels"; benchmarks/README.md for the options).

    python -m benchmarks.fla_tree_check            # GPU, fla 0.4.2 installed
    python -m benchmarks.fla_tree_check --cases interpret-state   # CPU, Triton's interpreter

``exact``: odd trees with given root states and handed-out final states, float32 and bf16;
errors ``max |x - ref| / max |ref|`` of the output, states and every input's gradient; the
one-pass path passes within 2× the depth-by-depth path's + 1e-6 (float32) or + 1e-3 (bf16).
``timing``: the op's forward and backward at Qwen3-Next's heads, bf16, on the e2e tree and on
its sequences packed, per variant. ``state``: the one-launch state pass against its float64
reference, a 214-node tree 20 times bit for bit; ``interpret-state``: its kernels under
``TRITON_INTERPRET=1`` (tests/test_family_fla_tree_state.py runs it). ``--first-config``:
exactness with each fla kernel on its first configuration that compiles, no autotuning.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import treefx  # noqa: E402

from . import common  # noqa: E402
from .fla_check import odd_trees  # noqa: E402


def _walk_float64(q, k, v, g, beta, parent, root_state):
    """The tree's Gated DeltaNet in float64, token by token in DFS order: a token's state is
    its predecessor's after it, a root's ``root_state(t)`` (or zeros). q/k at the value heads
    and L2-normalised here; returns (output [T, H, V], state after each token)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    after, out = [], []
    for t in range(q.shape[0]):
        p = int(parent[t])
        s = after[p] if p >= 0 else root_state(t)
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t, :, None]
        s = s + torch.einsum("hk,hv->hkv", k[t], delta)
        after.append(s)
        out.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(out), after


def _recurrence(one_pass: bool, cpu: bool = False):
    """Qwen3-Next's registered recurrence; without its one-pass path (``one_pass=False``: fla
    depth by depth); ``cpu``: fla's path taken on CPU tensors too (under Triton's interpreter,
    :mod:`benchmarks.fla_tree_interpret`)."""
    from dataclasses import replace

    from treefx.compiler.recurrences import recurrence

    rec = recurrence("qwen3_next_gated_delta_rule")
    if not one_pass:
        rec = replace(rec, tree_varlen=None)
    if cpu:
        rec = replace(rec, varlen_devices=("cpu",), varlen_check=None)
    return rec


def exact_case(dev, dtype, trees, seed: int = 0, value_heads: int = 4) -> dict:
    from treefx.ops.recurrence import kernel_runs
    from treefx.ops.recurrence.reference import run_tree, tree_nodes

    batch = treefx.pack(trees).to(dev)
    parent = batch.parent_token[0] if batch.parent_token.dim() > 1 else batch.parent_token
    n, hv, d = batch.num_tokens, value_heads, 128
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    starts, lengths, parents, depth = tree_nodes(parent)
    roots = [i for i, dp in enumerate(depth) if dp == 0]
    leaves = [i for i in range(len(starts)) if i not in set(parents)]
    keep = sorted({roots[0], leaves[0], leaves[-1], len(starts) // 2})
    base = [rand(1, n, hv, d), rand(1, n, hv, d), rand(1, n, hv, d),
            -torch.rand(1, n, hv, device=dev, generator=gen) * 0.5 - 0.01,
            torch.rand(1, n, hv, device=dev, generator=gen),
            rand(len(roots), hv, d, d) * 0.1]
    probe, probe_fin = rand(n, hv, d).double(), rand(len(keep), hv, d, d).double()
    row_of = {starts[r]: j for j, r in enumerate(roots)}

    def leaf(x, dt):
        return x.detach().to(dt).requires_grad_()

    x64 = [leaf(x, torch.float64) for x in base]
    out, after = _walk_float64(*(x[0] for x in x64[:5]), parent.tolist(),
                               lambda t: x64[5][row_of[t]])
    fin = torch.stack([after[starts[i] + lengths[i] - 1] for i in keep])
    total = (out * probe).sum() + (fin * probe_fin).sum()
    ref = [out.detach(), fin.detach(), *torch.autograd.grad(total, x64)]
    names = ("out", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    res = {"tokens": n, "nodes": len(starts), "depths": max(depth) + 1, "dtype": str(dtype)}
    from treefx.families.fla_tree import KEEP_ENV

    for label, one_pass in (("depth_by_depth", False), ("one_pass", True),
                            ("one_pass_keep_states", True)):
        os.environ[KEEP_ENV] = "1" if label.endswith("keep_states") else "0"
        xs = [leaf(base[0], dtype), leaf(base[1], dtype), leaf(base[2], dtype),
              leaf(base[3], torch.float32), leaf(base[4], dtype), leaf(base[5], torch.float32)]
        before = kernel_runs()
        row, final, _ = run_tree(
            _recurrence(one_pass, cpu=dev == "cpu"), parent, tuple(xs[:3]),
            dict(g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True),
            root_state=lambda t: xs[5][row_of[t]] if t in row_of else None,
            nodes=(starts, lengths, parents, depth), keep=keep)
        o = row[0] if isinstance(row, tuple) else row
        f = torch.stack([final[i] for i in keep])
        total = (o[0].double() * probe).sum() + (f.double() * probe_fin).sum()
        got = [o[0], f, *torch.autograd.grad(total, xs)]
        res[label] = {nm: common.max_rel(a, r) for nm, a, r in zip(names, got, ref)}
        after_runs = kernel_runs()
        res[label]["paths"] = sorted(p for (nm, p), c in after_runs.items()
                                     if c != before.get((nm, p), 0))
    os.environ.pop(KEEP_ENV, None)
    slack = 1e-6 if dtype == torch.float32 else 1e-3
    res["passed"] = all(res["one_pass"][nm] <= 2 * res["depth_by_depth"][nm] + slack
                        for nm in names) and res["one_pass"]["paths"] == (
        ["tree"] if res["depths"] > 1 else ["varlen"])  # roots alone: fla's own call
    # the kept chunk states are the recomputed ones: every error the same
    res["keep_states_equal"] = res["one_pass_keep_states"] == res["one_pass"]
    res["passed"] = res["passed"] and res["keep_states_equal"]
    return res


def state_pass_exact(dev, seed: int, heads: int, key_dim: int, value_dim: int,
                     row: np.ndarray | None = None, repeats: int = 1) -> dict:
    """treefx's one-launch state pass (``fla_tree_state``), forward and backward, float32,
    against its float64 reference on the forest ``row`` (a random one by default), roots from
    given states, three nodes' final states handed out: relative errors, passed within 1e-5.
    With ``repeats`` > 1 the kernels run that many times more and every output must be the
    same bit for bit (the launch sums in a fixed order: a race would show here)."""
    from treefx.families import fla_tree_state as st
    from treefx.ops.recurrence.reference import _tree_nodes

    from treefx.tools.synth import random_parent_row

    row = random_parent_row(seed) if row is None else row
    starts, lengths, parents, _ = _tree_nodes(row)
    n, t = len(starts), len(row)
    keep = sorted({0, n - 1, n // 2})
    host, sizes = st.tables(np.asarray(parents), np.asarray(lengths), keep)
    tabs = st.TreeTables()
    for name, a in host.items():
        setattr(tabs, name, torch.from_numpy(np.ascontiguousarray(a)).to(dev))
    for name, v in sizes.items():
        setattr(tabs, name, v)
    cu_np = np.concatenate([[0], np.cumsum(lengths)])
    cu = torch.from_numpy(cu_np).to(dev)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, sc=1.0):
        return (torch.randn(*shape, generator=gen) * sc).to(dev)

    g = -torch.rand(1, t, heads, generator=gen) * 0.2
    for a, b in zip(cu_np[:-1], cu_np[1:]):
        for c0 in range(a, b, 64):
            g[0, c0:min(c0 + 64, b)] = g[0, c0:min(c0 + 64, b)].cumsum(0)
    g = g.to(dev)
    k, w, q = (rnd(1, t, heads, key_dim, sc=0.2) for _ in range(3))
    u, do, dv = (rnd(1, t, heads, value_dim) for _ in range(3))
    h0 = rnd(len(host["roots"]), heads, key_dim, value_dim, sc=0.1)
    dfinal = rnd(len(keep), heads, key_dim, value_dim)

    def run():
        return (*st.tree_fwd_h(tabs, k, w, u, g, h0, cu),
                *st.tree_bwd_dhu(tabs, q, k, w, g, do, dv, dfinal, 0.3, True, cu))

    got = run()
    ref = (*st.reference_fwd_h(host, sizes, cu_np, k, w, u, g, h0),
           *st.reference_bwd_dhu(host, sizes, cu_np, q, k, w, g, do, dv, dfinal, 0.3, True))
    names = ("h", "v_new", "final", "dh", "dh0", "dv2")
    errs = {}
    for name, a, b in zip(names, got, ref):
        if name == "final":  # slots past the filled ones are never read
            a, b = a[:sizes["slots"]], b[:sizes["slots"]]
        errs[name] = float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))
    same = True
    for _ in range(max(0, repeats - 1)):
        again = run()
        same = same and all(torch.equal(a[:sizes["slots"]] if nm == "final" else a,
                                        b[:sizes["slots"]] if nm == "final" else b)
                            for nm, a, b in zip(names, again, got))
    return {"heads": heads, "key": key_dim, "value": value_dim, "tokens": t, "nodes": n,
            "errors": errs, "repeats": repeats, "bitwise_same_on_repeats": same,
            "passed": max(errs.values()) <= 1e-5 and same}


def many_nodes(vocab: int, calls: int = 120, seed: int = 0) -> list[treefx.Tree]:
    """A tree of a few hundred nodes (each call branching off a random earlier call at a
    random point, some calls prefixes of others) beside two more roots: many programs of the
    one-launch state pass waiting on each other at once."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(3, vocab, 300).tolist()]
    for _ in range(calls):
        base = seqs[rng.integers(len(seqs))]
        cut = int(rng.integers(1, len(base) + 1))
        seqs.append(base[:cut] + rng.integers(3, vocab, int(rng.integers(0, 90))).tolist())
    return [treefx.Tree.from_sequences(seqs),
            treefx.Tree.from_sequences([rng.integers(3, vocab, 70).tolist()]),
            treefx.Tree.from_sequences([rng.integers(3, vocab, 130).tolist(),
                                        rng.integers(3, vocab, 5).tolist()])]


def _state_variants(configs: str) -> list[tuple[str, bool, dict]]:
    """(label, one pass, environment) of the timed variants: fla depth by depth, the one-pass
    path with its state pass per depth, in one launch (default settings and each of
    ``configs``, "BV,warps,stages;..."), and with the chunk states kept."""
    from treefx.families.fla_tree import KEEP_ENV
    from treefx.families.fla_tree_state import ENV as STATE_ENV

    out = [("depth_by_depth", False, {}), ("one_pass_state_per_depth", True, {STATE_ENV: "0"}),
           ("one_pass", True, {}), ("one_pass_keep_states", True, {KEEP_ENV: "1"})]
    out += [(f"one_pass_config_{c.replace(',', '_')}", True, {STATE_ENV + "_CONFIG": c})
            for c in configs.split(";") if c.strip()]
    return out


def _kernel_times(step) -> dict:
    """One ``step`` under torch.profiler: GPU ms by kernel name (largest first), the GPU's
    busy ms and the wall ms."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    by: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name[:90]] = by.get(e.name[:90], 0.0) + e.time_range.elapsed_us() / 1e3
    top = dict(sorted(by.items(), key=lambda kv: -kv[1])[:24])
    return {"wall_ms": wall, "gpu_busy_ms": sum(by.values()), "kernels_ms": top}


def timing(dev, reps: int, configs: str = "", profile_labels: tuple = ()) -> dict:
    from treefx.ops.recurrence.reference import run_tree, tree_nodes

    res = {}
    tree = common.make_tree(0.75, 1.0, 32000)
    cases = {"tree": treefx.pack(tree).to(dev),
             "packed": treefx.pack([treefx.Tree.from_sequences([s])
                                    for s in tree.sequences]).to(dev)}
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, batch in cases.items():
        parent = batch.parent_token[0] if batch.parent_token.dim() > 1 else batch.parent_token
        n = batch.num_tokens
        nodes = tree_nodes(parent)
        xs = [torch.randn(1, n, 16, 128, device=dev, generator=gen, dtype=torch.bfloat16),
              torch.randn(1, n, 16, 128, device=dev, generator=gen, dtype=torch.bfloat16),
              torch.randn(1, n, 32, 128, device=dev, generator=gen, dtype=torch.bfloat16),
              -torch.rand(1, n, 32, device=dev, generator=gen) * 0.5,
              torch.rand(1, n, 32, device=dev, generator=gen, dtype=torch.bfloat16)]
        grad = torch.randn(1, n, 32, 128, device=dev, generator=gen, dtype=torch.bfloat16)
        variants = _state_variants(configs)
        for label, one_pass, env in variants if name == "tree" else variants[:1] + variants[2:3]:
            for _, _, e in variants:
                for key in e:
                    os.environ.pop(key, None)
            os.environ.update(env)
            rec = _recurrence(one_pass)
            leaves = [x.detach().requires_grad_() for x in xs]

            def step():
                q, k = leaves[0].repeat_interleave(2, -2), leaves[1].repeat_interleave(2, -2)
                row, _, _ = run_tree(rec, parent, (q, k, leaves[2]),
                                     dict(g=leaves[3], beta=leaves[4],
                                          use_qk_l2norm_in_kernel=True), nodes=nodes)
                o = row[0] if isinstance(row, tuple) else row
                torch.autograd.backward(o, grad)

            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            print(f"  {name:6s} {label:15s} first step {time.perf_counter() - t0:.1f} s",
                  flush=True)
            for _ in range(2):
                step()
            times = []
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            res[f"{name}/{label}"] = {"ms": statistics.median(times), "tokens": n,
                                      "nodes": len(nodes[0]),
                                      "depths": max(nodes[3]) + 1}
            print(f"  {name:6s} {label:15s} {res[f'{name}/{label}']['ms']:7.2f} ms "
                  f"({n} tokens, {len(nodes[0])} nodes, {max(nodes[3]) + 1} depths)", flush=True)
            if f"{name}/{label}" in profile_labels:
                prof = res[f"{name}/{label}"]["profile"] = _kernel_times(step)
                print(f"    profiled: wall {prof['wall_ms']:.2f} ms, GPU busy "
                      f"{prof['gpu_busy_ms']:.2f} ms; "
                      + "; ".join(f"{k[:48]} {v:.2f}" for k, v in
                                  list(prof["kernels_ms"].items())[:12]), flush=True)
    for _, _, e in _state_variants(configs):
        for key in e:
            os.environ.pop(key, None)
    return res


def first_working_config() -> None:
    """Every Triton autotuner (fla's kernels) takes the first configuration that compiles and
    runs instead of timing all of them; nothing is kept in Triton's autotuning cache, so a
    later tuned run is not handed these choices."""
    import math

    from triton.runtime import autotuner

    run, bench = autotuner.Autotuner.run, autotuner.Autotuner._bench

    def first_run(self, *args, **kwargs):
        self.cache_results = False
        self._treefx_found = False
        return run(self, *args, **kwargs)

    def first_bench(self, *args, config, **meta):
        if self._treefx_found:
            return [math.inf] * 3
        out = bench(self, *args, config=config, **meta)
        self._treefx_found = math.isfinite(out[0] if isinstance(out, (list, tuple)) else out)
        return out

    autotuner.Autotuner.run, autotuner.Autotuner._bench = first_run, first_bench


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.fla_tree_check",
                                description=__doc__.split("\n\n")[0])
    common.add_run_args(p, "not available: fla's kernels need a GPU")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cases", default="exact,timing")
    p.add_argument("--value-heads", type=int, default=4,
                   help="heads of the exactness cases (32: Qwen3-Next's, whose kernels the "
                        "timing and the e2e run autotune too)")
    p.add_argument("--first-config", action="store_true",
                   help="each fla kernel runs its first configuration that compiles (exactness "
                        "without fla's minutes of autotuning; not for timing)")
    p.add_argument("--state-configs", default="",
                   help="the one-launch state pass timed also with these settings: "
                        "'BV,warps,stages;...' (TREEFX_FLA_TREE_STATE_CONFIG)")
    p.add_argument("--profile-op", default="",
                   help="timed variants (e.g. 'tree/one_pass,packed/one_pass') profiled once "
                        "after timing: GPU time by kernel")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="exactness dtypes (fla autotunes each dtype's kernels anew, minutes each)")
    args = p.parse_args(argv)
    if args.first_config:
        if "timing" in args.cases:
            raise SystemExit("--first-config is for exactness: its kernels are not tuned")
        first_working_config()
    if args.cases == "interpret-state":
        import json

        runs = [state_pass_exact("cpu", seed, *shape)
                for seed, shape in enumerate([(2, 128, 32), (3, 64, 64), (1, 128, 48)])]
        for r in runs:
            print(json.dumps({"case": "state-pass", **r}), flush=True)
        return 0 if all(r["passed"] for r in runs) else 1
    cuda = common.use_cuda(args.dry_run)
    if not cuda:
        raise SystemExit("fla_tree_check needs a GPU with fla installed")
    torch.backends.cuda.matmul.allow_tf32 = False
    common.resolve_out(args, "fla_tree_check", cuda)
    from treefx.families import fla, fla_l2norm, fla_tree

    res = {**common.run_meta(cuda), "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"),
           "fla_environment": fla.environment(torch.device("cuda")).describe(),
           "one_pass_available": fla_tree.kernels() is not None,
           "first_config": args.first_config,
           "l2norm_fixed_key": fla_l2norm.available(), "cases": {}}
    print(res["fla_environment"], "one pass:", res["one_pass_available"], flush=True)
    t0 = time.perf_counter()
    failed = []
    if "exact" in args.cases:
        trees = odd_trees(1024)
        rng = np.random.default_rng(0)
        deep = [treefx.Tree.from_sequences([[int(t) for t in rng.integers(3, 1000, n)]
                                            for n in (40, 90, 200)])]
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",") if d]:
            for name, forest in {**trees, "separate-sequences": deep,
                                 "many-nodes": many_nodes(1000)}.items():
                key = f"{str(dtype)[6:]}-{name}"
                try:
                    out = exact_case("cuda", dtype, forest, value_heads=args.value_heads)
                except Exception:
                    out = {"error": traceback.format_exc()[-3000:], "passed": False}
                res["cases"][key] = out
                if not out.get("passed"):
                    failed.append(key)
                brief = {k: (max(v for kk, v in out[k].items() if kk != "paths")
                             if isinstance(out.get(k), dict) else out.get(k))
                         for k in ("depth_by_depth", "one_pass", "passed")}
                print(f"[{time.perf_counter() - t0:6.1f}s] {key}: {brief}"
                      + (f" {out['error'].strip().splitlines()[-1][:200]}" if "error" in out
                         else ""), flush=True)
                common.save_json(res, args.out)
    if "state" in args.cases.split(","):
        # the one-launch state pass alone, float32 against its float64 reference: random
        # forests, then the many-node tree at Qwen3-Next's heads, run 20 times (bit for bit)
        batch = treefx.pack(many_nodes(1000))
        big = (batch.parent_token[0] if batch.parent_token.dim() > 1
               else batch.parent_token).numpy()
        for key, kw in [("state-random-0", dict(seed=0, heads=2, key_dim=128, value_dim=32)),
                        ("state-random-1", dict(seed=1, heads=3, key_dim=64, value_dim=64)),
                        ("state-many-nodes", dict(seed=2, heads=32, key_dim=128, value_dim=128,
                                                  row=big, repeats=20))]:
            try:
                out = state_pass_exact("cuda", **kw)
            except Exception:
                out = {"error": traceback.format_exc()[-3000:], "passed": False}
            res["cases"][key] = out
            if not out.get("passed"):
                failed.append(key)
            print(f"[{time.perf_counter() - t0:6.1f}s] {key}: "
                  f"{ {k: out.get(k) for k in ('nodes', 'errors', 'bitwise_same_on_repeats', 'passed')} }"
                  + (f" {out['error'].strip().splitlines()[-1][:200]}" if "error" in out else ""),
                  flush=True)
            common.save_json(res, args.out)
    if "timing" in args.cases:
        res["timing"] = timing("cuda", args.reps, args.state_configs,
                               tuple(x for x in args.profile_op.split(",") if x))
    res["failed"] = failed
    res["total_s"] = time.perf_counter() - t0
    common.save_json(res, args.out)
    print(f"total {res['total_s']:.0f} s; {'all passed' if not failed else f'FAILED: {failed}'};"
          f" JSON: {args.out}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
