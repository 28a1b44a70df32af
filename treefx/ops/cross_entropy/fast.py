"""The tree loss fused with the output projection: each token predicted from its tree
predecessor ``parent_token[t]``. :func:`fused_linear_tree_cross_entropy` computes the loss in
chunks of tokens (the plain-torch forms are :mod:`.reference`):

``Σ_t w_t · (lse(h[p_t] W^T + b) − (h[p_t] W^T + b)[y_t])`` with ``p_t = parent_token[t]``:
token t is predicted from its tree predecessor's hidden state. The [N, V] logits are never
materialized: each chunk of tokens computes its logits, log-sum-exp and (when a gradient is
wanted) the gradients of h, W and b, and drops them, so peak memory is one chunk's [C, V] in
float32 on top of the hidden states. The loss is a final scalar, so its gradients are computed
in the forward pass and only scaled in the backward: no second pass over the logits.

A ``torch.library`` custom op with a registered backward: opaque to Inductor (which would
otherwise need the whole [N, V] tensor), traceable by AOTAutograd, any N.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_ELEMENTS", "fused_linear_tree_cross_entropy",
           "fused_linear_tree_loss_and_logprobs"]

# Logits per chunk: 128M floats (512 MiB in float32). One setting for the fused loss and the
# fused log-probabilities (:mod:`treefx.ops.logprobs.fast`), read at call time.
CHUNK_ELEMENTS = 1 << 27


def _chunk(n_vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(n_vocab, 1))


def _grad_chunk(n_vocab: int) -> int:
    """Tokens per chunk when the gradients are made: four times the loss-only chunk, so the
    weight's float32 gradient ([vocab, hidden], gigabytes at an 8B model's output layer) is
    read and written four times less often (with the loss-only chunk that traffic made the
    fused loss slower than the materialized path; BENCHMARKS.md, "Log-probs without logits").
    The chunk's logits and their gradient stay in the weights' dtype: two [C, vocab] tensors
    of ``4 · CHUNK_ELEMENTS`` elements."""
    return max(1, 4 * CHUNK_ELEMENTS // max(n_vocab, 1))


_MM_OUT_DTYPE = [True]  # torch.mm(..., out_dtype=) works here (CUDA, torch >= 2.8)
_ADDMM_OUT_DTYPE = [None]  # torch.addmm(..., out_dtype=, out=) accumulates right here


def _addmm_in_place_works(device: torch.device) -> bool:
    """Once per process, before the first use: whether ``torch.addmm(c, a, b, out_dtype=
    float32, out=c)`` with bf16 ``a``, ``b`` adds into ``c`` (a row slice of a larger tensor,
    as the gradients use it) what a separate product and sum give. A torch that rejects the
    call, or gets it wrong, takes the separate product."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(96, 64, device=device, generator=g).to(torch.bfloat16)
        b = torch.randn(64, 40, device=device, generator=g).to(torch.bfloat16)
        big = torch.randn(3, 96, 40, device=device, generator=g)
        want = big[1] + a.float() @ b.float()
        torch.addmm(big[1], a, b, out_dtype=torch.float32, out=big[1])
        return bool(torch.allclose(big[1], want, rtol=1e-3, atol=1e-3))
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def mm_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``acc``: on the GPU a bf16/fp16 product comes out of the matrix multiply in
    float32 (its sums are not rounded to the inputs' dtype first); elsewhere the product is
    rounded to the inputs' dtype, then widened."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and acc == torch.float32 \
            and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(a, b, out_dtype=acc)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[0] = False
    return (a @ b).to(acc)


def add_mm_acc(into: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``into += a @ b`` with ``into`` in float32 (or float64): on the GPU one matrix multiply
    that reads and writes ``into`` once (cuBLAS accumulates into it); elsewhere the product is
    made, then added (three passes over ``into``'s size)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and \
            into.dtype == torch.float32:
        if _ADDMM_OUT_DTYPE[0] is None:
            _ADDMM_OUT_DTYPE[0] = _addmm_in_place_works(a.device)
        if _ADDMM_OUT_DTYPE[0]:
            torch.addmm(into, a, b, out_dtype=torch.float32, out=into)
            return
    into += mm_acc(a, b, into.dtype)


def _acc(h: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.promote_types(h.dtype, torch.float32)


def _prepare(h, parent, ids, weights):
    valid = parent >= 0
    row = parent.clamp(min=0)
    w = torch.where(valid, weights.to(_acc(h)), torch.zeros_like(weights, dtype=_acc(h)))
    return h.reshape(-1, h.shape[-1]), row, ids.reshape(-1), w


def _loss_and_dlogits(logits, ids, w, acc: torch.dtype, want_grad: bool,
                      out: torch.dtype | None = None):
    """One chunk's weighted loss, its tokens' log-probabilities and (if wanted) d loss /
    d logits = w · (softmax − onehot), computed in ``acc`` and returned in ``out`` (default
    ``acc``)."""
    lg = logits.to(acc)
    lse = torch.logsumexp(lg, dim=-1)
    lp = lg.gather(1, ids[:, None])[:, 0] - lse
    loss = -(w * lp).sum()
    if not want_grad:
        return loss, lp, None
    d = torch.exp(lg - lse[:, None])
    d = d - torch.nn.functional.one_hot(ids, lg.shape[-1]).to(acc)
    return loss, lp, (d * w[:, None]).to(out or acc)


_GPU_COMPILED: dict = {}


def gpu_compiled(fn, cuda: bool):
    """``fn`` for a chunk of logits: on the GPU compiled once (dynamic in every length), so a
    chunk's pointwise math and reductions are one fused kernel that reads the chunk once
    instead of one pass per op; ``fn`` itself on the CPU. Shared by the fused loss and the
    fused log-probabilities (:mod:`treefx.ops.logprobs.fast`).

    Compiled with duck shaping off: a chunk's inputs are views whose sizes and storage
    offsets are often equal on the first chunk only (the labels' row of token ids starts at
    the label count, the weights' base is that long), and one symbol for the two would
    compile the function again for the second chunk."""
    if not cuda:
        return fn
    compiled = _GPU_COMPILED.get(fn)
    if compiled is None:
        import torch.fx.experimental._config as fx_config

        inner = torch.compile(fn, dynamic=True)

        def compiled(*args):
            with fx_config.patch(use_duck_shape=False):
                return inner(*args)

        _GPU_COMPILED[fn] = compiled
    return compiled


def _spans(n: int, step: int) -> list[tuple[int, int]]:
    """Chunks ``[s, e)`` of ``n`` rows, ``step`` each but the last, which is never one row
    alone where ``n`` > 1 (it joins the chunk before): the compiled chunk function
    (:func:`gpu_compiled`) would otherwise compile again for it, Dynamo specializing a size
    of 1."""
    bounds = [*range(0, n, step), n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:]))


def _lse_and_pick(logits, ids, acc: torch.dtype):
    """One chunk's log-sum-exp and its labels' logits, in ``acc``: on the GPU Triton's
    one-pass log-sum-exp (:func:`treefx.ops.logprobs.from_logits.lse_rows`, as the fused
    log-probabilities take it), no compiled graph."""
    from ..logprobs import from_logits

    if from_logits.available(logits) and acc == torch.float32:
        return from_logits.lse_rows(logits), logits.gather(1, ids[:, None])[:, 0].to(acc)
    lg = logits.to(acc)
    return torch.logsumexp(lg, dim=-1), lg.gather(1, ids[:, None])[:, 0]


def _chunks(h, weight, bias, ids, parent, weights, want_grad: bool, want_weight: bool = True):
    """One pass over chunks of tokens: the loss, each token's log-probability (0 without a
    predecessor; a by-product, not differentiated) and, if ``want_grad``, the loss's gradients
    for an upstream gradient of 1 (scaled in the backward). Computing them here, while each
    chunk's logits exist, saves recomputing the logits in the backward. ``want_weight=False``
    (a frozen projection, as under LoRA): the weight's and bias' gradients are empty, not
    computed."""
    h2, row, ids, w = _prepare(h, parent, ids, weights)
    n = ids.shape[0]
    acc = _acc(h)
    total = torch.zeros((), dtype=acc, device=h.device)
    lp = torch.zeros(n, dtype=acc, device=h.device)
    dh = dw = db = None
    if want_grad:
        dh = torch.zeros(h2.shape, dtype=acc, device=h.device)
        dw = torch.zeros(weight.shape if want_weight else (0,), dtype=acc, device=h.device)
        db = torch.zeros(weight.shape[0] if bias is not None and want_weight else 0, dtype=acc,
                         device=h.device)
    step = _grad_chunk(weight.shape[0]) if want_grad else _chunk(weight.shape[0])
    if want_grad:
        pointwise = gpu_compiled(_loss_and_dlogits, h.is_cuda)
    # the logits' gradient in the weights' dtype (the products take it so), or in acc for a
    # bias, whose gradient sums it
    d_dtype = acc if bias is not None and want_weight else weight.dtype
    for s, e in _spans(n, step):
        hc = h2[row[s:e]]
        logits = torch.nn.functional.linear(hc, weight, bias)
        if not want_grad:
            # the loss alone: a chunk's log-sum-exp and its labels' logits as the fused
            # log-probabilities read them (on the GPU Triton's, not a graph compiled for the
            # loss without gradients: a part recomputed at its backward compiles none)
            lse_c, picked = _lse_and_pick(logits, ids[s:e], acc)
            lp[s:e] = picked - lse_c
            total += -(w[s:e] * lp[s:e]).sum()
            continue
        loss_c, lp[s:e], d = pointwise(logits, ids[s:e], w[s:e], acc, want_grad, d_dtype)
        total += loss_c
        dc = d.to(weight.dtype)
        dh.index_add_(0, row[s:e], mm_acc(dc, weight, acc))
        if not want_weight:
            continue
        add_mm_acc(dw, dc.t(), hc)
        if bias is not None:
            db += d.sum(0)
    lp = torch.where(parent.reshape(-1) >= 0, lp, torch.zeros_like(lp))
    if not want_grad:
        return total, lp, None, None, None
    return (total, lp, dh.to(h.dtype).reshape(h.shape), dw.to(weight.dtype),
            db.to(weight.dtype))


@torch.library.custom_op("treefx::linear_tree_ce", mutates_args=())
def _linear_tree_ce(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    ids: torch.Tensor, parent: torch.Tensor, weights: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and the tokens' log-probabilities (no gradient wanted)."""
    return _chunks(h, weight, bias, ids, parent, weights, False)[:2]


@_linear_tree_ce.register_fake
def _(h, weight, bias, ids, parent, weights):
    return h.new_empty((), dtype=_acc(h)), h.new_empty(ids.numel(), dtype=_acc(h))


@torch.library.custom_op("treefx::linear_tree_ce_with_grad", mutates_args=())
def _linear_tree_ce_with_grad(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              ids: torch.Tensor, parent: torch.Tensor, weights: torch.Tensor,
                              want_weight: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor]:
    """(loss, the tokens' log-probabilities, d loss/d h, d loss/d weight, d loss/d bias (empty
    without a bias)); the last two empty without ``want_weight``."""
    loss, lp, dh, dw, db = _chunks(h, weight, bias, ids, parent, weights, True, want_weight)
    return loss, lp, dh, dw, db


@_linear_tree_ce_with_grad.register_fake
def _(h, weight, bias, ids, parent, weights, want_weight):
    return (h.new_empty((), dtype=_acc(h)), h.new_empty(ids.numel(), dtype=_acc(h)),
            torch.empty_like(h),
            torch.empty_like(weight) if want_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0] if bias is not None and want_weight else 0))


def _setup(ctx, inputs, output):
    ctx.has_bias = inputs[2] is not None
    ctx.want_weight = inputs[6]
    ctx.save_for_backward(*output[2:])


def _backward(ctx, grad_loss, _lp, _dh, _dw, _db):
    dh, dw, db = ctx.saved_tensors
    if not ctx.want_weight:
        return grad_loss.to(dh.dtype) * dh, None, None, None, None, None, None
    return (grad_loss.to(dh.dtype) * dh, grad_loss.to(dw.dtype) * dw,
            grad_loss.to(db.dtype) * db if ctx.has_bias else None, None, None, None, None)


_linear_tree_ce_with_grad.register_autograd(_backward, setup_context=_setup)


def fused_linear_tree_cross_entropy(h: torch.Tensor, weight: torch.Tensor,
                                    bias: torch.Tensor | None, input_ids: torch.Tensor,
                                    parent_token: torch.Tensor, weights: torch.Tensor
                                    ) -> torch.Tensor:
    """The weighted tree loss from hidden states [.., N, D] and the output projection
    ``weight`` [V, D] (``bias`` [V] or None), without materializing the logits. Gradients flow
    to ``h``, ``weight`` and ``bias`` (computed in the forward, chunk by chunk); ``weights``
    are constants (the tree's loss weights)."""
    return fused_linear_tree_loss_and_logprobs(h, weight, bias, input_ids, parent_token,
                                               weights)[0]


def fused_linear_tree_loss_and_logprobs(h: torch.Tensor, weight: torch.Tensor,
                                        bias: torch.Tensor | None, input_ids: torch.Tensor,
                                        parent_token: torch.Tensor, weights: torch.Tensor
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`fused_linear_tree_cross_entropy`'s loss, each token's log-probability [N]):
    the log-probabilities are a by-product of the loss's chunks (float32, 0 for a token
    without a predecessor), detached: the loss's gradients are made in the forward for the
    loss alone, so nothing may differentiate them (a loss built from them gets no gradient,
    not a wrong one)."""
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, weight, bias))
    if needs_grad:
        want_weight = weight.requires_grad or bias is not None and bias.requires_grad
        loss, lp = _linear_tree_ce_with_grad(h, weight, bias, input_ids, parent_token,
                                             weights.detach(), want_weight)[:2]
    else:
        loss, lp = _linear_tree_ce(h, weight, bias, input_ids, parent_token, weights.detach())
    return loss, lp.detach()
