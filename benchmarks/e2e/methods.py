"""The run's device, dtype and backends, the model it times, and the e2e methods. A method is
``make(env, model, parts, args)`` returning ``prepare(tree) -> step``; ``step()`` runs one timed
training step (layout, mask, forward, loss, backward) and returns the loss. ``parts`` holds what
methods share on one model (the compiled body, treefx models, masks)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

import treefx

from .. import common
from ..internals import tree_block_tensors
from ..real_trees import call_chains, packed_step, packing_batches

BLOCK = 128  # FlexAttention block size everywhere


class Env:
    """Device, dtype, backends; everything that differs between the GPU run and the dry run."""

    def __init__(self, args):
        self.dry = args.dry_run
        self.cuda = common.use_cuda(self.dry)
        self.dev = "cuda" if self.cuda else "cpu"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        # torch.compile backend of the baselines; treefx's backend.
        self.backend = "inductor" if self.cuda else "aot_eager"
        self.tree_backend = "inductor" if self.cuda else "eager"
        # Attention of the packed steps: FlexAttention + BlockMask on the GPU; SDPA with
        # the same mask as a dense 4-D bool tensor on the CPU (no FlexAttention backward there).
        self.mask_kind = "flex" if self.cuda else "dense"
        self.chunk = 128 if self.dry else 8192  # cross-entropy chunk (tokens)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def set_attn(model, impl: str) -> None:
    """Switch the HF model's attention implementation (the methods share one model)."""
    model.config._attn_implementation = impl


TREE_ATTN = "sdpa"  # the HF attention implementation treefx captures


# Real hybrid models' layer shapes (``--arch``; ``--hidden`` does not apply, ``--layers`` does):
# Qwen3-Next-80B-A3B's (its MoE of 512 experts, 10 per token and a shared one, as a dense MLP
# of the active width, 10 x 512 + 512) and Qwen3.5's (the 9B-class dense text model), each
# transformers' config defaults; the dry run's tiny ones.
_GDN = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4)
ARCH_SHAPES = {
    "qwen3_next": dict(_GDN, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=256, num_experts=0),
    "qwen3_5": dict(_GDN, hidden_size=4096, intermediate_size=12288, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=256),
}
_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
_ARCH_TINY = {"qwen3_next": dict(_TINY, num_experts=0), "qwen3_5": _TINY}
# The transformers model type of each --arch (the text model of Qwen3.5).
MODEL_TYPES = {"qwen3_5": "qwen3_5_text"}


def build_model(env: Env, hidden: int, args):
    """HF Qwen3 from a config, in training mode: ``--heads``, ``--kv-heads``, head_dim 128,
    intermediate 3 x hidden (a tiny one in the dry run); ``--arch qwen3_next`` / ``qwen3_5``:
    :data:`ARCH_SHAPES`, Gated DeltaNet : attention 3 : 1. Returns the model and its config."""
    if args.arch in ARCH_SHAPES:
        layers = 4 if env.dry else args.layers
        cfg = dict((_ARCH_TINY if env.dry else ARCH_SHAPES)[args.arch], vocab_size=args.vocab,
                   num_hidden_layers=layers,
                   layer_types=[("full_attention" if i % 4 == 3 else "linear_attention")
                                for i in range(layers)])
        if args.arch == "qwen3_next":
            cfg["mlp_only_layers"] = list(range(layers))
    elif env.dry:
        cfg = dict(vocab_size=args.vocab, hidden_size=64, intermediate_size=192,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16)
    else:
        cfg = dict(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                   num_key_value_heads=args.kv_heads, head_dim=128)
    model = common.hf_model(MODEL_TYPES.get(args.arch, args.arch), dev=env.dev,
                            dtype=env.dtype, seed=0, on_device=True, use_cache=False,
                            train=True, **cfg)
    return model, dict(cfg, arch=args.arch)


# ----------------------------------------------------------------------------- the packed body


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
    """The model body (no lm_head) on one row with an interval mask ``kv <= q < ends[kv]``,
    compiled: a FlexAttention BlockMask built inside the graph from block tensors (``"flex"``)
    or a [1, 1, N, N] bool tensor for SDPA (``"dense"``, the CPU dry run)."""
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


# ----------------------------------------------------------------------------- packed


class PackedData:
    """Per-sequence token arrays, weights and masks (made once per tree, outside the step)."""

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


def make_packed(env, model, parts, args=None):
    """packed: the tree's sequences end to end in one row, as sequence packing trains today: HF
    FlexAttention with a document-causal BlockMask (``kv <= q < doc_end[kv]``), positions
    restarting per document, the compiled body and its chunked weighted cross-entropy (made once
    per model, shared)."""
    if "body" not in parts:
        parts["body"] = make_body(env, model, env.mask_kind)
        parts["ce"] = ChunkedCE(env, model.lm_head.weight)
    body, ce = parts["body"], parts["ce"]

    def prepare(tree):
        data = PackedData(tree)

        def step():
            set_attn(model, "flex_attention" if env.mask_kind == "flex" else "sdpa")
            model.zero_grad(set_to_none=True)
            ids, pos, ends, src, w = data.layout()
            ids, pos, ends, src = (torch.from_numpy(x).to(env.dev) for x in (ids, pos, ends, src))
            w = torch.from_numpy(w).to(env.dev, torch.float32)
            blocks = tree_block_tensors(ends, BLOCK)[:4]  # per-block doc boundaries
            h = body(ids[None], pos[None], ends, blocks)
            loss = ce(h, src, ids, w)
            loss.backward()
            return loss.detach()
        return step

    return prepare


def make_packed_reset(env, model, parts, args=None):
    """packed_reset: sequence packing for models with state (hybrids): each sequence its own root
    in a treefx forest, the state reset at every sequence, the recurrence in one variable-length
    call (fla). ``--pack-budget N``: micro-batches of at most max(N, longest) tokens (first-fit
    decreasing, as :mod:`benchmarks.real_trees` packs), gradients accumulated."""
    tm = parts.get("treefx_model") or treefx.compile(model, backend=env.tree_backend)
    parts["treefx_model"] = tm
    budget = getattr(args, "pack_budget", 0) or 0

    def prepare(tree):
        if not budget:
            return tree_step(env, model, tm, call_chains(tree))
        # host-side packing done once, as a data loader does; the step's loss summed
        batches = [b.to(env.dev) for b in packing_batches(tree, budget)]

        def step():
            set_attn(model, TREE_ATTN)
            model.zero_grad(set_to_none=True)
            return packed_step(tm, batches, env.dev)

        step.micro_batches = [b.num_tokens for b in batches]
        return step

    return prepare


# ----------------------------------------------------------------------------- treefx


def make_tree(env, model, parts, args=None, key="treefx_model", **options):
    """treefx: ``treefx.pack(tree).to(dev)``, ``treefx.compile(model)`` (inductor),
    ``treefx.tree_loss``; ``treefx_nologits`` the same with ``logits=False``."""
    tm = treefx.compile(model, backend=env.tree_backend, **options)
    parts[key] = tm
    return lambda tree: tree_step(env, model, tm, tree)


def tree_step(env, model, tm, trees, loss_of=None):
    """One timed step of a TreeModel: layout, forward, loss (``loss_of(batch)``), backward."""
    def step():
        set_attn(model, TREE_ATTN)
        model.zero_grad(set_to_none=True)
        batch = treefx.pack(trees, reduction="mean").to(env.dev)
        loss = loss_of(batch) if loss_of else treefx.tree_loss(tm(batch), batch)
        loss.backward()
        return loss.detach()
    return step


def hf_train_step(model, batch):
    """An ordinary HF-style step (per-sequence mean CE of shifted labels), for @treefx.step."""
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    logits = out.logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(logits, batch["labels"][:, 1:].flatten())


def make_tree_step(env, model, parts, args=None):
    """treefx_step (opt-in): the same step as an ordinary HF training step under
    ``@treefx.step`` (the output projection fused with the tree cross-entropy in chunks)."""
    train_step = treefx.step(hf_train_step, backend=env.tree_backend)
    parts["treefx_step_fn"] = train_step
    return lambda tree: tree_step(env, model, None, tree, lambda b: train_step(model, b))


METHODS = ("treefx", "packed")
# opt-in with --methods; --arch qwen3_next / qwen3_5 run HYBRID_METHODS by default (plain
# packing would carry the state across sequences)
EXTRA_METHODS = ("treefx_step", "packed_reset", "treefx_nologits")
HYBRID_METHODS = ("treefx", "packed_reset")
MAKERS = {"treefx": make_tree, "treefx_step": make_tree_step, "packed": make_packed,
          "packed_reset": make_packed_reset,
          "treefx_nologits": partial(make_tree, key="treefx_nologits_model", logits=False)}
# the parts entry holding each treefx method's compiled object (its num_compilations)
TREEFX_OBJECTS = {"treefx": "treefx_model", "treefx_step": "treefx_step_fn",
                  "treefx_nologits": "treefx_nologits_model"}
