"""Per-token log-probabilities on the tree read from materialized logits, as the default
``treefx.compile(model)`` returns them beside the logits.

``lp_t = z_r[y_t] − lse(z_r)`` with ``r = parent_token[t]`` (0 where t has no predecessor).
A row r of logits is read by every token whose predecessor it is: one token inside a node,
each child's first token at a node's last row, none at a leaf's last row. Its gradient is
``Σ_{t: p_t = r} g_t · onehot(y_t) − G_r · softmax(z_r)`` with ``G_r = Σ_{t: p_t = r} g_t``.

On the GPU (:func:`tree_logprobs_from_logits`, Triton): the forward reads each row once for
its log-sum-exp (an online max and sum per lane, one pass), the backward writes the logits'
gradient in one pass, each row's children found through a table sorted by row (built on the
GPU: no host synchronization). Inductor's form of the plain code (:func:`tree_token_logprobs`)
took four passes over [N, V] on an 8B-shaped step at vocab 151,936: a two-pass log-sum-exp, a
zero-filled [N, V] buffer for the gathered labels' gradient, and a gradient kernel reading
both (BENCHMARKS.md).

Kept outside the compiled model's graph (``treefx.run.model``): a graph that returned the
logits *and* computed the log-probabilities from them got, for a loss on the log-probabilities
alone, a zero-filled [N, V] gradient for its unused logits output (AOTAutograd materializes
the missing gradient of an output), which its backward then read. Outside, autograd sums the
logits' gradients it gets: none from an unused output.

Elsewhere (the CPU, float64, without Triton) the plain form runs (:func:`tree_token_logprobs`).
"""

from __future__ import annotations

import torch

from ..cross_entropy.reference import tree_token_logprobs

__all__ = ["available", "lse_rows", "own_rows_gradient", "rows_gradient",
           "tree_logprobs_from_logits"]

try:  # Triton is optional: the CPU build of torch comes without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = tl = None

# (vocabulary entries per loop step or program, warps) of the log-sum-exp and gradient
# kernels, read at call time: the fastest of ``benchmarks.logprobs --tune-from-logits`` at
# the e2e benchmark's logits shape in bf16 (BENCHMARKS.md, "Log-probs without logits")
LSE_CONFIG = (2048, 4)
GRAD_CONFIG = (2048, 4)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(logits: torch.Tensor) -> bool:
    """Whether the Triton path takes these logits: on CUDA, bf16/fp16/fp32, Triton present."""
    return triton is not None and logits.is_cuda and logits.dtype in _DTYPES


if triton is not None:
    @triton.jit
    def _lse_kernel(logits, stride, n_vocab, lse, BLOCK: tl.constexpr):
        """One row's log-sum-exp in float32: a running max and sum per lane, one read."""
        r = tl.program_id(0).to(tl.int64)
        base = logits + r * stride
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for v0 in range(0, n_vocab, BLOCK):
            x = tl.load(base + v0 + cols, mask=v0 + cols < n_vocab,
                        other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane seen nothing yet
            s = s * tl.exp(m - shift) + tl.exp(x - shift)
            m = m_new
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # a row of -inf: lse = log(0) = -inf
        tl.store(lse + r, top + tl.log(tl.sum(s * tl.exp(m - top), 0)))

    @triton.jit
    def _grad_kernel(logits, stride, n_vocab, lse, child_start, child_end, child_tok, ids, g,
                     out, out_stride, BLOCK: tl.constexpr):
        """One [1, BLOCK] slice of row r's gradient: its children's one-hots minus their
        summed upstream gradient times the row's softmax, in float32, rounded once."""
        r = tl.program_id(0).to(tl.int64)
        v0 = tl.program_id(1) * BLOCK
        cols = v0 + tl.arange(0, BLOCK)
        inside = cols < n_vocab
        # the row's slice first: its load is in flight while the children are looked up
        x = tl.load(logits + r * stride + cols, mask=inside, other=0.0).to(tl.float32)
        p = tl.exp(x - tl.load(lse + r))
        hit = tl.zeros([BLOCK], tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        for j in range(tl.load(child_start + r), tl.load(child_end + r)):
            t = tl.load(child_tok + j)
            gt = tl.load(g + t).to(tl.float32)
            total += gt
            hit += tl.where(cols == tl.load(ids + t), gt, 0.0)
        d = hit - total * p
        tl.store(out + r * out_stride + cols, d.to(out.dtype.element_ty), mask=inside)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """The logits as [N, V] rows with unit stride along the vocabulary."""
    lg = logits.reshape(-1, logits.shape[-1])
    return lg if lg.stride(-1) == 1 else lg.contiguous()


def lse_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N] float32: each row's log-sum-exp (Triton; runs under Triton's interpreter on the
    CPU too)."""
    lg = _rows(logits)
    n, v = lg.shape
    lse = torch.empty(n, dtype=torch.float32, device=lg.device)
    if n:
        block, warps = LSE_CONFIG
        _lse_kernel[(n,)](lg, lg.stride(0), v, lse, BLOCK=block, num_warps=warps)
    return lse


def rows_gradient(logits: torch.Tensor, lse: torch.Tensor, input_ids: torch.Tensor,
                  parent_token: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the log-probabilities' ``grad`` [N] with respect to ``logits``
    [.., N, V], in the logits' dtype and shape (Triton). Tokens without a predecessor
    (``parent_token < 0``) contribute nothing."""
    lg = _rows(logits)
    n = lg.shape[0]
    parent = parent_token.reshape(-1)
    # Each row's children: the tokens sorted by the row they read (tokens without one sorted
    # past the last row, so no row's range holds them).
    key = torch.where(parent >= 0, parent, torch.full_like(parent, n))
    key, order = torch.sort(key, stable=True)
    rows = torch.arange(n, device=lg.device, dtype=key.dtype)
    start = torch.searchsorted(key, rows)
    end = torch.searchsorted(key, rows, right=True)
    return _gradient(lg, lse, start, end, order, input_ids.reshape(-1), grad).reshape(
        logits.shape)


def own_rows_gradient(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor,
                      grad: torch.Tensor) -> torch.Tensor:
    """[T, V] in the logits' dtype: ``grad[t] · (onehot(labels[t]) − softmax(logits[t]))``,
    each row read by one token of its own (as :mod:`.fast`'s backward rebuilds a slice of the
    vocabulary for its tokens); a label outside ``[0, V)`` puts no one-hot in the row (the
    slice does not hold it). Triton."""
    lg = _rows(logits)
    t = torch.arange(lg.shape[0], device=lg.device)
    return _gradient(lg, lse, t, t + 1, t, labels.reshape(-1), grad)


def _gradient(lg, lse, start, end, order, ids, grad) -> torch.Tensor:
    n, v = lg.shape
    out = torch.empty((n, v), dtype=lg.dtype, device=lg.device)
    if n:
        block, warps = GRAD_CONFIG
        _grad_kernel[(n, triton.cdiv(v, block))](
            lg, lg.stride(0), v, lse, start, end, order, ids,
            grad.reshape(-1).to(torch.float32).contiguous(), out, out.stride(0), BLOCK=block,
            num_warps=warps)
    return out


@torch.library.custom_op("treefx::tree_logprobs_from_logits", mutates_args=())
def _from_logits(logits: torch.Tensor, ids: torch.Tensor,
                 parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [N] float32, each row's log-sum-exp [N], kept for the backward)."""
    lse = lse_rows(logits)
    lg = _rows(logits)
    row = parent.clamp(min=0)
    picked = lg[row, ids.reshape(-1)].to(torch.float32) - lse[row]
    return torch.where(parent >= 0, picked, torch.zeros_like(picked)), lse


@_from_logits.register_fake
def _(logits, ids, parent):
    n = parent.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("treefx::tree_logprobs_from_logits_backward", mutates_args=())
def _from_logits_backward(grad: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                          ids: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    return rows_gradient(logits, lse, ids, parent, grad.to(torch.float32))


@_from_logits_backward.register_fake
def _(grad, logits, lse, ids, parent):
    return torch.empty_like(logits)


def _setup(ctx, inputs, output):
    logits, ids, parent = inputs
    ctx.save_for_backward(logits, ids, parent, output[1])


def _grad(ctx, grad_lp, _grad_lse):
    logits, ids, parent, lse = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None
    return _from_logits_backward(grad_lp, logits, lse, ids, parent), None, None


_from_logits.register_autograd(_grad, setup_context=_setup)


def tree_logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor,
                              parent_token: torch.Tensor) -> torch.Tensor:
    """[N]: ``log softmax(logits[parent_token[t]])[input_ids[t]]``, 0 where t has no
    predecessor; float32 (float64 for float64 logits), differentiable in ``logits`` [.., N, V].
    The Triton kernels where :func:`available`, else :func:`tree_token_logprobs`: the same
    values up to the order of float32 sums. A ``ValueError`` when ``input_ids`` or
    ``parent_token`` do not hold one entry per row of ``logits``."""
    rows = logits.numel() // max(logits.shape[-1], 1) if logits.dim() >= 2 else -1
    for name, t in (("input_ids", input_ids), ("parent_token", parent_token)):
        if t.numel() != rows:
            raise ValueError(f"tree_logprobs_from_logits: {name} has {t.numel()} entries but "
                             f"the logits {tuple(logits.shape)} have {max(rows, 0)} rows (one "
                             "per token of the row)")
    if not available(logits):
        return tree_token_logprobs(logits, input_ids, parent_token)
    return _from_logits(logits, input_ids.reshape(-1), parent_token.reshape(-1))[0]
