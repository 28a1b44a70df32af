"""End-to-end training-step benchmark: treefx against sequence packing, one-by-one and a
hand-written tree step, on synthetic agent trees (issue 5).

    PYTHONPATH=. python benchmarks/e2e.py --out e2e.json              # GPU, ~6-8 min on an H200
    PYTHONPATH=. python benchmarks/e2e.py --quick --out e2e.json      # hidden 1024 only, fewer reps
    PYTHONPATH=. python benchmarks/e2e.py --dry-run                   # CPU: tiny, float32, checks

One training step = layout (packing) + mask building + forward + loss + backward, timed with
CUDA events (median of --reps after --warmup steps on the same tree). Methods, all on the same
trees, the same model and the same loss (each sequence's mean token cross-entropy, averaged over
the sequences):

- treefx:  ``treefx.pack(tree).to(dev)``, ``treefx.compile(model, backend="inductor")``,
           ``treefx.tree_loss``.
- packed:  the tree's sequences end to end in one row; HF ``attn_implementation=
           "flex_attention"`` with a document-causal BlockMask passed as ``attention_mask``
           (mask_mod ``kv <= q < doc_end[kv]``, which is ``same doc & causal``; block tensors
           from per-block doc boundaries, O(N + blocks^2)); ``position_ids`` restart per
           document; model body under ``torch.compile`` (dynamic N); loss: chunked (8k tokens)
           weighted cross-entropy with weights 1/(len-1)/P on shifted labels, each chunk a
           compiled function.
- hand:    what a user writes without treefx: ``treefx.pack`` for the layout, compiled
           ``create_block_mask`` with the interval test ``kv <= q < subtree_end[kv]``, the same
           compiled flex model body with ``position_ids`` = tree positions, the same chunked
           cross-entropy gathered at ``parent_token`` with ``batch.loss_weights``.
- one_by_one: each sequence alone, HF SDPA (flash, is_causal), gradient accumulation; the
           model+loss compiled with ``dynamic=True`` (``--obo-compile none``: plain eager).
- treefx_step (opt-in, ``--methods ...,treefx_step``): the same step written as an ordinary HF
           training step under ``@treefx.step`` (the loss pass: fused linear + tree CE).

Also: BlockMask building for a 64k-token tree on the GPU, and a stream of 20 trees of
different sizes through the warmed-up treefx model (further compilations). A table is printed
last; JSON (written after every measurement) goes to --out.

``--dry-run`` runs the same code on the CPU with a tiny float32 model: eager/aot_eager
backends, SDPA with a dense 4-D mask instead of FlexAttention for the steps (FlexAttention has
no CPU backward), a FlexAttention forward check of the packed and tree BlockMasks against the
dense masks, and every method's loss and gradients against treefx.reference.sequence_loss.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import timed  # noqa: E402

import treefx  # noqa: E402
from treefx import synth  # noqa: E402
from treefx.layout import tree_block_mask  # noqa: E402
from treefx.ops.attention import tree_block_tensors  # noqa: E402

BLOCK = 128  # FlexAttention block size everywhere
T0 = time.perf_counter()

# ----------------------------------------------------------------------------- trees

# The synth default length ranges, multiplied per POR so that each tree has ~12-17k unique
# tokens at --scale 1 (the POR-0.75 tree is 17.2k / 68.8k tokens, like the issue's anchor).
_LENGTHS = dict(system_len=(150, 400), prompt_len=(30, 200), think_len=(40, 300),
                answer_len=(10, 80), tool_len=(20, 250))
_SHAPES = {  # POR: (shape, length multiplier)
    0.3: (dict(rollouts=1, turns=(2, 3)), 8.0),
    0.5: (dict(rollouts=1, turns=(3, 5)), 4.0),
    0.75: (dict(rollouts=4), 1.8),
    0.85: (dict(rollouts=8), 0.6),
}


def _scaled(mult: float) -> dict:
    return {k: (max(1, round(lo * mult)), max(1, round(hi * mult)))
            for k, (lo, hi) in _LENGTHS.items()}


def make_tree(por: float, scale: float, vocab: int, seed: int = 0) -> treefx.Tree:
    """A synth agent tree at POR ~ ``por`` (the nearest shape of _SHAPES)."""
    key = min(_SHAPES, key=lambda k: abs(k - por))
    shape, mult = _SHAPES[key]
    err = None
    for s in range(seed, seed + 4):  # another seed if a shape cannot reach the POR
        try:
            return synth.agent_tree(s, vocab_size=vocab, target_por=por, **shape,
                                    **_scaled(mult * scale))
        except ValueError as e:
            err = e
    raise err


def stream_trees(n: int, scale: float, vocab: int) -> list[treefx.Tree]:
    """``n`` trees of different shapes and sizes (~2k-20k tokens at scale 1)."""
    out = []
    for i in range(n):
        mult = (0.4 + 1.6 * ((i * 7) % n) / max(n - 1, 1)) * scale
        out.append(synth.agent_tree(500 + i, vocab_size=vocab, rollouts=1 + i % 4,
                                    **_scaled(mult)))
    return out


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


# ----------------------------------------------------------------------------- environment


class Env:
    """Device, dtype, backends; everything that differs between the GPU run and the dry run."""

    def __init__(self, args):
        self.dry = args.dry_run
        self.dev = "cuda" if torch.cuda.is_available() and not self.dry else "cpu"
        self.cuda = self.dev == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        # torch.compile backend of the baselines; treefx's backend.
        self.backend = "inductor" if self.cuda else args.cpu_backend
        self.tree_backend = "inductor" if self.cuda else "eager"
        # Attention of the packed / hand steps: FlexAttention + BlockMask on the GPU; SDPA with
        # the same mask as a dense 4-D bool tensor on the CPU (no FlexAttention backward there).
        self.mask_kind = "flex" if self.cuda else "dense"
        self.chunk = args.chunk if not self.dry else 128

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def set_attn(model, impl: str) -> None:
    if model.config._attn_implementation != impl:
        model.config._attn_implementation = impl


def build_model(env: Env, hidden: int, args):
    from transformers import AutoConfig, AutoModelForCausalLM

    if env.dry:
        cfg = dict(vocab_size=args.vocab, hidden_size=64, intermediate_size=192,
                   num_hidden_layers=2 if args.arch == "qwen3" else 4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)
    else:
        cfg = dict(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                   num_hidden_layers=args.layers, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128)
    if args.arch == "qwen3_next":
        # Gated DeltaNet + attention, 3 : 1 as in Qwen3-Next, with a dense MLP in every layer.
        layers = cfg["num_hidden_layers"]
        kdim = cfg["head_dim"]
        cfg.update(linear_num_key_heads=max(1, hidden // 128) if not env.dry else 2,
                   linear_num_value_heads=2 * (max(1, hidden // 128) if not env.dry else 2),
                   linear_key_head_dim=kdim, linear_value_head_dim=kdim,
                   linear_conv_kernel_dim=4, num_experts=0, mlp_only_layers=list(range(layers)),
                   layer_types=[("full_attention" if i % 4 == 3 else "linear_attention")
                                for i in range(layers)])
    config = AutoConfig.for_model(args.arch, **cfg)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(0)
    try:
        with torch.device(env.dev):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # a transformers version that does not take the device context
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(env.dev, env.dtype)
    model.train()
    return model, dict(cfg, arch=args.arch)


def _bump_dynamo_limits():
    cfg = torch._dynamo.config
    for name, val in (("recompile_limit", 64), ("cache_size_limit", 64),
                      ("accumulated_recompile_limit", 1024),
                      ("accumulated_cache_size_limit", 1024)):
        if hasattr(cfg, name):
            try:
                setattr(cfg, name, val)
            except Exception:
                pass


def dynamo_counts() -> dict:
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return {}
    return {
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "frames_ok": int(counters["frames"].get("ok", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def _delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in b}


# ----------------------------------------------------------------------------- shared pieces


def _ce_chunk(rows, weight, labels, w):
    """Σ w · CE(rows @ weight.T, labels), float32 log-sum-exp (fused upcast under Inductor)."""
    logits = F.linear(rows, weight).float()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, labels[:, None])[:, 0]
    return (w * (lse - picked)).sum()


class ChunkedCE:
    """Weighted cross-entropy of the logits at rows ``src`` against ``labels``, ``chunk`` rows at
    a time; each chunk one compiled call (dynamic in the chunk length: one compilation)."""

    def __init__(self, env: Env, weight: torch.Tensor):
        self.env = env
        self.weight = weight
        self.fn = torch.compile(_ce_chunk, backend=env.backend, fullgraph=True)

    def __call__(self, h, src, labels, w):
        n = labels.shape[0]
        starts = list(range(0, n, self.env.chunk))
        if len(starts) > 1 and n - starts[-1] < 2:
            starts.pop()  # no 1-row chunk: Dynamo would specialize on it and recompile
        total = None
        for s, e in zip(starts, starts[1:] + [n]):
            rows = h.index_select(0, src[s:e])
            lab, ww = labels[s:e], w[s:e]
            for t in (rows, lab, ww):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            part = self.fn(rows, self.weight, lab, ww)
            total = part if total is None else total + part
        return total


def make_body(env: Env, model, mask_kind: str):
    """The model body (no lm_head) on one row with an interval mask ``kv <= q < ends[kv]``
    (document-causal for packing, the tree mask for the tree layout), compiled.

    ``mask_kind="flex"``: a FlexAttention BlockMask from the given block tensors (built inside
    the compiled graph from tensors, so no per-step closure crosses the compile boundary);
    ``"dense"``: the same mask as a [1, 1, N, N] bool tensor for SDPA (CPU dry run)."""
    from torch.nn.attention.flex_attention import BlockMask

    inner = model.model

    def body(input_ids, position_ids, ends, kv_num, kv_idx, full_num, full_idx):
        n = input_ids.shape[1]
        torch._check(ends.shape[0] == n)  # one size symbol for the row, not two
        if mask_kind == "flex":
            nb = kv_num.shape[-1]
            ends_p = F.pad(ends, (0, nb * BLOCK - ends.shape[0]))  # padded keys: seen by none

            def mask_mod(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (q_idx < ends_p[kv_idx])

            mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                            BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                            seq_lengths=(n, n))
        else:
            i = torch.arange(n, device=ends.device)
            mask = ((i[None, :] <= i[:, None]) & (i[:, None] < ends[None, :]))[None, None]
        out = inner(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                    use_cache=False)
        return out.last_hidden_state[0]

    compiled = torch.compile(body, backend=env.backend)

    def call(input_ids, position_ids, ends, blocks):
        args = [input_ids, position_ids, ends, *blocks]
        for t, dims in zip(args, [(1,), (1,), (0,), (2,), (2, 3), (2,), (2, 3)]):
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        return compiled(*args)

    return call


def _interval_blocks(ends):
    """The hand-written mask: create_block_mask with the interval test, evaluated per element
    (compiled, so no N x N tensor is stored). Returns the kv block tensors."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = ends.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

    bm = create_block_mask(mask_mod, None, None, n, n, device=ends.device, BLOCK_SIZE=BLOCK)
    return bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices


class HandMask:
    def __init__(self, env: Env):
        self.fn = torch.compile(_interval_blocks, backend=env.backend)

    def __call__(self, ends):
        torch._dynamo.maybe_mark_dynamic(ends, 0)
        return self.fn(ends)


# ----------------------------------------------------------------------------- methods


class PackedData:
    """Per-sequence token arrays, weights and masks (the input a packing trainer starts from;
    made once per tree, outside the timed step)."""

    def __init__(self, tree: treefx.Tree):
        self.seqs = [np.asarray(s, dtype=np.int64) for s in tree.sequences]
        self.lens = np.array([len(s) for s in self.seqs], dtype=np.int64)
        # treefx's loss is the mean over the sequences: weight ω_p / P (see treefx.pack).
        self.weights = np.asarray(tree.weights, dtype=np.float64) / tree.num_sequences
        self.masks = None if tree.loss_masks is None else [np.asarray(tree.loss_mask(i))
                                                          for i in range(tree.num_sequences)]

    def layout(self):
        """ids, positions, doc ends, shift source rows, per-token weights (numpy)."""
        lens = self.lens
        n = int(lens.sum())
        starts = np.cumsum(lens) - lens
        ids = np.concatenate(self.seqs)
        pos = np.arange(n) - np.repeat(starts, lens)
        ends = np.repeat(starts + lens, lens)
        first = pos == 0
        src = np.arange(n) - 1
        src[first] = 0
        if self.masks is None:
            pred = lens - 1
            r = np.divide(1.0, pred, out=np.zeros(len(lens)), where=pred > 0)
            w = np.repeat(self.weights * r, lens)
        else:
            m = np.concatenate(self.masks).astype(np.float64)
            m[first] = 0.0
            cnt = np.add.reduceat(m, starts)
            r = np.divide(1.0, cnt, out=np.zeros(len(lens)), where=cnt > 0)
            w = m * np.repeat(self.weights * r, lens)
        w[first] = 0.0
        return ids, pos, ends, src, w


def method_treefx(env, model, parts, key="treefx_model", **options):
    tm = treefx.compile(model, backend=env.tree_backend, **options)
    parts[key] = tm

    return lambda tree: _tree_step(env, model, tm, tree)


def _tree_step(env, model, tm, trees):
    """One timed step of a compiled TreeModel: layout, forward, tree loss, backward."""
    def step():
        set_attn(model, "sdpa")
        model.zero_grad(set_to_none=True)
        batch = treefx.pack(trees, reduction="mean").to(env.dev)
        loss = treefx.tree_loss(tm(batch), batch)
        loss.backward()
        return loss.detach()
    return step


def _hf_train_step(model, batch):
    """An ordinary HF-style step (per-sequence mean CE of shifted labels), for @treefx.step."""
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    logits = out.logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(logits, batch["labels"][:, 1:].flatten())


def method_treefx_step(env, model, parts):
    """Opt-in: the same step through ``@treefx.step`` (loss pass: fused, chunked linear + tree
    cross-entropy; the logits are never built)."""
    train_step = treefx.step(_hf_train_step, backend=env.tree_backend)
    parts["treefx_step_fn"] = train_step

    def prepare(tree):
        def step():
            set_attn(model, "sdpa")
            model.zero_grad(set_to_none=True)
            batch = treefx.pack(tree, reduction="mean").to(env.dev)
            loss = train_step(model, batch)
            loss.backward()
            return loss.detach()
        return step

    return prepare


def _body_and_ce(env, model, parts):
    if "body" not in parts:
        parts["body"] = make_body(env, model, env.mask_kind)
        parts["ce"] = ChunkedCE(env, model.lm_head.weight)
    return parts["body"], parts["ce"]


def _attn_impl(env):
    return "flex_attention" if env.mask_kind == "flex" else "sdpa"


def method_packed(env, model, parts):
    body, ce = _body_and_ce(env, model, parts)

    def prepare(tree):
        data = PackedData(tree)

        def step():
            set_attn(model, _attn_impl(env))
            model.zero_grad(set_to_none=True)
            ids, pos, ends, src, w = data.layout()
            ids = torch.from_numpy(ids).to(env.dev)
            pos = torch.from_numpy(pos).to(env.dev)
            ends = torch.from_numpy(ends).to(env.dev)
            src = torch.from_numpy(src).to(env.dev)
            w = torch.from_numpy(w).to(env.dev, torch.float32)
            blocks = tree_block_tensors(ends, BLOCK)[:4]  # per-block doc boundaries
            h = body(ids[None], pos[None], ends, blocks)
            loss = ce(h, src, ids, w)
            loss.backward()
            return loss.detach()
        return step

    return prepare


def method_hand(env, model, parts):
    body, ce = _body_and_ce(env, model, parts)
    hand_mask = parts.setdefault("hand_mask", HandMask(env))

    def prepare(tree):
        def step():
            set_attn(model, _attn_impl(env))
            model.zero_grad(set_to_none=True)
            batch = treefx.pack(tree, reduction="mean").to(env.dev)
            ends = batch.subtree_end
            blocks = hand_mask(ends)
            h = body(batch.input_ids, batch.position_ids, ends, blocks)
            loss = ce(h, batch.parent_token.clamp(min=0), batch.input_ids[0],
                      batch.loss_weights.float())
            loss.backward()
            return loss.detach()
        return step

    return prepare


def _obo_loss(model, ids, w):
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, ids[0, 1:, None])[:, 0]
    return (w * (lse - picked)).sum()


def _inductor_split_count_parenthesized() -> bool:
    """Whether this torch's Inductor parenthesizes a mix-order reduction's split count when it
    slices the partial sums. torch 2.11 does not: with a sequence length L the split count
    prints as ``1 + floor(s/16)`` and the slice ``[0 : 1 + floor(s/16) * 1024]`` is one element
    ("shape '[344, 1024]' is invalid for input of size 1" in the one-by-one graph,
    ``benchmarks/results/e2e_h200_run1.json``). The baseline then compiles without that
    fusion. (treefx's graphs take the token count as one symbol and were not hit.)"""
    import inspect

    try:
        from torch._inductor.codegen import simd
        return '({nsplit}) * ({rnumel})' in inspect.getsource(simd)
    except Exception:
        return False


def method_one_by_one(env, model, parts, compile_mode: str):
    if compile_mode == "dynamic":
        options = None
        if env.backend == "inductor" and not _inductor_split_count_parenthesized():
            options = {"triton.mix_order_reduction": False}
        fn = torch.compile(_obo_loss, backend=env.backend, dynamic=True, options=options)
    else:
        fn = _obo_loss

    def prepare(tree):
        items = []
        for i in range(tree.num_sequences):
            s = np.asarray(tree.sequences[i], dtype=np.int64)
            if len(s) < 2:
                continue  # nothing to predict: adds 0 to the mean-reduction loss
            m = np.asarray(tree.loss_mask(i), dtype=np.float64)[1:]
            if m.sum() == 0:
                continue
            w = float(tree.weights[i]) / tree.num_sequences * m / m.sum()
            items.append((torch.from_numpy(s), torch.from_numpy(w).float()))

        def step():
            set_attn(model, "sdpa")
            model.zero_grad(set_to_none=True)
            total = None
            for s, w in items:
                loss = fn(model, s.to(env.dev)[None], w.to(env.dev))
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            return total
        return step

    return prepare


def method_packed_reset(env, model, parts):
    """Sequence packing for models with state (hybrids): each sequence its own root in a
    treefx forest, nothing shared. Attention is document-masked FlexAttention, the conv and
    the recurrent state start from zero at every sequence, and the recurrence runs all
    sequences in one variable-length call (fla) - what a packing trainer does for GDN layers."""
    tm = parts.get("treefx_model") or treefx.compile(model, backend=env.tree_backend)
    parts["treefx_model"] = tm

    def prepare(tree):
        masks = [None] * tree.num_sequences if tree.loss_masks is None else [
            [list(tree.loss_mask(i))] for i in range(tree.num_sequences)]
        forest = [treefx.Tree.from_sequences([s], weights=[w], loss_masks=m)
                  for s, w, m in zip(tree.sequences, tree.weights, masks)]
        return _tree_step(env, model, tm, forest)

    return prepare


METHODS = ("treefx", "packed", "hand", "one_by_one")
# opt-in with --methods; treefx_standard: treefx.compile(..., interleave_heads=False), the
# usual [heads, row] layout at the attention sites (treefx's default interleaves in training)
EXTRA_METHODS = ("treefx_step", "packed_reset", "treefx_standard")


# ----------------------------------------------------------------------------- timing


def measure(env, step, warmup: int, reps: int) -> dict:
    """First step (may compile), warm-up, then ``reps`` timed steps: CUDA events on the GPU,
    wall clock on the CPU. Peak memory over the timed steps."""
    c0 = dynamo_counts()
    t0 = time.perf_counter()
    loss = step()
    env.sync()
    first_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        step()
    env.sync()
    c1 = dynamo_counts()
    if env.cuda:
        torch.cuda.reset_peak_memory_stats()
    times, walls = [], []
    for _ in range(reps):
        w0 = time.perf_counter()
        loss, ms = timed(step, env.cuda)
        times.append(ms)
        walls.append((time.perf_counter() - w0) * 1e3)
    c2 = dynamo_counts()
    out = {
        "step_ms": statistics.median(times),
        "step_ms_all": times,
        "wall_ms": statistics.median(walls),
        "first_step_s": first_s,
        "loss": float(loss),
        "dynamo_warmup": _delta(c0, c1),
        "dynamo_timed": _delta(c1, c2),
        "timing": "cuda_events" if env.cuda else "cpu_wall_clock",
    }
    if env.cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


_KERNEL_KINDS = (  # (category, name fragments), first match wins
    ("attention", ("flex_attention", "triton_tem", "flash", "fmha", "cudnn", "attention")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "splitk")),
    # Before copy/fill: Inductor names a fused kernel after its ops, so RoPE or SiLU fused
    # with a dtype cast is "triton_poi_fused__to_copy_...". (Profiles before 2026-11-22's
    # fourth session counted those as copies.)
    ("triton pointwise/reduction", ("triton_poi", "triton_red", "triton_per")),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
)


def _kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, frags in _KERNEL_KINDS:
        if any(f in low for f in frags):
            return kind
    return "other"


def profile_step(env, step, steps: int = 2) -> dict:
    """GPU kernel time of ``steps`` steps by kind (torch.profiler), the busiest kernels, and
    how much of the steps' span the GPU was busy (the rest: waiting for the host)."""
    from torch.profiler import ProfilerActivity, profile

    env.sync()
    w0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        env.sync()
    wall_ms = (time.perf_counter() - w0) * 1e3
    by_name: dict[str, float] = {}
    spans = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        by_name[e.name] = by_name.get(e.name, 0.0) + us
        spans.append((e.time_range.start, e.time_range.end))
    kinds: dict[str, float] = {}
    for name, us in by_name.items():
        kinds[_kernel_kind(name)] = kinds.get(_kernel_kind(name), 0.0) + us
    busy = sum(by_name.values())
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    cpu = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CPU]
    return {
        "host_gaps": host_gaps(spans, cpu, steps),
        "steps": steps, "wall_ms_per_step": wall_ms / steps,
        "gpu_busy_ms_per_step": busy / 1e3 / steps,
        "gpu_span_ms_per_step": span / 1e3 / steps,
        "by_kind_ms_per_step": {k: v / 1e3 / steps for k, v in sorted(kinds.items(),
                                                                        key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": [(n[:160], us / 1e3 / steps) for n, us in top],
        "kernel_launches_per_step": sum(1 for _ in spans) / steps,
    }


def host_gaps(kernels, cpu, steps: int, min_us: float = 20.0) -> dict:
    """Where the GPU waits for the host: the gaps of at least ``min_us`` between kernels
    (``kernels``: (start, end) in µs), each CPU event's overlap with them (inclusive: a
    parent and its child both count), and the largest gaps with the innermost CPU event
    covering most of each."""
    if not kernels:
        return {}
    merged = []
    for s0, e0 in sorted(kernels):
        if merged and s0 <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e0)
        else:
            merged.append([s0, e0])
    gaps = [(a[1], b[0]) for a, b in zip(merged, merged[1:]) if b[0] - a[1] >= min_us]
    if not gaps or not cpu:
        return {"gaps": len(gaps), "gap_ms_per_step": sum(b - a for a, b in gaps) / 1e3 / steps}
    cs = np.array([c[0] for c in cpu], dtype=np.float64)
    ce = np.array([c[1] for c in cpu], dtype=np.float64)
    names = [c[2] for c in cpu]
    by_name: dict[str, float] = {}
    largest = []
    for g0, g1 in gaps:
        ov = np.clip(np.minimum(ce, g1) - np.maximum(cs, g0), 0, None)
        for i in np.flatnonzero(ov > 0):
            by_name[names[i]] = by_name.get(names[i], 0.0) + float(ov[i])
        cover = np.flatnonzero(ov >= 0.5 * (g1 - g0))
        inner = names[cover[np.argmin(ce[cover] - cs[cover])]] if cover.size else None
        largest.append((g1 - g0, inner))
    largest.sort(key=lambda x: -x[0])
    return {
        "gaps": len(gaps),
        "gap_ms_per_step": sum(b - a for a, b in gaps) / 1e3 / steps,
        "cpu_events_in_gaps_ms_per_step": [
            (n[:120], us / 1e3 / steps)
            for n, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:30]],
        "largest_gaps_us": [(round(us, 1), n and n[:120]) for us, n in largest[:15]],
    }


def _cleanup(env, model=None):
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if env.cuda:
        torch.cuda.empty_cache()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


# ----------------------------------------------------------------------------- mask building


def mask_build_bench(env, args, vocab) -> dict:
    """BlockMask for a 64k-token row of agent trees (POR-0.75 shape, the DFS row cut at
    --mask-tokens with subtree_end clipped), built on the device."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = args.mask_tokens
    trees, total = [], 0
    i = 0
    shape, mult = _SHAPES[0.75]
    while total < n:
        t = synth.agent_tree(900 + i, vocab_size=vocab, **shape, **_scaled(mult))
        trees.append(t)
        total += t.num_tokens
        i += 1
    se = treefx.pack(trees).subtree_end[:n].clamp(max=n).contiguous().to(env.dev)
    res = {"tokens": n, "trees": len(trees), "reps": args.mask_reps}

    def interval_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < se[kv_idx])

    tbt_compiled = torch.compile(tree_block_tensors, backend=env.backend, dynamic=False)
    tbm_compiled = torch.compile(tree_block_mask, backend=env.backend, dynamic=False)
    cbm_compiled = torch.compile(create_block_mask, backend=env.backend, dynamic=False)
    hand_mask = HandMask(env)

    def tensors_then_blockmask():
        from torch.nn.attention.flex_attention import BlockMask

        kv_num, kv_idx, full_num, full_idx, sep = tbt_compiled(se, BLOCK)
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                        mask_mod=treefx.layout.tree_mask_mod(sep),
                                        seq_lengths=(n, n))

    variants = {
        "tree_block_mask eager (batch.block_mask())": lambda: tree_block_mask(se, BLOCK),
        "tree_block_tensors compiled + BlockMask.from_kv_blocks": tensors_then_blockmask,
        "tree_block_mask compiled": lambda: tbm_compiled(se, BLOCK),
        "tree_block_tensors compiled (kv tensors only)": lambda: tbt_compiled(se, BLOCK),
        "create_block_mask interval test, compiled": lambda: cbm_compiled(
            interval_mask_mod, None, None, n, n, device=se.device, BLOCK_SIZE=BLOCK),
        "create_block_mask interval test, compiled, kv tensors only (as in the hand step)":
            lambda: hand_mask(se),
    }
    ref = tree_block_mask(se, BLOCK)
    for name, fn in variants.items():
        c0 = dynamo_counts()
        try:
            t0 = time.perf_counter()
            out = fn()
            env.sync()
            first = time.perf_counter() - t0
            for _ in range(5):
                fn()
            env.sync()
            times = []
            for _ in range(args.mask_reps):
                if env.cuda:
                    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
                    s.record()
                    fn()
                    e.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e))
                else:
                    w0 = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - w0) * 1e3)
            entry = {"ms_median": statistics.median(times), "ms_min": min(times),
                     "first_call_s": first}
            if hasattr(out, "kv_num_blocks"):  # same blocks as the eager reference?
                entry["blocks_match_reference"] = _same_blocks(out, ref)
            res[name] = entry
        except Exception:
            res[name] = {"error": traceback.format_exc()[-3000:]}
        if "error" not in res[name]:
            res[name]["dynamo"] = _delta(c0, dynamo_counts())
        print(f"  mask build: {name}: {_fmt_entry(res[name])}", flush=True)
    return res


def _dense_blocks(bm) -> torch.Tensor:
    nb = bm.kv_indices.shape[-1]
    d = torch.zeros(bm.kv_num_blocks.shape[-1], nb, dtype=torch.bool, device=bm.kv_indices.device)
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices),
                     (bm.full_kv_num_blocks, bm.full_kv_indices)):
        if num is None:
            continue
        num, idx = num[0, 0].long(), idx[0, 0].long()
        keep = torch.arange(idx.shape[-1], device=idx.device)[None, :] < num[:, None]
        rows = torch.arange(idx.shape[0], device=idx.device)[:, None].expand_as(idx)
        d[rows[keep], idx[keep]] = True
    return d


def _same_blocks(a, b) -> bool:
    """Same set of visited (partial or full) blocks (over the blocks both cover: treefx's
    tensors carry one spare, empty block after the row's, which lists and is listed by none)."""
    da, db = _dense_blocks(a), _dense_blocks(b)
    r, c = min(da.shape[0], db.shape[0]), min(da.shape[1], db.shape[1])
    rest = [d[r:].any() or d[:, c:].any() for d in (da, db)]
    return bool(torch.equal(da[:r, :c], db[:r, :c]) and not any(rest))


def _fmt_entry(e: dict) -> str:
    if "error" in e:
        return "FAILED: " + e["error"].strip().splitlines()[-1][:200]
    return f"{e['ms_median']:.3f} ms (first call {e['first_call_s']:.1f} s)"


# ----------------------------------------------------------------------------- dry-run checks


def dry_checks(env, model, trees, parts) -> dict:
    """CPU, float32: every method's loss and gradients against the per-branch oracle; the
    FlexAttention forward of the packed and tree BlockMasks against the dense masks."""
    from torch.nn.attention.flex_attention import BlockMask

    out = {}

    def grads():
        g = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return g

    for label, tree in trees.items():
        set_attn(model, "sdpa")
        model.zero_grad(set_to_none=True)
        ref = treefx.reference.sequence_loss(model, tree, reduction="mean")
        ref.backward()
        g_ref = grads()
        ref = ref.detach()
        entry = {"reference_loss": float(ref)}
        for name in parts["prepare"]:
            step = parts["prepare"][name](tree)
            loss = step()
            g = grads()
            rel = max(((g[n] - gr).norm() / gr.norm().clamp_min(1e-30)).item()
                      for n, gr in g_ref.items())
            entry[name] = {"loss": float(loss),
                           "loss_rel_err": abs(float(loss) - float(ref)) / abs(float(ref)),
                           "max_rel_grad_err": rel}
        out[label] = entry

    # FlexAttention forward (no backward on the CPU) through the same HF plumbing: the
    # BlockMask built in the compiled body from block tensors must give the dense-mask result.
    flex_body = make_body(env, model, "flex")
    dense_body = make_body(env, model, "dense")
    hand_mask = parts.get("hand_mask") or HandMask(env)
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
                set_attn(model, "sdpa")
                h_dense = dense_body(i, p, e, blocks)
                set_attn(model, "flex_attention")
                h_flex = flex_body(i, p, e, blocks)
                res[f"{kind}_flex_vs_dense_max_abs"] = (h_flex - h_dense).abs().max().item()
                if kind == "tree":
                    hb = hand_mask(e)
                    h_hand = flex_body(i, p, e, hb)
                    res["tree_hand_mask_flex_vs_dense_max_abs"] = (
                        (h_hand - h_dense).abs().max().item())
                    bm_hand = BlockMask.from_kv_blocks(*hb, BLOCK_SIZE=BLOCK)
                    res["hand_blocks_match_tree_block_mask"] = _same_blocks(
                        bm_hand, tree_block_mask(e, BLOCK))
        set_attn(model, "sdpa")
        res["dynamo"] = _delta(c0, dynamo_counts())
        out[label]["flex_forward"] = res
    return out


# ----------------------------------------------------------------------------- main


def _save(res, path):
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(tmp, path)


def run_hidden(env, args, hidden, trees, res, deadline, first_hidden) -> None:
    model, cfg = build_model(env, hidden, args)
    key = f"hidden{cfg['hidden_size']}"
    runs = res["runs"].setdefault(key, {})
    res["models"][key] = dict(cfg, layers=cfg["num_hidden_layers"],
                              params=sum(p.numel() for p in model.parameters()),
                              dtype=str(env.dtype))
    parts: dict = {}
    makers = {
        "treefx": lambda: method_treefx(env, model, parts),
        "packed": lambda: method_packed(env, model, parts),
        "hand": lambda: method_hand(env, model, parts),
        "one_by_one": lambda: method_one_by_one(env, model, parts, args.obo_compile),
        "treefx_step": lambda: method_treefx_step(env, model, parts),
        "treefx_standard": lambda: method_treefx(
            env, model, parts, key="treefx_standard_model", interleave_heads=False),
        "packed_reset": lambda: method_packed_reset(env, model, parts),
    }
    parts["prepare"] = {}
    for name in args.methods:
        parts["prepare"][name] = makers[name]()
    warmup, reps = args.warmup, args.reps
    for name in args.methods:
        broken = None
        for label, tree in trees.items():
            slot = runs.setdefault(label, {})
            if time.perf_counter() > deadline:
                slot[name] = {"skipped": "time budget (--budget) spent"}
                continue
            if broken:
                slot[name] = {"skipped": f"failed on an earlier tree ({broken})"}
                continue
            try:
                step = parts["prepare"][name](tree)
                r = measure(env, step, warmup, reps)
                if args.profile and env.cuda:
                    r["profile"] = profile_step(env, step)
                    hg = r["profile"]["host_gaps"]
                    print(f"  GPU idle {hg.get('gap_ms_per_step', 0):.1f} ms/step in "
                          f"{hg.get('gaps', 0)} gaps; largest: {hg.get('largest_gaps_us', [])[:6]}",
                          flush=True)
                if name in ("treefx", "treefx_step", "treefx_standard"):
                    tm = parts["treefx_step_fn" if name == "treefx_step" else f"{name}_model"]
                    r["treefx_compilations_total"] = tm.num_compilations
                slot[name] = r
                msg = (f"{r['step_ms']:.1f} ms, first step {r['first_step_s']:.1f} s"
                       + (f", peak {r['peak_gib']:.1f} GiB" if "peak_gib" in r else ""))
            except Exception as e:
                slot[name] = {"error": traceback.format_exc()[-4000:]}
                msg = "FAILED: " + (str(e).strip().splitlines() or [""])[0][:200]
                if not _is_oom(e):
                    broken = label
            _cleanup(env, model)
            print(f"[{time.perf_counter() - T0:5.0f}s] [{key}] {name:10s} {label}: {msg}",
                  flush=True)
            _save(res, args.out)
        if name == "treefx" and first_hidden and args.stream and "treefx_model" in parts:
            if time.perf_counter() > deadline:
                res["stream"] = {"skipped": "time budget spent"}
            else:
                res["stream"] = stream_check(env, args, model, parts)
            _save(res, args.out)
    if env.dry and args.arch == "qwen3":
        try:
            res["dry_run_checks"] = dry_checks(env, model, trees, parts)
        except Exception:
            res["dry_run_checks"] = {"error": traceback.format_exc()[-4000:]}
        _save(res, args.out)
    del parts, model
    _cleanup(env)
    try:
        torch._dynamo.reset()
    except Exception:
        pass


def stream_check(env, args, model, parts) -> dict:
    """After warm-up: a stream of trees of different sizes through the compiled treefx model
    (forward + backward); how many more compilations they trigger."""
    tm = parts["treefx_model"]
    trees = stream_trees(args.stream, args.scale * (0.03 if env.dry else 1.0), args.vocab)
    c0, n0 = dynamo_counts(), tm.num_compilations
    sizes, ms = [], []
    try:
        for t in trees:
            set_attn(model, "sdpa")
            model.zero_grad(set_to_none=True)
            w0 = time.perf_counter()
            batch = treefx.pack(t, reduction="mean").to(env.dev)
            treefx.tree_loss(tm(batch), batch).backward()
            env.sync()
            ms.append((time.perf_counter() - w0) * 1e3)
            sizes.append(batch.num_tokens)
        out = {"trees": len(trees), "sizes": sizes, "step_wall_ms": ms,
               "further_compilations": tm.num_compilations - n0,
               "dynamo": _delta(c0, dynamo_counts())}
    except Exception:
        out = {"error": traceback.format_exc()[-4000:], "sizes": sizes}
    _cleanup(env, model)
    print(f"stream of {len(trees)} trees ({min(sizes, default=0)}-{max(sizes, default=0)} "
          f"tokens): further compilations "
          f"{out.get('further_compilations', 'FAILED')}", flush=True)
    return out


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
                print(f"  {k:82s} {_fmt_entry(v)}")
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


def print_dry_checks(checks: dict) -> None:
    print("dry-run checks, float32 CPU: loss rel. error / max rel. gradient error vs "
          "treefx.reference.sequence_loss(mean); FlexAttention forward (BlockMask built in the "
          "compiled body) vs the dense mask, max abs error of the hidden states")
    if "error" in checks:
        print("  FAILED: " + checks["error"].strip().splitlines()[-1][:300])
        return
    for label, e in checks.items():
        parts = [f"{m} {v['loss_rel_err']:.1e}/{v['max_rel_grad_err']:.1e}"
                 for m, v in e.items() if isinstance(v, dict) and "loss_rel_err" in v]
        fl = e.get("flex_forward", {})
        flex = ", ".join(f"{k.replace('_vs_dense_max_abs', '')} {v:.1e}" if isinstance(v, float)
                         else f"{k} {v}" for k, v in fl.items() if k != "dynamo")
        print(f"  {label}: " + "; ".join(parts) + f" | flex fwd: {flex}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="e2e.json")
    p.add_argument("--hidden", default="1024,2048", help="comma-separated hidden sizes")
    p.add_argument("--por", default="0.3,0.5,0.75,0.85", help="target POR of each tree")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies all token lengths (tree size ~ proportional)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"subset of {METHODS}, plus opt-in {EXTRA_METHODS}")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--arch", choices=("qwen3", "qwen3_next"), default="qwen3",
                   help="qwen3 (attention) or qwen3_next (Gated DeltaNet + attention, 3:1; "
                        "compare treefx with packed_reset)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunk", type=int, default=8192, help="cross-entropy chunk (tokens)")
    p.add_argument("--obo-compile", choices=("dynamic", "none"), default="dynamic",
                   help="one-by-one: torch.compile(dynamic=True) of model+loss, or eager")
    p.add_argument("--mask-tokens", type=int, default=65536)
    p.add_argument("--mask-reps", type=int, default=50)
    p.add_argument("--stream", type=int, default=20, help="trees in the recompilation check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="also profile each measured step: GPU time by kernel kind")
    p.add_argument("--budget", type=float, default=480.0,
                   help="seconds; measurements not started by then are skipped (recorded)")
    p.add_argument("--quick", action="store_true",
                   help="hidden 1024 only, 1 warm-up + 3 reps, 20 mask reps")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny float32 model and trees, eager backends, exactness checks")
    p.add_argument("--cpu-backend", default="aot_eager",
                   help="torch.compile backend for the baselines in --dry-run")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    for m in args.methods:
        if m not in METHODS + EXTRA_METHODS:
            p.error(f"unknown method {m!r}; choose from {METHODS + EXTRA_METHODS}")
    hiddens = [int(h) for h in args.hidden.split(",") if h]
    if args.quick:
        hiddens = hiddens[:1]
        args.warmup, args.reps, args.mask_reps = 1, 3, 20
    if args.dry_run:
        hiddens = hiddens[:1]
        args.warmup, args.reps, args.mask_reps = 1, 2, 5
        args.vocab = 256
        args.mask_tokens = min(args.mask_tokens, 2048)
    if not torch.cuda.is_available() and not args.dry_run:
        p.error("no CUDA device: use --dry-run on the CPU")

    global T0
    t_start = T0 = time.perf_counter()
    deadline = t_start + args.budget
    env = Env(args)
    _bump_dynamo_limits()
    if env.cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    import transformers

    try:
        import triton
    except ImportError:
        triton = None
    res = {
        "meta": {
            "device": torch.cuda.get_device_name() if env.cuda else f"cpu ({platform.processor()})",
            "cuda": env.cuda, "torch": torch.__version__,
            "triton": getattr(triton, "__version__", None),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        },
        "config": {k: v for k, v in vars(args).items()},
        "conventions": {
            "step": "pack/layout + mask building + forward + loss + backward (zero_grad "
                    "set_to_none at the start); no optimizer step",
            "tokens_per_s": "baseline tokens (sum of sequence lengths) / step time, for "
                            "every method",
            "bound": "N_baseline / N_tree; share_of_bound = speedup_vs_packed / bound",
            "peak_gib": "torch.cuda.max_memory_allocated over the timed steps (reset before)",
            "graphs": "Dynamo unique graphs compiled during warm-up + timed steps of that "
                      "tree/method (recompiles_timed: during timed steps only)",
            "one_by_one": f"HF sdpa (flash), torch.compile dynamic=True"
                          if args.obo_compile == "dynamic" else "HF sdpa, eager (no compile)",
            "packed_mask": "flex BlockMask from per-block doc ends (tree_block_tensors on "
                           "doc_end), mask_mod kv <= q < doc_end[kv]",
            "hand_mask": "compiled create_block_mask, mask_mod kv <= q < subtree_end[kv]",
            "loss": f"chunked weighted cross-entropy, {env.chunk}-token chunks, each a "
                    "compiled call (packed, hand); treefx.tree_loss (treefx); per-sequence "
                    "mean CE (one_by_one)",
        },
        "trees": {}, "models": {}, "runs": {},
    }
    print(f"device: {res['meta']['device']}; torch {torch.__version__}; transformers "
          f"{transformers.__version__}; backend {env.backend}; dtype {env.dtype}", flush=True)

    scale = args.scale * (0.03 if args.dry_run else 1.0)
    trees = {}
    t0 = time.perf_counter()
    for por in [float(x) for x in args.por.split(",") if x]:
        label = f"por{por:g}"
        try:
            trees[label] = make_tree(por, scale, args.vocab, args.seed)
            res["trees"][label] = tree_info(trees[label])
        except Exception:
            res["trees"][label] = {"error": traceback.format_exc()[-2000:]}
        print(f"tree {label}: {res['trees'][label]}", flush=True)
    trees = {k: v for k, v in trees.items()}
    print(f"trees made in {time.perf_counter() - t0:.1f} s", flush=True)
    _save(res, args.out)

    try:
        if args.mask_reps > 0:
            res["mask_build"] = mask_build_bench(env, args, args.vocab)
    except Exception:
        res["mask_build"] = {"error": traceback.format_exc()[-3000:]}
    _save(res, args.out)

    for i, hidden in enumerate(hiddens):
        try:
            run_hidden(env, args, hidden, trees, res, deadline, i == 0)
        except Exception:
            res.setdefault("errors", {})[f"hidden{hidden}"] = traceback.format_exc()[-4000:]
            print(f"hidden {hidden}: FAILED\n{traceback.format_exc()[-2000:]}", flush=True)
        _save(res, args.out)

    res["summary"] = summarize(res)
    res["targets"] = targets(res)
    res["total_s"] = time.perf_counter() - t_start
    _save(res, args.out)
    if env.dry and "dry_run_checks" in res:
        print_dry_checks(res["dry_run_checks"])
    print_table(res, res["summary"])
    print(f"total {res['total_s']:.0f} s; JSON: {args.out}")
    return res


if __name__ == "__main__":
    main()
