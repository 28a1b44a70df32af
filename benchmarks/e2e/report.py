"""The e2e run's tree sizes and bounds, the summary rows and the table printed at the end."""

from __future__ import annotations

import treefx


def tree_info(t: treefx.Tree) -> dict:
    """Sizes, the token-count bound, and the attended (q, k) pairs of both layouts: a tree
    token attends to its depth + 1 keys, a packed token to its position + 1."""
    depth = treefx.pack(t).position_ids[0].double() + 1
    info = {"tokens": t.num_tokens, "baseline_tokens": t.num_baseline_tokens,
            "sequences": t.num_sequences, "nodes": t.num_nodes, "por": round(t.por, 4),
            "bound": t.bound, "max_seq_len": int(max(t.sequence_lengths)),
            "tree_pairs": int(depth.sum()),
            "baseline_pairs": int(sum(n * (n + 1) // 2 for n in t.sequence_lengths))}
    return info


def _step_flops(info: dict, model: dict, side: str, per_pair_factor: float) -> float | None:
    """FLOPs of one training step of Qwen3 on ``side`` ("tree" or "baseline") tokens: 6 per
    parameter a token uses (embedding lookups excluded, the output projection counted) and
    ``per_pair_factor`` times each layer's forward FLOPs per attended pair. None for another
    architecture (hybrids: their recurrent layers are not counted here)."""
    if model.get("arch", "qwen3") != "qwen3":
        return None
    h, heads = model["hidden_size"], model["num_attention_heads"]
    kv, d = model["num_key_value_heads"], model["head_dim"]
    layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * model["intermediate_size"]
    layers = model["num_hidden_layers"]
    per_token = 6 * (layers * layer + h * model["vocab_size"])
    return (info["tokens" if side == "tree" else "baseline_tokens"] * per_token
            + per_pair_factor * layers * 4 * d * heads * info[f"{side}_pairs"])


def flop_bound(info: dict, model: dict) -> float | None:
    """Baseline FLOPs / tree FLOPs of a training step (:func:`_step_flops`), attention's
    backward counted at 2.5x its forward (3.5x in all: FlashAttention recomputes the scores).
    The speedup that equal kernel efficiency gives; the token-count bound assumes attention
    costs nothing."""
    tree = _step_flops(info, model, "tree", 3.5)
    base = _step_flops(info, model, "baseline", 3.5)
    return None if tree is None or base is None else base / tree


# Methods that compute on the tree's tokens (the others on every sequence's own tokens).
_ON_TREE = ("treefx", "treefx_step")


def model_flops(info: dict, model: dict, method: str) -> float | None:
    """The model FLOPs of one step of ``method`` (what utilization is usually counted in):
    6 per parameter-token, attention at 3x its forward per attended pair (the scores'
    recomputation in the backward not counted); on the tree's tokens and pairs for treefx and
    its variants, on the sequences' for the baselines."""
    tree = method in _ON_TREE or method.startswith("treefx_")
    return _step_flops(info, model, "tree" if tree else "baseline", 3.0)


def summarize(res) -> list[dict]:
    rows = []
    for key, runs in res["runs"].items():
        for label, methods in runs.items():
            info = res["trees"][label]
            # The packing baseline: packed, or packed_reset for models with state.
            pk = methods.get("packed") if "step_ms" in methods.get("packed", {}) else \
                methods.get("packed_reset", {})
            base = pk.get("step_ms")
            for name, r in methods.items():
                row = {"model": key, "tree": label, "method": name, "por": info["por"],
                       "tokens": info["tokens"], "baseline_tokens": info["baseline_tokens"],
                       "bound": info["bound"]}
                model = res.get("models", {}).get(key) if "tree_pairs" in info else None
                bound = flop_bound(info, model) if model else None
                if bound is not None:
                    row["flop_bound"] = bound
                if "step_ms" in r:
                    t = r["step_ms"]
                    row.update(step_ms=t, tokens_per_s=info["baseline_tokens"] / (t / 1e3),
                               peak_gib=r.get("peak_gib"))
                    if base:
                        row["speedup_vs_packed"] = base / t
                        row["share_of_bound"] = base / t / info["bound"]
                        if "flop_bound" in row:
                            row["share_of_flop_bound"] = base / t / row["flop_bound"]
                    flops = model_flops(info, model, name) if model else None
                    if flops is not None:
                        row["model_tflops_per_s"] = flops / (t / 1e3) / 1e12
                        mr = (res.get("matmul_rate") or {}).get(key, {})
                        if mr.get("max_tflops"):
                            row["share_of_matmul_rate"] = \
                                row["model_tflops_per_s"] / mr["max_tflops"]
                        if mr.get("sustained_tflops"):
                            row["share_of_sustained_matmul_rate"] = \
                                row["model_tflops_per_s"] / mr["sustained_tflops"]
                    if "first_step_s" in r:
                        row["first_step_s"] = r["first_step_s"]
                    row["compilations"] = r.get("treefx_compilations_total")
                    row["recurrence_on"] = r.get("recurrence_on")
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


# the table's columns: (summary key, heading, format; "%" a share in percent)
COLUMNS = (("step_ms", "step ms", "9.2f"), ("tokens_per_s", "tok/s", "10.0f"),
           ("peak_gib", "peak GiB", "8.2f"), ("speedup_vs_packed", "x packed", "8.2f"),
           ("share_of_bound", "% bound", "%7.1f"), ("share_of_flop_bound", "% flop", "%6.1f"),
           ("graphs", "graphs", "6d"), ("compilations", "tfx comp", "8d"),
           ("loss_rel_diff_vs_packed", "dloss", "7.1e"), ("model_tflops_per_s", "TFLOP/s", "7.1f"),
           ("share_of_matmul_rate", "% mm", "%5.1f"), ("first_step_s", "1st s", "6.1f"),
           ("recurrence_on", "rec.", "5s"))


def print_table(res, rows) -> None:
    """The summary, a row per model, tree and method (``conventions`` in the JSON defines the
    figures; % mm: of the best bf16 matmul rate measured in the run; rec.: the recurrent
    layers' kernel)."""
    for key, mr in (res.get("matmul_rate") or {}).items():
        print(f"bf16 matmul rate [{key}]: max {mr['max_tflops']:.0f} TFLOP/s, sustained "
              f"{mr.get('sustained_tflops') or 0:.0f}")
    m, c = res["meta"], res["config"]
    print(f"{m['device']} | torch {m['torch']} | transformers {m['transformers']} | median of "
          f"{c['reps']} after {c['warmup']} warm-up")

    def cell(r, key, fmt):
        v, width = r.get(key), int("0" + fmt.strip("%").split(".")[0].rstrip("dfes"))
        if v is None:
            return "-".rjust(width)
        return format(100 * v, fmt[1:]) if fmt.startswith("%") else format(v, fmt)

    hdr = f"{'model':10s} {'tree':8s} {'bound':>5s} {'method':16s} " + " ".join(
        h.rjust(int("0" + f.strip("%").split(".")[0].rstrip("dfes"))) for _, h, f in COLUMNS)
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        head = f"{r['model']:10s} {r['tree']:8s} {r['bound']:5.2f} {r['method']:16s} "
        print(head + (" ".join(cell(r, k, f) for k, _, f in COLUMNS) if "step_ms" in r
                      else r["status"]))


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
        "packed_mask": "flex BlockMask from per-block doc ends (tree_block_tensors on "
                       "doc_end), mask_mod kv <= q < doc_end[kv]",
        "model_tflops_per_s": "model FLOPs of the step / step time: 6 per parameter-token "
                              "(embedding lookups excluded, output projection counted), "
                              "attention 3x its forward per attended pair; tree tokens and "
                              "pairs for treefx, the sequences' for the baselines",
        "matmul_rate": "bf16 torch.mm at the model's shapes and 8192^3, median of 20 after "
                       "3 warm-up, measured in the same run; share_of_matmul_rate = "
                       "model_tflops_per_s / the best of them; sustained_tflops: the "
                       "first shape back to back for about a step's length (250 ms), timed "
                       "as one (the clock under sustained load); share_of_sustained_"
                       "matmul_rate = model_tflops_per_s / that",
        "loss": f"chunked weighted cross-entropy, {env.chunk}-token chunks, each a "
                "compiled call (packed); treefx.tree_loss (treefx)",
    }
