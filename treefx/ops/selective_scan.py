"""Mamba's selective scan (Mamba v1, ``selective_scan_fn`` of mamba_ssm) with an initial state.

Hugging Face's Mamba-family models (``mamba``, ``falcon_mamba``, ``jamba``, ``zamba``) call a
torch fallback of the selective scan that starts from a zero state and has no parameter for
another one. A tree node's scan must start from its parent node's final state, so treefx runs
this function in its place over the tree (:class:`~treefx.ops.recurrence.Recurrence`'s
``tree_fn``). Same parameter names and shapes as Hugging Face's ``mamba_selective_scan``::

    hidden_states x, dt, z: [B, D, L]     A: [D, N]     B, C: [B, N, L]     D, delta_bias: [D]

    dt_t = softplus(dt_t + delta_bias)    (each only when asked for)
    h_t  = exp(A dt_t) * h_(t-1) + dt_t B_t x_t          h_(-1) = initial_state (or 0)
    y_t  = C_t . h_t  (+ D x_t)  (* silu(z_t))

The state is a [B, D, N] tensor, accumulated in float32 at least (as Hugging Face's fallback
and mamba_ssm's kernel do for half-precision inputs; float64 stays float64); the output has
the input's dtype, widened by ``D`` and ``z`` as Hugging Face's kernel promotes it.

The linear recurrence runs as a log-step (Hillis-Steele) scan: ceil(log2 L) whole-tensor steps,
not L Python iterations. Its backward is the same scan run backwards (the gradient of a linear
recurrence is a linear recurrence), written out by hand: autograd keeps the scan's [B, D, L]
and [B, N, L] inputs only, and the backward recomputes the [B, D, L, N] decays and states
(N times the inputs' size, per layer) rather than holding them from the forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["selective_scan"]


def _scan_inplace(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """Inclusive scan of h_t = a_t h_(t-1) + b_t from h_(-1) = 0 along ``dim``; overwrites
    its (owned) arguments, returns h."""
    n = a.shape[dim]
    step = 1
    while step < n:
        head_a, tail_a = a.narrow(dim, 0, n - step), a.narrow(dim, step, n - step)
        head_b, tail_b = b.narrow(dim, 0, n - step), b.narrow(dim, step, n - step)
        # The right-hand sides read the values of the previous step: clone what is read.
        tail_b.addcmul_(tail_a, head_b.clone())
        if step * 2 < n:  # the last step needs no decay products
            tail_a.mul_(head_a.clone())
        step *= 2
    return b


def _states(x, dt, A, B, initial_state):
    """(decays exp(A dt), all states h) as [B, D, L, N] tensors (L > 0)."""
    decay = torch.exp(A[None, :, None, :] * dt[..., None])
    inputs = (dt * x)[..., None] * B.transpose(1, 2)[:, None]
    if initial_state is not None:
        inputs[:, :, 0] += decay[:, :, 0] * initial_state
    return decay, _scan_inplace(decay.clone(), inputs, 2)


class _SelectiveScan(torch.autograd.Function):
    """y_t = C_t . h_t and the last state, from x, dt (after bias and softplus), A, B, C and
    an initial state (or None). Saves its inputs only ([B, D, L] and [B, N, L] tensors, not
    the [B, D, L, N] states) and recomputes the states in the backward."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, initial_state):
        _, h = _states(x, dt, A, B, initial_state)
        ctx.save_for_backward(x, dt, A, B, C, initial_state)
        return torch.einsum("bdln,bnl->bdl", h, C), h[:, :, -1].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_last):
        x, dt, A, B, C, h0 = ctx.saved_tensors
        decay, h = _states(x, dt, A, B, h0)
        n = x.shape[2]
        grad_C = torch.einsum("bdl,bdln->bnl", grad_y, h)
        # G_t = dL/dh_t in total: G_t = g_t + a_(t+1) G_(t+1), a scan from the end.
        g = grad_y[..., None] * C.transpose(1, 2)[:, None]
        g[:, :, -1] += grad_last
        a_next = torch.cat([decay[:, :, 1:], torch.zeros_like(decay[:, :, :1])], 2).flip(2)
        G = _scan_inplace(a_next, g.flip(2), 2).flip(2)
        # h_t = a_t h_(t-1) + dt_t x_t B_t with a_t = exp(A dt_t).
        h_prev = torch.cat([h0[:, :, None] if h0 is not None else torch.zeros_like(h[:, :, :1]),
                            h[:, :, :n - 1]], 2)
        grad_log_decay = G * h_prev * decay  # dL/d(A dt)
        grad_A = torch.einsum("bdln,bdl->dn", grad_log_decay, dt)
        g_b = torch.einsum("bdln,bnl->bdl", G, B)  # dL/d(dt x) = G . B
        grad_dt = torch.einsum("bdln,dn->bdl", grad_log_decay, A) + g_b * x
        grad_B = torch.einsum("bdln,bdl->bnl", G, dt * x)
        grad_h0 = decay[:, :, 0] * G[:, :, 0] if h0 is not None else None
        return g_b * dt, grad_dt, grad_A, grad_B, grad_C, grad_h0


def selective_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                   z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
                   delta_softplus: bool = False, return_last_state: bool = False,
                   initial_state: torch.Tensor | None = None, use_mambapy: bool = False,
                   use_associative_scan: bool = False, **kwargs):
    """Mamba's selective scan from ``initial_state`` ([B, D, N], or zeros): ``output`` or
    ``(output, last_state)`` with ``return_last_state`` (see the module's docstring).
    ``use_mambapy`` / ``use_associative_scan`` pick among Hugging Face's torch algorithms and
    are accepted for its signature's sake (one algorithm here); other keywords (packed
    sequences' ``seq_idx``, ...) are refused unless None."""
    given = sorted(k for k, v in kwargs.items() if v is not None)
    if given:
        raise ValueError(f"selective_scan: unsupported arguments {given}")
    dtype = hidden_states.dtype
    acc = torch.promote_types(dtype, torch.float32)  # float32, or float64 for float64 inputs
    batch, width, length = hidden_states.shape
    x = hidden_states.to(acc)
    dt = dt.to(acc)
    if delta_bias is not None:
        dt = dt + delta_bias.to(acc)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    init = None if initial_state is None else initial_state.to(acc)
    if length > 0:
        y, last = _SelectiveScan.apply(x, dt, A.to(acc), B.to(acc), C.to(acc), init)
    else:
        y = x.new_zeros(batch, width, 0)
        last = init if init is not None else x.new_zeros(batch, width, A.shape[-1])
    if D is not None:
        y = y + x * D.to(acc)[..., None]
    if z is not None:
        y = y * F.silu(z.to(acc))
    # The output's dtype as Hugging Face's kernel promotes it: the input's, widened by D and
    # z (its Mamba mixers pass D in float32, so bfloat16 inputs give a float32 output).
    for t in (D, z):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    out = y.to(dtype)
    return (out, last) if return_last_state else out
