"""A small pure-torch hybrid decoder: Gated DeltaNet layers interleaved with attention.

Each Gated DeltaNet layer has what makes hybrids hard on a DFS-packed tree: a causal
depthwise conv1d over the tokens and a recurrent state. Its recurrence is a plain token loop
(:func:`gated_delta_rule`), registered with treefx so the SSM pass sees it as one node.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compiler.recurrences import Recurrence, register_recurrence
from .dense import MLP, Block, Decoder, DecoderConfig, RMSNorm

__all__ = ["GatedDeltaNet", "HybridDecoder", "gated_delta_rule"]


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     initial_state: Tensor | None = None, output_final_state: bool = False):
    """The gated delta rule, one token at a time (the obviously right version).

    q, k [B, T, H, Dk]; v [B, T, H, Dv]; g (log decay, <= 0) and beta (update rate) [B, T, H];
    state [B, H, Dk, Dv]. Per token: S = exp(g)·S; S += k ⊗ beta·(v − Sᵀk); o = Sᵀq (q, k
    L2-normalized, q scaled by Dk^-1/2). Returns (o [B, T, H, Dv], final state or None).
    """
    b, t_len, h, dk = k.shape
    q = F.normalize(q, dim=-1) * dk**-0.5
    k = F.normalize(k, dim=-1)
    state = initial_state if initial_state is not None else q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for t in range(t_len):
        state = state * g[:, t, :, None, None].exp()
        update = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * update[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1), (state if output_final_state else None)


register_recurrence(
    Recurrence(
        name="treefx_models_gated_delta_rule",
        fn=gated_delta_rule,
        seq_args={"q": 1, "k": 1, "v": 1, "g": 1, "beta": 1},
        output_like="v",
        neutral={"g": 0.0, "beta": 0.0},  # no decay, no update: the state passes unchanged
    ),
    sites=[(__name__, "gated_delta_rule")],
)


class GatedDeltaNet(nn.Module):
    """q, k, v through a causal depthwise conv (kernel ``conv_kernel``) and SiLU, then the
    gated delta rule with per-token decay and update rate."""

    def __init__(self, config: DecoderConfig, conv_kernel: int = 4) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        width = 3 * self.n_heads * self.head_dim
        self.qkv = nn.Linear(config.dim, width, bias=False)
        self.conv = nn.Conv1d(width, width, conv_kernel, padding=conv_kernel - 1, groups=width)
        self.decay_and_rate = nn.Linear(config.dim, 2 * self.n_heads)
        self.A_log = nn.Parameter(torch.zeros(self.n_heads))
        self.out = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t_len, _ = x.shape
        qkv = self.conv(self.qkv(x).transpose(1, 2))[..., :t_len].transpose(1, 2)
        q, k, v = F.silu(qkv).view(b, t_len, 3, self.n_heads, self.head_dim).unbind(2)
        a, rate = self.decay_and_rate(x).chunk(2, dim=-1)
        g = -self.A_log.exp() * F.softplus(a)
        out, _ = gated_delta_rule(q, k, v, g, rate.sigmoid())
        return self.out(out.reshape(b, t_len, -1))


class GatedDeltaNetBlock(nn.Module):
    def __init__(self, config: DecoderConfig, conv_kernel: int) -> None:
        super().__init__()
        self.mixer_norm = RMSNorm(config.dim, config.norm_eps)
        self.mixer = GatedDeltaNet(config, conv_kernel)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class HybridDecoder(Decoder):
    """A small pure-torch hybrid decoder: Gated DeltaNet and attention layers.

    The dense :class:`Decoder` with its layers following ``layer_types``: "gdn" (Gated
    DeltaNet) or "attention" (RoPE, GQA, SDPA)."""

    def __init__(self, config: DecoderConfig, layer_types=("gdn", "attention"),
                 conv_kernel: int = 4) -> None:
        super().__init__(config)
        if len(layer_types) != config.n_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for "
                             f"{config.n_layers} layers")
        bad = [t for t in layer_types if t not in ("gdn", "attention")]
        if bad:
            raise ValueError(f"unknown layer types {bad}; use 'gdn' or 'attention'")
        self.layer_types = tuple(layer_types)
        self.layers = nn.ModuleList(
            GatedDeltaNetBlock(config, conv_kernel) if t == "gdn" else Block(config)
            for t in layer_types
        )
        self.reset_parameters()
