"""The dry run's exactness checks (CPU, float32): every method's loss and gradients against
the per-sequence oracle, and the FlexAttention forward of the packed and tree BlockMasks
against the dense masks the CPU steps use."""

from __future__ import annotations

import torch

import treefx

from ..common import counts_delta, dynamo_counts, loss_vs_oracle, oracle
from ..internals import tree_block_tensors
from .body import make_body
from .env import BLOCK, TREE_ATTN, set_attn
from .methods.packed import PackedData


def dry_checks(env, model, trees, parts) -> dict:
    """See the module's docstring; a method (not always a treefx model) is compared through its
    loss and ``.grad`` (:func:`benchmarks.common.loss_vs_oracle`)."""
    out = {}
    for label, tree in trees.items():
        set_attn(model, TREE_ATTN)
        ref = oracle(model, tree, reduction="mean")
        entry = {"reference_loss": ref[0]}
        for name in parts["prepare"]:
            step = parts["prepare"][name](tree)
            loss = step()
            entry[name] = loss_vs_oracle(model, loss, ref)
        out[label] = entry

    # FlexAttention's forward (no backward on the CPU) through the same HF plumbing
    flex_body = make_body(env, model, "flex")
    dense_body = make_body(env, model, "dense")
    for label, tree in trees.items():
        batch = treefx.pack(tree, reduction="mean")
        data = PackedData(tree)
        ids, pos, ends, _, _ = data.layout()
        rows = {
            "tree": (batch.input_ids, batch.position_ids, batch.subtree_end),
            "packed": (torch.from_numpy(ids)[None], torch.from_numpy(pos)[None],
                       torch.from_numpy(ends)),
        }
        res = {}
        c0 = dynamo_counts()
        with torch.no_grad():
            for kind, (i, p, e) in rows.items():
                blocks = tree_block_tensors(e, BLOCK)[:4]
                set_attn(model, TREE_ATTN)
                h_dense = dense_body(i, p, e, blocks)
                set_attn(model, "flex_attention")
                h_flex = flex_body(i, p, e, blocks)
                res[f"{kind}_flex_vs_dense_max_abs"] = (h_flex - h_dense).abs().max().item()
        set_attn(model, TREE_ATTN)
        res["dynamo"] = counts_delta(c0, dynamo_counts())
        out[label]["flex_forward"] = res
    return out


def print_dry_checks(checks: dict) -> None:
    """Per tree: each method's loss and worst gradient errors, FlexAttention's difference."""
    for label, e in checks.items():
        print(f"dry-run check {label}: " + ("FAILED" if label == "error" else str(
            {m: [v[k] for k in ("loss_rel_err", "max_rel_grad_err")] if "loss_rel_err" in v
             else v for m, v in e.items() if isinstance(v, dict)})))
