"""The e2e run's tree sizes and bounds, the summary rows, the issue's targets, and the table
printed at the end."""

from __future__ import annotations

import treefx

from .mask_build import fmt_entry


def tree_info(t: treefx.Tree) -> dict:
    """Sizes, the token-count bound, and the attended (q, k) pairs of both layouts: a tree
    token attends to its depth + 1 keys, a packed token to its position + 1."""
    depth = treefx.pack(t).position_ids[0].double() + 1
    return {"tokens": t.num_tokens, "baseline_tokens": t.num_baseline_tokens,
            "sequences": t.num_sequences, "nodes": t.num_nodes, "por": round(t.por, 4),
            "bound": t.bound, "max_seq_len": int(max(t.sequence_lengths)),
            "tree_pairs": int(depth.sum()),
            "baseline_pairs": int(sum(n * (n + 1) // 2 for n in t.sequence_lengths))}


def flop_bound(info: dict, model: dict) -> float:
    """Baseline FLOPs / tree FLOPs of a training step: 6 FLOPs per parameter per token for the
    matmuls (embedding lookups excluded), and per attended pair 4 * head_dim * heads per layer
    forward, 3.5x that with the backward. The speedup that equal kernel efficiency gives; the
    token-count bound assumes attention costs nothing."""
    h, heads, kv, d = (model["hidden_size"], model["num_attention_heads"],
                       model["num_key_value_heads"], model["head_dim"])
    layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * model["intermediate_size"]
    per_token = 6 * (model["num_hidden_layers"] * layer + h * model["vocab_size"])
    per_pair = 3.5 * 4 * d * heads * model["num_hidden_layers"]
    tree = info["tokens"] * per_token + info["tree_pairs"] * per_pair
    base = info["baseline_tokens"] * per_token + info["baseline_pairs"] * per_pair
    return base / tree


def summarize(res) -> list[dict]:
    rows = []
    for key, runs in res["runs"].items():
        for label, methods in runs.items():
            info = res["trees"][label]
            # The packing baseline: packed, or packed_reset for models with state.
            pk = methods.get("packed") if "step_ms" in methods.get("packed", {}) else \
                methods.get("packed_reset", {})
            base = pk.get("step_ms")
            obo = methods.get("one_by_one", {}).get("step_ms")
            for name, r in methods.items():
                row = {"model": key, "tree": label, "method": name, "por": info["por"],
                       "tokens": info["tokens"], "baseline_tokens": info["baseline_tokens"],
                       "bound": info["bound"]}
                if "tree_pairs" in info and res.get("models", {}).get(key, {}).get(
                        "arch", "qwen3") == "qwen3":
                    row["flop_bound"] = flop_bound(info, res["models"][key])
                if "step_ms" in r:
                    t = r["step_ms"]
                    row.update(step_ms=t, tokens_per_s=info["baseline_tokens"] / (t / 1e3),
                               peak_gib=r.get("peak_gib"))
                    if base:
                        row["speedup_vs_packed"] = base / t
                        row["share_of_bound"] = base / t / info["bound"]
                        if "flop_bound" in row:
                            row["share_of_flop_bound"] = base / t / row["flop_bound"]
                    if obo:
                        row["speedup_vs_one_by_one"] = obo / t
                    row["compilations"] = r.get("treefx_compilations_total")
                    row["graphs"] = r["dynamo_warmup"].get("unique_graphs", 0) + \
                        r["dynamo_timed"].get("unique_graphs", 0)
                    row["recompiles_timed"] = r["dynamo_timed"].get("unique_graphs", 0)
                    if "loss" in r and "loss" in pk:
                        row["loss_rel_diff_vs_packed"] = abs(r["loss"] - pk["loss"]) / abs(
                            pk["loss"])
                else:
                    row["status"] = "skipped" if "skipped" in r else "FAILED"
                rows.append(row)
    return rows


def targets(res) -> list[dict]:
    """The issue's targets, evaluated on this run (value None: not measured)."""
    out = []
    trees = {k: v for k, v in res["trees"].items() if "por" in v}

    def add(what, value, ok):
        out.append({"target": what, "value": value, "ok": ok})

    if trees:
        lab = min(trees, key=lambda k: abs(trees[k]["por"] - 0.75))
        info = trees[lab]
        for key, need in (("hidden1024", 0.93), ("hidden2048", 0.95)):
            m = res["runs"].get(key, {}).get(lab, {})
            pk, hd = (m.get(x, {}).get("step_ms") for x in ("packed", "hand"))
            for meth in ("treefx", "treefx_step", "treefx_standard"):
                if meth != "treefx" and meth not in m:
                    continue
                tf = m.get(meth, {}).get("step_ms")
                share = pk / tf / info["bound"] if tf and pk else None
                add(f"{key} POR {info['por']:.2f}: {meth} speedup over packed >= {need:.0%} of "
                    f"bound {info['bound']:.2f}", share, None if share is None else share >= need)
                add(f"{key} POR {info['por']:.2f}: {meth} step <= hand-written step (ms)",
                    None if not (tf and hd) else [round(tf, 2), round(hd, 2)],
                    None if not (tf and hd) else tf <= hd)
        for key, runs in res["runs"].items():
            for label, m in runs.items():
                a, b = m.get("treefx", {}).get("peak_gib"), m.get("packed", {}).get("peak_gib")
                if a is not None and b is not None:
                    add(f"{key} {label}: treefx peak memory < packed (GiB)",
                        [round(a, 2), round(b, 2)], a < b)
    mb = res.get("mask_build") or {}
    e = mb.get("tree_block_mask eager (batch.block_mask())", {})
    times = {k: v["ms_median"] for k, v in mb.items() if isinstance(v, dict) and "ms_median" in v
             and "create_block_mask" not in k and "kv tensors only" not in k}
    if times:
        add(f"BlockMask for {mb.get('tokens')} tokens <= 1 ms: batch.block_mask() (eager)",
            e.get("ms_median"), None if "ms_median" not in e else e["ms_median"] <= 1.0)
        best = min(times, key=times.get)
        add(f"BlockMask for {mb.get('tokens')} tokens <= 1 ms: best treefx variant ({best})",
            times[best], times[best] <= 1.0)
    st = res.get("stream") or {}
    if "further_compilations" in st:
        add(f"stream of {st['trees']} trees after warm-up: no further compilation",
            st["further_compilations"], st["further_compilations"] == 0)
    return out


def print_table(res, rows) -> None:
    def f(v, fmt):
        width = int("0" + fmt.split(".")[0].rstrip("dfe"))
        return format(v, fmt) if v is not None else "-".rjust(width)

    print()
    print("=" * 140)
    mb = res.get("mask_build") or {}
    if mb:
        print(f"BlockMask building, {mb.get('tokens')} tokens (median of {mb.get('reps')}):")
        for k, v in mb.items():
            if isinstance(v, dict):
                print(f"  {k:82s} {fmt_entry(v)}")
    st = res.get("stream")
    if st:
        if "further_compilations" in st:
            what = (f"{st['further_compilations']} further treefx compilations, "
                    f"dynamo {st['dynamo']}")
        else:
            what = (st.get("skipped") or st.get("error", "?").strip().splitlines()[-1])[:300]
        sizes = st.get("sizes") or [0]
        print(f"stream of {len(sizes)} trees, {min(sizes)}-{max(sizes)} tokens: {what}")
    for t in res.get("targets", []):
        mark = {True: "MET ", False: "MISS", None: "n/a "}[t["ok"]]
        val = t["value"]
        val = f"{val:.3f}" if isinstance(val, float) else val
        print(f"  [{mark}] {t['target']}: {val}")
    errs = [(r["model"], r["tree"], r["method"]) for r in rows if r.get("status") == "FAILED"]
    for key, tree, meth in errs:
        tb = res["runs"][key][tree][meth]["error"].strip().splitlines()
        print(f"FAILED {key}/{tree}/{meth}: {tb[-1][:300] if tb else ''}")
    m = res["meta"]
    print(f"device {m['device']} | torch {m['torch']} | triton {m['triton']} | transformers "
          f"{m['transformers']} | {'CUDA events' if m['cuda'] else 'CPU wall clock'}, median of "
          f"{res['config']['reps']} after {res['config']['warmup']} warm-up | Mtok/s = baseline "
          f"tokens / step | % flop = share of the FLOP bound (attended pairs counted) | "
          f"graphs = Dynamo graphs compiled for this row")
    hdr = (f"{'model':10s} {'tree':8s} {'POR':>5s} {'N_tree':>7s} {'N_base':>7s} "
           f"{'bound':>5s} {'method':10s} {'step ms':>9s} {'Mtok/s':>7s} {'peak GiB':>8s} "
           f"{'x packed':>8s} {'x 1by1':>7s} {'% bound':>7s} {'% flop':>6s} {'graphs':>6s} "
           f"{'tfx comp':>8s} {'dloss':>7s}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        head = (f"{r['model']:10s} {r['tree']:8s} {r['por']:5.3f} {r['tokens']:7d} "
                f"{r['baseline_tokens']:7d} {r['bound']:5.2f} {r['method']:10s} ")
        if "step_ms" not in r:
            print(head + r["status"])
            continue
        share, fshare = r.get("share_of_bound"), r.get("share_of_flop_bound")
        print(head + f"{r['step_ms']:9.2f} {r['tokens_per_s'] / 1e6:7.3f} "
              f"{f(r['peak_gib'], '8.2f')} {f(r.get('speedup_vs_packed'), '8.2f')} "
              f"{f(r.get('speedup_vs_one_by_one'), '7.2f')} "
              f"{f(None if share is None else 100 * share, '7.1f')} "
              f"{f(None if fshare is None else 100 * fshare, '6.1f')} {r['graphs']:6d} "
              f"{f(r['compilations'], '8d')} {f(r.get('loss_rel_diff_vs_packed'), '7.1e')}")


def conventions(args, env) -> dict:
    """How the figures of a run are defined (recorded in its JSON)."""
    return {
        "step": "pack/layout + mask building + forward + loss + backward (zero_grad "
                "set_to_none at the start); no optimizer step",
        "tokens_per_s": "baseline tokens (sum of sequence lengths) / step time, for "
                        "every method",
        "bound": "N_baseline / N_tree; share_of_bound = speedup_vs_packed / bound",
        "peak_gib": "torch.cuda.max_memory_allocated over the timed steps (reset before)",
        "graphs": "Dynamo unique graphs compiled during warm-up + timed steps of that "
                  "tree/method (recompiles_timed: during timed steps only)",
        "one_by_one": "HF sdpa (flash), torch.compile dynamic=True"
                      if args.obo_compile == "dynamic" else "HF sdpa, eager (no compile)",
        "packed_mask": "flex BlockMask from per-block doc ends (tree_block_tensors on "
                       "doc_end), mask_mod kv <= q < doc_end[kv]",
        "hand_mask": "compiled create_block_mask, mask_mod kv <= q < subtree_end[kv]",
        "loss": f"chunked weighted cross-entropy, {env.chunk}-token chunks, each a "
                "compiled call (packed, hand); treefx.tree_loss (treefx); per-sequence "
                "mean CE (one_by_one)",
    }
