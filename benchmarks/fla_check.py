"""Gated DeltaNet (and Kimi Delta Attention) on fla's kernels through the tree, against each
sequence run alone: values and gradients, float32 and bf16, whole trees and in parts
(BENCHMARKS.md, "Hybrids on fla's kernels").

    python -m benchmarks.fla_check                 # GPU with fla installed, a few minutes
    python -m benchmarks.fla_check --dry-run       # CPU: the same code, torch kernel (no fla)

- ``op``: the tree recurrence alone on odd trees, in the Qwen3-Next and Qwen3.5 layouts,
  against a float64 recurrence, beside the torch kernel's and fla's own per-sequence errors
  (float32 within max(2 × fla's own, 10 × the torch floor) + 1e-6; bf16 within 2 × fla's own
  + 1e-3). ``TRITON_F32_DEFAULT=ieee`` is set unless given.
- ``model``: HF Qwen3-Next and Qwen3.5 (2 Gated DeltaNet + 1 attention layers), loss and every
  gradient, whole and in parts, against the torch-kernel oracle and its floor; bf16 against
  the float32 oracle beside the bf16 per-sequence run.

Every case records the kernel path the tree took (``kernel_runs``) and fla's decision.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import os
import time
import traceback

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

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

def gdn_float64(q, k, v, g, beta):
    """Gated DeltaNet token by token in float64 ([B, T, H, *]: B sequences of T tokens, each
    from a zero state; q/k already at the value heads), query and key L2-normalised as
    Hugging Face and fla do: the reference. One step runs all B sequences."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
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

    def per_sequence(fn, xs):
        """Σ over sequences of <probe, fn(sequence alone)> / multiplicity: the per-sequence
        objective whose gradient the tree's equals; and the outputs scattered to the row."""
        out = torch.zeros(1, n, hv, d, dtype=torch.float64, device=dev)
        total = 0
        for idx in idxs:
            o = fn(*(x[:, idx] for x in xs))
            out[:, idx] = o.double().detach()
            total = total + (o.double() * probe[:, idx].double()
                             / mult[idx, None, None]).sum()
        return out, total

    def grads_of(total, xs):
        return [g.double() for g in torch.autograd.grad(total, xs)]

    def leaf(x, dt):
        return x.detach().to(dt).requires_grad_()

    def reference(xs):
        """per_sequence's result for the float64 recurrence, every sequence in one batch
        (right-padded; a padded step's output is not read): as many steps as the longest
        sequence, not as all sequences' tokens (a GPU is launch-bound on such steps)."""
        length = max(len(idx) for idx in idxs)

        def padded(x):
            return torch.stack([torch.cat([x[0, idx], x.new_zeros(length - len(idx),
                                                                  *x.shape[2:])])
                                for idx in idxs])

        q_, k_, *rest = (padded(x) for x in xs)
        o = gdn_float64(*_expand(q_, k_, hv), *rest)
        out = torch.zeros(1, n, hv, d, dtype=torch.float64, device=dev)
        total = 0
        for j, idx in enumerate(idxs):
            oj = o[j, :len(idx)]
            out[0, idx] = oj.detach()
            total = total + (oj * probe[0, idx].double() / mult[idx, None, None]).sum()
        return out, total

    x64 = [leaf(x, torch.float64) for x in base]
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
    xt = [leaf(x, torch.float32) for x in base]
    floor_out, floor_total = per_sequence(_torch_kernel, xt)
    res["torch_kernel_per_sequence_fp32"] = errors(floor_out, grads_of(floor_total, xt))

    def inputs():  # as the model gives them: the decay in float32, the rest in ``dtype``
        return [leaf(base[0], dtype), leaf(base[1], dtype), leaf(base[2], dtype),
                leaf(base[3], torch.float32), leaf(base[4], dtype)]

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
    res["kernel_runs"] = _runs_delta(before, kernel_runs())
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


def _runs_delta(before, after) -> dict:
    return {f"{name}:{path}": after[(name, path)] - before.get((name, path), 0)
            for name, path in after if after[(name, path)] != before.get((name, path), 0)}


# ----------------------------------------------------------------------------- model level

def _config(model_type: str, vocab: int) -> dict:
    cfg = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "linear_attention", "full_attention"])
    if model_type == "qwen3_next":
        cfg.update(num_experts=0, mlp_only_layers=[0, 1, 2])
    return cfg


@contextlib.contextmanager
def model_kernel_oracle():
    """The per-sequence run as the model calls its kernel (Hugging Face's fla call when fla is
    installed): the oracle's switch to the torch kernel beneath that wrapper
    (:func:`treefx.families.hf_kernels.torch_kernel_paths`) left out while it runs."""
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
                            **_config(model_type, vocab))
    res: dict = {"model": model_type, "tokens": sum(t.num_tokens for t in trees),
                 "budget": budget, "backend": backend}
    # the oracle: the torch kernel beneath Hugging Face's fla wrapper (treefx.reference does so)
    model.zero_grad(set_to_none=True)
    ref_loss = treefx.reference.sequence_loss(model, trees, reduction="mean")
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    ref = _grads(model)
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
        row["kernel_runs"] = _runs_delta(before, kernel_runs())
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


# ----------------------------------------------------------------------------- main

def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.fla_check",
                                description=__doc__.split("\n\n")[0])
    common.add_run_args(p, "CPU: the same cases on the torch kernel (fla needs a GPU)")
    p.add_argument("--cases", default="op,model", help="op,model")
    p.add_argument("--budget", type=int, default=None, help="parts' token budget (default 96)")
    p.add_argument("--backend", default=None, help="treefx backend (default: inductor on CUDA)")
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--op-dtypes", default=None,
                   help="the op level's dtypes among float32,bfloat16 (default both on the GPU; "
                        "fla autotunes each dtype's kernels anew, minutes each: split them "
                        "over processes)")
    p.add_argument("--model-dtypes", default="float32,bfloat16",
                   help="the model level's runs (bfloat16 only on the GPU)")
    p.add_argument("--op-layouts", default="qwen3_next,qwen3_5",
                   help="the op level's layouts (split them over processes too)")
    args = p.parse_args(argv)
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    common.resolve_out(args, "fla_check", cuda)
    backend = args.backend or ("inductor" if cuda else "eager")
    t0 = time.perf_counter()
    res = {**common.run_meta(cuda), "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"),
           "TREEFX_FLA": os.environ.get("TREEFX_FLA"), "cases": {}}
    from treefx.families import fla

    res["fla_environment"] = fla.environment(torch.device(dev)).describe()
    print(f"{res['device']}: {res['fla_environment']}", flush=True)
    trees = odd_trees(1024)
    cases = args.cases.split(",")
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
        if not ok:
            failed.append(key)
        brief = {k: out[k] for k in ("worst", "tolerance", "kernel_runs", "fp32_tolerance",
                                     "passed_fp32", "passed_bf16", "passed") if k in out}
        for label in ("fp32", "bf16"):
            if isinstance(out.get(label), dict):
                brief[label] = {k: out[label][k] for k in ("whole", "parts", "kernel_runs")}
        if "error" in out:
            brief["error"] = out["error"].strip().splitlines()[-1][:200]
        print(f"[{time.perf_counter() - t0:6.1f}s] {key}: {brief}", flush=True)
        common.save_json(res, args.out)

    if "op" in cases:
        dtypes = [torch.float32] + ([torch.bfloat16] if cuda and not args.no_bf16 else [])
        if args.op_dtypes:
            dtypes = [d for d in dtypes if str(d)[6:] in args.op_dtypes.split(",")]
        for layout in args.op_layouts.split(","):
            for dtype in dtypes:
                for name, forest in trees.items():
                    record(f"op-{layout}-{str(dtype)[6:]}-{name}",
                           lambda: op_case(dev, dtype, layout, forest))
    if "model" in cases:
        budget = args.budget or 96
        forest = trees["forest"]
        for model_type in ("qwen3_next", "qwen3_5_text"):
            record(f"model-{model_type}", lambda: model_case(
                dev, model_type, forest, budget, backend,
                bf16=cuda and not args.no_bf16 and "bfloat16" in args.model_dtypes,
                fp32="float32" in args.model_dtypes))
    res["failed"] = failed
    res["total_s"] = time.perf_counter() - t0
    common.save_json(res, args.out)
    print(f"total {res['total_s']:.0f} s; {'all passed' if not failed else f'FAILED: {failed}'};"
          f" JSON: {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
