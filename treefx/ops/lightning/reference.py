"""Lightning attention (MiniMax) token by token: ``S_t = exp(g_t) · S_{t-1} + k_tᵀ v_t``,
``o_t = q_t · S_t``, the reference of the chunked form (:mod:`.fast`)."""

from __future__ import annotations

import torch

__all__ = ["lightning_attention_reference"]


def lightning_attention_reference(query, key, value, g, initial_state=None):
    """The recurrence token by token (for tests)."""
    b, n, h, dk = query.shape
    state = (torch.zeros(b, h, dk, value.shape[-1], dtype=query.dtype)
             if initial_state is None else initial_state.clone())
    outs = []
    for t in range(n):
        state = state * g[:, t].exp()[..., None, None] + key[:, t, :, :, None] * value[:, t, :, None, :]
        outs.append((query[:, t, :, None, :] @ state)[:, :, 0])
    return torch.stack(outs, dim=1), state
