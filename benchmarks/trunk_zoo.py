"""The trunk split (:mod:`treefx.ops.attention.trunk`), or with ``--intervals`` the interval op,
across the zoo's model families on the CPU, each against every sequence run alone
(``treefx.verify``; docs/performance.md has the results).

    python -m benchmarks.trunk_zoo --models qwen3,llama,mistral
    python -m benchmarks.trunk_zoo            # the default sample below
    python -m benchmarks.trunk_zoo --intervals [--checkpointing] [--parts]

Per family: passed, whether a site split its chain off (or took the interval op), the errors;
``--checkpointing``: every layer checkpointed; ``--parts``: ``treefx.backward`` in parts of 40
and 9 tokens too.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

SAMPLE = ("qwen3,llama,mistral,gemma,gemma2,phi3,qwen2,granite,olmo2,cohere,starcoder2,gpt2,"
          "gpt_neox,falcon,stablelm,phi,glm,mixtral,qwen3_moe,olmoe,deepseek_v3,"
          "smollm3,exaone4,hunyuan_v1_dense,arcee,seed_oss,ministral")
BUDGETS = (40, 9)          # tokens per part (--parts)
GRAD_RTOL, LOSS_RTOL = 1e-4, 1e-5  # float32, as tests/test_parts.py checks


def comb(vocab: int, exclude) -> list:
    """A trunk of 70 tokens with leaves off it (the layout puts the trunk first)."""
    import treefx

    tokens = np.array([t for t in range(vocab) if t not in set(exclude)])
    rng = np.random.default_rng(0)
    t = rng.choice(tokens, 70).tolist()
    leaf = rng.choice(tokens, 10).tolist()
    return [treefx.Tree.from_sequences([t[:40] + leaf[:9], t[:60] + leaf[9:], t, t[:20]])]


def in_parts(tm, trees, budgets=BUDGETS) -> dict:
    """``treefx.backward`` in parts of each budget against the oracle: each parameter's
    gradient error as ``treefx.verify`` measures it (relative, floored at 1e-3 of all the
    gradients' norm), the loss's relative error; the part graph's attention sites and those
    on the interval op."""
    import treefx
    from benchmarks.common import grads_of, oracle
    from treefx.run.parts import runners

    model = tm.model
    ref_loss, ref = oracle(model, trees)
    out = {}
    for b in budgets:
        try:
            loss = float(treefx.backward(tm, trees, max_tokens=b))
        except Exception as e:  # noqa: BLE001  (refused)
            model.zero_grad(set_to_none=True)
            out[b] = {"status": "refused", "error": f"{type(e).__name__}: {e}"[:300]}
            continue
        got = grads_of(model)
        # treefx.verify's measure: |g - g_ref| / max(|g_ref|, 1e-3 |G_ref|) (G_ref: all the
        # gradients), so a gradient zero up to rounding is not judged on that rounding alone
        scale = float(sum(g.double().pow(2).sum() for g in ref.values()) ** 0.5)
        errs = {n: float((got[n] - g).double().norm()) / max(float(g.double().norm()),
                                                             1e-3 * scale, 1e-30)
                for n, g in ref.items() if n in got}
        worst = max(errs, key=errs.get)
        notes = [r.note for r in runners(tm)[0].engine.contexts[-1].log  # no MoE router
                 if r.pass_name == "attention" and "not attention" not in r.note]
        r = {"interval_sites": sum("interval-mask" in n for n in notes), "sites": len(notes),
             "grad_err": errs[worst], "worst_param": worst,
             "loss_err": abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)}
        missing = sorted(set(ref) ^ set(got))
        if missing:
            r["missing_grads"] = missing[:10]
        ok = not missing and r["grad_err"] <= GRAD_RTOL and r["loss_err"] <= LOSS_RTOL
        out[b] = {"status": "exact" if ok else "WRONG", **r}
    return out


def run(model_type: str, checkpointing: bool = False, parts: bool = False) -> dict:
    import torch

    import treefx
    from treefx.tools import zoo

    t0 = time.perf_counter()
    try:
        model = zoo.build_model(model_type, torch.float32, checkpointing=checkpointing)
    except Exception as e:  # noqa: BLE001  (a config the zoo cannot build here)
        return {"model": model_type, "status": "config failed", "error": str(e)[:200]}
    exclude = zoo.special_token_ids(model.config)
    tm = None
    try:
        tm = treefx.compile(model, backend="flex-eager", block_size=16, verify=False)
        reps = [treefx.verify(tm, trees, raise_on_failure=False)
                for trees in (zoo.probe_forest(zoo.VOCAB, exclude), comb(zoo.VOCAB, exclude))]
    except Exception as e:  # noqa: BLE001  (refused: an error, not a wrong result)
        row = {"model": model_type, "status": "refused", "error": str(e)[:300]}
        if not parts or tm is None:
            return row
        return {**row, **_parts_row(tm, exclude, t0)}  # the whole tree refused; parts may not
    notes = [r.note for c in tm.contexts for r in c.log if r.pass_name == "attention"]
    row = {"model": model_type, "status": "exact" if all(r.passed for r in reps) else "WRONG",
           "split_sites": sum("dense causal kernel" in n for n in notes),
           "interval_sites": sum("interval-mask" in n for n in notes),
           "sites": len(notes), "logprob_err": max(r.max_logprob_error for r in reps),
           "grad_err": max(r.max_grad_error for r in reps),
           "seconds": round(time.perf_counter() - t0, 1)}
    return {**row, **_parts_row(tm, exclude, t0)} if parts else row


def _parts_row(tm, exclude, t0) -> dict:
    """``in_parts`` on the probe forest as a row's ``parts_*`` fields: the worst budget's."""
    from treefx.tools import zoo

    t1 = time.perf_counter()
    try:
        by = in_parts(tm, zoo.probe_forest(zoo.VOCAB, exclude))
    except Exception as e:  # noqa: BLE001  (the oracle or the comparison failed)
        by = {"oracle": {"status": "refused", "error": f"{type(e).__name__}: {e}"[:300]}}
    st = [r["status"] for r in by.values()]
    ran = [r for r in by.values() if r["status"] != "refused"]
    return {"parts_status": "refused" if "refused" in st else "WRONG" if "WRONG" in st
            else "exact",
            "parts_interval_sites": min((r["interval_sites"] for r in ran), default=0),
            "parts_sites": max((r["sites"] for r in ran), default=0),
            "parts_grad_err": max((r["grad_err"] for r in ran), default=None),
            "parts_loss_err": max((r["loss_err"] for r in ran), default=None),
            "parts": {str(b): r for b, r in by.items()},
            "parts_seconds": round(time.perf_counter() - t1, 1),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.trunk_zoo",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=SAMPLE)
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing on every layer (train mode, dropout 0)")
    p.add_argument("--intervals", action="store_true",
                   help="the sites on cuDNN's interval-mask op (plain torch here) instead")
    p.add_argument("--parts", action="store_true",
                   help=f"also treefx.backward in parts of {BUDGETS} tokens on the probe forest")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    os.environ["TREEFX_TRUNK_ATTENTION"] = "1"
    if args.intervals:
        os.environ["TREEFX_CUDNN_ATTENTION"] = "1"
    rows = []
    for m in args.models.split(","):
        r = run(m, args.checkpointing, args.parts)
        rows.append(r)
        print(json.dumps(r), flush=True)
    summary = {s: sum(r["status"] == s for r in rows) for s in {r["status"] for r in rows}}
    print("summary:", summary, "split in", sum(r.get("split_sites", 0) > 0 for r in rows),
          "families; on intervals in", sum(r.get("interval_sites", 0) > 0 for r in rows))
    out = {"rows": rows, "summary": summary}
    if args.parts:
        ps = [r.get("parts_status", r["status"]) for r in rows]
        out["parts_summary"] = {s: ps.count(s) for s in sorted(set(ps))}
        print("parts:", out["parts_summary"], "on intervals in",
              sum(r.get("parts_interval_sites", 0) > 0 for r in rows), "families; budgets",
              list(BUDGETS))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
