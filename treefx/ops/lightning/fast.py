"""Lightning attention (MiniMax): linear attention with a decay per token and head, without a
normaliser ("simple gated linear attention").

    S_t = exp(g_t) · S_{t-1} + k_tᵀ v_t,      o_t = q_t · S_t

over ``query``/``key`` [B, N, H, Dk], ``value`` [B, N, H, Dv] and the log decay ``g`` [B, N, H]
(≤ 0; 0 keeps the state), from ``initial_state`` [B, H, Dk, Dv] (zeros by default). MiniMax
computes it in blocks of 256 tokens with a fixed decay per head; this is the same recurrence in
chunks, with an initial state, so that each tree node can start from its parent node's state
(:mod:`treefx.families.minimax` registers it as a recurrence). Padding with ``g = 0`` and zero keys and
values leaves the state unchanged.

This is the chunked form (what runs); :mod:`.reference` is the recurrence token by token.
"""

from __future__ import annotations

import torch

__all__ = ["lightning_attention"]


def lightning_attention(query, key, value, g, initial_state=None, output_final_state=False,
                        chunk_size: int = 64):
    """The recurrence above in chunks: within a chunk, with G the cumulative log decay,
    ``o_i = exp(G_i) q_i S_0 + Σ_{j≤i} exp(G_i − G_j) (q_i·k_j) v_j`` and
    ``S = exp(G_L) S_0 + Σ_j exp(G_L − G_j) k_jᵀ v_j``. Returns ``(output [B, N, H, Dv],
    final_state or None)``; the products in the inputs' dtype, the decays (a cumulative sum
    and its exponentials) in float32 at least, as MiniMax builds its decay tables."""
    b, n, h, dk = query.shape
    dv = value.shape[-1]
    dtype = query.dtype
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, H, N, D]
    wide = torch.promote_types(dtype, torch.float32)
    gl = g.transpose(1, 2).to(wide)  # [B, H, N]
    state = (torch.zeros(b, h, dk, dv, dtype=dtype, device=query.device)
             if initial_state is None else initial_state.to(dtype))
    outs = []
    causal = None
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        qc, kc, vc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]
        cum = gl[:, :, s:e].cumsum(-1)  # G_i
        if causal is None or causal.shape[0] != e - s:
            causal = torch.ones(e - s, e - s, dtype=torch.bool, device=query.device).tril()
        diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))
        intra = ((qc @ kc.transpose(-1, -2)) * diff.exp().to(dtype)) @ vc
        inter = (qc * cum.exp().to(dtype)[..., None]) @ state
        outs.append(intra + inter)
        last = cum[..., -1:]  # G_L
        state = state * last.exp().to(dtype)[..., None] + (
            kc * (last - cum).exp().to(dtype)[..., None]).transpose(-1, -2) @ vc
    out = torch.cat(outs, dim=2).transpose(1, 2) if outs else value.new_zeros(b, 0, h, dv)
    return out, (state if output_final_state else None)
