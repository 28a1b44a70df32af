"""one_by_one: each sequence alone through the HF model, SDPA (flash, is_causal), float32
cross-entropy over its full logits, gradients accumulated over the sequences; the model and
loss compiled with ``dynamic=True`` (``--obo-compile none``: plain eager)."""

from __future__ import annotations

import numpy as np
import torch

from ..env import set_attn, tree_attn_impl


def _obo_loss(model, ids, w):
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, ids[0, 1:, None])[:, 0]
    return (w * (lse - picked)).sum()


def inductor_split_count_parenthesized() -> bool:
    """Whether this torch's Inductor parenthesizes a mix-order reduction's split count when it
    slices the partial sums. torch 2.11 does not: with a sequence length L the split count
    prints as ``1 + floor(s/16)`` and the slice ``[0 : 1 + floor(s/16) * 1024]`` is one element
    ("shape '[344, 1024]' is invalid for input of size 1" in the one-by-one graph). The
    baseline then compiles without that fusion. (treefx's graphs take the token count as one
    symbol and are not hit.)"""
    import inspect

    try:
        from torch._inductor.codegen import simd
        return '({nsplit}) * ({rnumel})' in inspect.getsource(simd)
    except Exception:
        return False


def make(env, model, parts, args):
    if args.obo_compile == "dynamic":
        options = None
        if env.backend == "inductor" and not inductor_split_count_parenthesized():
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
            set_attn(model, tree_attn_impl(model))
            model.zero_grad(set_to_none=True)
            total = None
            for s, w in items:
                loss = fn(model, s.to(env.dev)[None], w.to(env.dev))
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            return total
        return step

    return prepare
