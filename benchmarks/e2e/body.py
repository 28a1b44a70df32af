"""The packed step's model body on one row under an interval mask, and its chunked weighted
cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .env import BLOCK, Env


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


def body_and_ce(env: Env, model, parts: dict):
    """The compiled body and chunked loss, made once per model and shared by the methods."""
    if "body" not in parts:
        parts["body"] = make_body(env, model, env.mask_kind)
        parts["ce"] = ChunkedCE(env, model.lm_head.weight)
    return parts["body"], parts["ce"]
