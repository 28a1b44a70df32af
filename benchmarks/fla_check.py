"""Gated DeltaNet on fla's kernels through the tree, against each sequence alone and a float64
recurrence, values and gradients (BENCHMARKS.md, "Hybrids on fla's kernels"; benchmarks/README.md
for the cases and options)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import os
import time
import traceback

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import treefx  # noqa: E402

from . import common  # noqa: E402

SCALE_FLOOR = 1e-3


# ----------------------------------------------------------------------------- trees

def odd_trees(vocab: int) -> dict[str, list[treefx.Tree]]:
    """Single-token nodes and a prefix sequence; nodes across 64-token chunks; a forest."""
    short = treefx.Tree.from_sequences([[1, 2], [1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 6, 7, 8, 9],
                                        [1, 2, 4, 6, 7, 8, 10], [11]])
    g = torch.Generator().manual_seed(0)

    def seq(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    p = seq(100)
    long = treefx.Tree.from_sequences([p + seq(70), p + seq(1), p[:50] + seq(130), p,
                                       p + seq(70)[:3]])
    return {"short": [short], "long-nodes": [long],
            "forest": [short, long, treefx.Tree.from_sequences([seq(5)]),
                       *common.odd_forest(3, vocab)]}


# ----------------------------------------------------------------------------- op level

def _float64_inputs(q, k, v, g, beta):
    """The inputs in float64, query and key L2-normalised as Hugging Face and fla do."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k, v, g, beta


def _leaf(x, dtype):
    return x.detach().to(dtype).requires_grad_()


def gdn_float64(q, k, v, g, beta):
    """Gated DeltaNet token by token in float64 ([B, T, H, *]: B sequences from a zero state,
    q/k at the value heads): the reference."""
    q, k, v, g, beta = _float64_inputs(q, k, v, g, beta)
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)) * beta[:, t, :, None]
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(out, 1)


def _expand(q, k, hv):
    r = hv // k.shape[-2]
    return q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)


def _torch_kernel(q, k, v, g, beta):
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    q, k = _expand(q, k, v.shape[-2])
    return inspect.unwrap(m.torch_chunk_gated_delta_rule)(
        q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]


def _fla_kernel(q, k, v, g, beta):
    from treefx.families.fla import gated_delta_rule

    cu = torch.tensor([0, q.shape[1]], device=q.device)
    return gated_delta_rule({"query": q, "key": k, "value": v, "g": g, "beta": beta},
                            {"use_qk_l2norm_in_kernel": True}, None, cu)[0]


def op_case(dev, dtype, layout, trees) -> dict:
    from treefx.compiler.recurrences import recurrence
    from treefx.families import fla
    from treefx.ops.recurrence import kernel_runs, tree_recurrence

    rec = recurrence("qwen3_next_gated_delta_rule")
    batch = treefx.pack(trees).to(dev)
    n, hk, hv, d = batch.num_tokens, (2 if layout == "qwen3_5" else 4), 4, 128
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    q, k = rand(1, n, hk, d), rand(1, n, hk, d)
    v = rand(1, n, hv, d)
    decay = -torch.rand(1, n, hv, device=dev, generator=gen) * 0.5 - 0.01
    beta = torch.rand(1, n, hv, device=dev, generator=gen)
    if layout == "qwen3_next":  # transformers 5.17: the layer expands before the kernel
        q, k = _expand(q, k, hv)
    base = [q, k, v, decay, beta]
    probe = rand(1, n, hv, d)
    mult = torch.zeros(n, device=dev, dtype=torch.float64)
    idxs = [batch.sequence_index(i).to(dev) for i in range(batch.num_sequences)]
    for idx in idxs:
        mult[idx] += 1

    def gathered(outs):
        """The sequences' outputs scattered to the row, and Σ over sequences of <probe,
        output> / multiplicity: the per-sequence objective whose gradient the tree's equals."""
        out = torch.zeros(1, n, hv, d, dtype=torch.float64, device=dev)
        total = 0
        for idx, o in zip(idxs, outs):
            out[:, idx] = o.double().detach()
            total = total + (o.double() * probe[:, idx].double()
                             / mult[idx, None, None]).sum()
        return out, total

    def per_sequence(fn, xs):
        return gathered([fn(*(x[:, idx] for x in xs)) for idx in idxs])

    def grads_of(total, xs):
        return [g.double() for g in torch.autograd.grad(total, xs)]

    def reference(xs):
        """per_sequence's result for the float64 recurrence, every sequence in one right-padded
        batch (as many steps as the longest sequence)."""
        length = max(len(idx) for idx in idxs)

        def padded(x):
            return torch.stack([torch.cat([x[0, idx], x.new_zeros(length - len(idx),
                                                                  *x.shape[2:])])
                                for idx in idxs])

        q_, k_, *rest = (padded(x) for x in xs)
        o = gdn_float64(*_expand(q_, k_, hv), *rest)
        return gathered([o[j:j + 1, :len(idx)] for j, idx in enumerate(idxs)])

    x64 = [_leaf(x, torch.float64) for x in base]
    ref_out, ref_total = reference(x64)
    ref_grads = grads_of(ref_total, x64)

    def errors(out, grads):
        names = ("out", "dq", "dk", "dv", "dg", "dbeta")
        return dict(zip(names, [common.max_rel(out, ref_out)] + [common.max_rel(g, r)
                                                       for g, r in zip(grads, ref_grads)]))

    res = {"tokens": n, "sequences": batch.num_sequences, "key_heads": hk, "value_heads": hv,
           "head_dim": d, "dtype": str(dtype)}
    env = fla.environment(torch.device(dev))
    decision = fla.decide("gated_delta_rule", env, dtype, d)
    res["fla"] = {"use": decision.use, "reason": decision.reason, "env": env.describe()}
    xt = [_leaf(x, torch.float32) for x in base]
    floor_out, floor_total = per_sequence(_torch_kernel, xt)
    res["torch_kernel_per_sequence_fp32"] = errors(floor_out, grads_of(floor_total, xt))

    def inputs():  # as the model gives them: the decay in float32, the rest in ``dtype``
        return [_leaf(base[0], dtype), _leaf(base[1], dtype), _leaf(base[2], dtype),
                _leaf(base[3], torch.float32), _leaf(base[4], dtype)]

    if decision.use:
        xf = inputs()
        fo, ft = per_sequence(_fla_kernel, xf)
        res["fla_per_sequence"] = errors(fo, grads_of(ft, xf))
    xs = inputs()
    before = kernel_runs()
    out, _ = tree_recurrence(rec, batch.parent_token, tuple(xs[:3]),
                             dict(g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True))
    tree_total = (out.double() * probe.double()).sum()
    res["tree"] = errors(out, grads_of(tree_total, xs))
    res["kernel_runs"] = common.kernel_runs_delta(before, kernel_runs())
    worst = max(res["tree"].values())
    kernel_err = max(res.get("fla_per_sequence", res["torch_kernel_per_sequence_fp32"]).values())
    if dtype == torch.float32:
        floor = max(res["torch_kernel_per_sequence_fp32"].values())
        res["tolerance"] = max(2 * kernel_err, 10 * floor) + 1e-6
    else:
        res["tolerance"] = 2 * kernel_err + 1e-3
    res["worst"] = worst
    res["passed"] = worst <= res["tolerance"]
    return res


# ----------------------------------------------------------------------------- model level

@contextlib.contextmanager
def model_kernel_oracle():
    """The per-sequence run as the model calls its kernel (Hugging Face's fla call when fla is
    installed): the oracle's switch to the torch kernel left out while it runs."""
    from treefx import reference
    from treefx.families.hf_kernels import torch_kernel_paths

    switches = reference._ORACLE_ATTENTION
    at = switches.index(torch_kernel_paths)
    switches.remove(torch_kernel_paths)
    try:
        yield
    finally:
        switches.insert(at, torch_kernel_paths)


def _grads(model) -> dict:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters() if p.requires_grad}


def _param_err(got: dict, ref: dict) -> tuple[float, str]:
    scale = SCALE_FLOOR * max(float(r.abs().max()) for r in ref.values())
    worst = max(((common.max_rel(got[n].float(), r, scale), n) for n, r in ref.items()))
    return worst


def model_case(dev, model_type, trees, budget, backend, bf16: bool, fp32: bool = True) -> dict:
    from treefx.ops.recurrence import kernel_runs

    vocab = 1024
    model = common.hf_model(model_type, dev=dev, dtype=torch.float32, seed=0, train=False,
                            **common.hybrid_config(256, 512, 3, 4, 2, 64, 2, 4, 128, vocab))
    res: dict = {"model": model_type, "tokens": sum(t.num_tokens for t in trees),
                 "budget": budget, "backend": backend}
    # the oracle: the torch kernel beneath Hugging Face's fla wrapper (treefx.reference does so)
    ref_loss, ref = common.oracle(model, trees)
    floor = treefx.verification.oracle_floor_gradients(model, trees, reduction="mean")
    res["oracle_floor"] = _param_err(floor, ref)
    try:  # the per-sequence run as the model calls its kernel (fla, when HF finds it)
        model.zero_grad(set_to_none=True)
        with model_kernel_oracle():
            treefx.reference.sequence_loss(model, trees, reduction="mean").backward()
        res["per_sequence_model_kernel"] = _param_err(_grads(model), ref)
    except Exception as e:  # noqa: BLE001 - recorded (fla of another version may refuse)
        res["per_sequence_model_kernel"] = f"failed: {str(e).splitlines()[0][:300]}"
    runs = [("fp32", model)] if fp32 else []
    if bf16:
        runs.append(("bf16", copy.deepcopy(model).to(torch.bfloat16)))
    for label, m in runs:
        tm = treefx.compile(m, backend=backend, verify=False)
        row: dict = {}
        before = kernel_runs()
        m.zero_grad(set_to_none=True)
        batch = treefx.pack(trees, reduction="mean").to(dev)
        loss = treefx.tree_loss(tm(batch), batch)
        loss.backward()
        loss = loss.detach()
        row["whole"] = {"loss_rel": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                        "grad": _param_err(_grads(m), ref)}
        m.zero_grad(set_to_none=True)
        ploss = treefx.backward(tm, trees, max_tokens=budget, reduction="mean")
        row["parts"] = {"loss_rel": abs(float(ploss) - float(ref_loss)) / abs(float(ref_loss)),
                        "grad": _param_err(_grads(m), ref)}
        row["kernel_runs"] = common.kernel_runs_delta(before, kernel_runs())
        if label == "bf16":
            try:
                m.zero_grad(set_to_none=True)
                with model_kernel_oracle():
                    treefx.reference.sequence_loss(m, trees, reduction="mean").backward()
                row["per_sequence_bf16_vs_fp32_oracle"] = _param_err(_grads(m), ref)
            except Exception as e:  # noqa: BLE001
                row["per_sequence_bf16_vs_fp32_oracle"] = f"failed: {str(e)[:300]}"
        res[label] = row
    if fp32:
        fp = res["fp32"]
        floor_err = res["oracle_floor"][0]
        res["fp32_tolerance"] = max(10 * floor_err, 1e-4)
        res["passed_fp32"] = all(fp[k]["grad"][0] <= res["fp32_tolerance"]
                                 and fp[k]["loss_rel"] <= 1e-5 for k in ("whole", "parts"))
    if bf16 and isinstance(res["bf16"].get("per_sequence_bf16_vs_fp32_oracle"), tuple):
        own = res["bf16"]["per_sequence_bf16_vs_fp32_oracle"][0]
        res["bf16_tolerance"] = 2 * own + 1e-3
        res["passed_bf16"] = all(res["bf16"][k]["grad"][0] <= res["bf16_tolerance"]
                                 for k in ("whole", "parts"))
    return res



# ----------------------------------------------------------------------------- the one-pass path

def _walk_float64(q, k, v, g, beta, parent, root_state):
    """The tree's Gated DeltaNet in float64, token by token in DFS order: a token's state is
    its predecessor's after it, a root's ``root_state(t)`` (or zeros). q/k at the value heads
    and L2-normalised here; returns (output [T, H, V], state after each token)."""
    q, k, v, g, beta = _float64_inputs(q, k, v, g, beta)
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
    depth by depth); ``cpu``: fla's path taken on CPU tensors too (Triton's interpreter)."""
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
    parent = batch.parent_token
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
    x64 = [_leaf(x, torch.float64) for x in base]
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
        xs = [_leaf(base[0], dtype), _leaf(base[1], dtype), _leaf(base[2], dtype),
              _leaf(base[3], torch.float32), _leaf(base[4], dtype), _leaf(base[5], torch.float32)]
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
        res[label]["paths"] = sorted(k.rsplit(":", 1)[1] for k in
                                     common.kernel_runs_delta(before, kernel_runs()))
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
    against its float64 reference on the forest ``row`` (default random), passed within 1e-5;
    ``repeats`` > 1: every output the same bit for bit that many times (a race would show)."""
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
    random point) beside two more roots: many programs of the state pass waiting at once."""
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.fla_check",
                                description=__doc__.split("\n\n")[0])
    common.add_run_args(p, "CPU: op and model on the torch kernel (fla needs a GPU)")
    p.add_argument("--cases", default="op,model",
                   help="of op, model, exact, state (GPU), interpret-state (alone)")
    p.add_argument("--budget", type=int, default=96, help="model: the parts' token budget")
    p.add_argument("--op-dtypes", default=None,
                   help="op: of float32,bfloat16 (default both on the GPU; fla autotunes each "
                        "dtype's kernels anew, minutes each: split them over processes)")
    p.add_argument("--model-dtypes", default="float32,bfloat16",
                   help="model: its runs (bfloat16 only on the GPU)")
    p.add_argument("--op-layouts", default="qwen3_next,qwen3_5", help="op: its layouts")
    p.add_argument("--dtypes", default="float32,bfloat16", help="exact: its dtypes")
    p.add_argument("--value-heads", type=int, default=4, help="exact: heads (32: Qwen3-Next's)")
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    if cases == ["interpret-state"]:
        runs = [state_pass_exact("cpu", seed, *shape)
                for seed, shape in enumerate([(2, 128, 32), (3, 64, 64), (1, 128, 48)])]
        for r in runs:
            print(json.dumps({"case": "state-pass", **r}), flush=True)
        return 0 if all(r["passed"] for r in runs) else 1
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    if not cuda and {"exact", "state"} & set(cases):
        raise SystemExit("exact and state need a GPU with fla installed")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    common.resolve_out(args, "fla_check", cuda)
    backend = "inductor" if cuda else "eager"
    t0 = time.perf_counter()
    from treefx.families import fla, fla_l2norm, fla_tree

    res = {**common.run_meta(cuda), "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"),
           "TREEFX_FLA": os.environ.get("TREEFX_FLA"),
           "fla_environment": fla.environment(torch.device(dev)).describe(), "cases": {}}
    if cuda:
        res.update(one_pass_available=fla_tree.kernels() is not None,
                   l2norm_fixed_key=fla_l2norm.available())
    print(f"{res['device']}: {res['fla_environment']}", flush=True)
    trees = odd_trees(1024)
    failed = []

    def record(key, fn):
        try:
            out = fn()
        except Exception:
            out = {"error": traceback.format_exc()[-4000:], "passed": False}
        res["cases"][key] = out
        # a model case passes on the runs it made (bf16 alone with --model-dtypes bfloat16)
        ok = out.get("passed", out.get("passed_fp32", "passed_bf16" in out)) \
            and out.get("passed_bf16", True)
        failed.extend([] if ok else [key])
        brief = {k: out[k] for k in ("worst", "tolerance", "kernel_runs", "fp32_tolerance",
                                     "bf16_tolerance", "errors") if k in out}
        brief.update({k: v for k, v in out.items() if k in ("fp32", "bf16", "depth_by_depth",
                                                             "one_pass") and isinstance(v, dict)})
        err = out["error"].strip().splitlines()[-1][:200] if "error" in out else ""
        print(f"[{time.perf_counter() - t0:6.1f}s] {key}: {'passed' if ok else 'FAILED'} "
              f"{brief} {err}", flush=True)
        common.save_json(res, args.out)

    if "op" in cases:
        dtypes = [torch.float32] + ([torch.bfloat16] if cuda else [])
        if args.op_dtypes:
            dtypes = [d for d in dtypes if str(d)[6:] in args.op_dtypes.split(",")]
        for layout in args.op_layouts.split(","):
            for dtype in dtypes:
                for name, forest in trees.items():
                    record(f"op-{layout}-{str(dtype)[6:]}-{name}",
                           lambda: op_case(dev, dtype, layout, forest))
    if "model" in cases:
        for model_type in ("qwen3_next", "qwen3_5_text"):
            record(f"model-{model_type}", lambda: model_case(
                dev, model_type, trees["forest"], args.budget, backend,
                bf16=cuda and "bfloat16" in args.model_dtypes,
                fp32="float32" in args.model_dtypes))
    if "exact" in cases:
        rng = np.random.default_rng(0)
        deep = [treefx.Tree.from_sequences([[int(t) for t in rng.integers(3, 1000, n)]
                                            for n in (40, 90, 200)])]
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",") if d]:
            for name, forest in {**trees, "separate-sequences": deep,
                                 "many-nodes": many_nodes(1000)}.items():
                record(f"{str(dtype)[6:]}-{name}", lambda: exact_case(
                    "cuda", dtype, forest, value_heads=args.value_heads))
    if "state" in cases:
        # random forests, then the many-node tree at Qwen3-Next's heads 20 times (bit for bit)
        big = treefx.pack(many_nodes(1000)).parent_token.numpy()
        for key, kw in [("state-random-0", dict(seed=0, heads=2, key_dim=128, value_dim=32)),
                        ("state-random-1", dict(seed=1, heads=3, key_dim=64, value_dim=64)),
                        ("state-many-nodes", dict(seed=2, heads=32, key_dim=128, value_dim=128,
                                                  row=big, repeats=20))]:
            record(key, lambda: state_pass_exact("cuda", **kw))
    res["failed"] = failed
    res["total_s"] = time.perf_counter() - t0
    common.save_json(res, args.out)
    print(f"total {res['total_s']:.0f} s; {'all passed' if not failed else f'FAILED: {failed}'};"
          f" JSON: {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
