"""A small dense decoder-only LLM in pure torch, in the spirit of gpt-fast: the whole model in one file.

Llama-style: token embedding, ``n_layers`` x (RMSNorm -> causal self-attention with RoPE and GQA ->
residual, RMSNorm -> SwiGLU MLP -> residual), final RMSNorm, ``lm_head``. RoPE uses the Hugging Face
"rotate_half" layout (not interleaved).

Graph-friendliness (FX passes work on the traced forward):
- Positions default to ``torch.arange(T)`` built from the input's sequence length on every call, and
  cos/sin are computed from the positions on every call (only ``inv_freq`` is cached), so a pass can
  replace that ``arange`` (or callers can pass ``position_ids``) and everything downstream follows.
- The eager attention builds its causal mask from the sequence length on every call as a float tensor
  (``torch.triu(torch.full((T, T), -inf), 1)``) that is added to the scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ATTN_IMPLS = ("sdpa", "eager")


@dataclass
class DecoderConfig:
    """The shape of a :class:`Decoder`: vocabulary, width, layers, heads, attention."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # default: dim // n_heads
    intermediate_size: int | None = None  # default: 8/3 * dim rounded up to a multiple of 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    attn_impl: str = "sdpa"  # "sdpa" | "eager"
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"DecoderConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(
                    f"DecoderConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) "
                    "when head_dim is not given"
                )
            self.head_dim = self.dim // self.n_heads
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(f"DecoderConfig.head_dim must be a positive even int (RoPE), got {self.head_dim!r}")
        if self.intermediate_size is None:
            hidden = int(8 * self.dim / 3)
            self.intermediate_size = 16 * ((hidden + 15) // 16)
        if not isinstance(self.intermediate_size, int) or self.intermediate_size <= 0:
            raise ValueError(f"DecoderConfig.intermediate_size must be a positive int, got {self.intermediate_size!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"DecoderConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"DecoderConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"DecoderConfig.attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: half/bfloat16 are upcast, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(_compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, H_kv, T, D] -> [B, H_kv * n_rep, T, D] (as in Hugging Face: expand + reshape)."""
    if n_rep == 1:
        return x
    b, h_kv, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h_kv, n_rep, t, d).reshape(b, h_kv * n_rep, t, d)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.attn_impl = config.attn_impl
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.attn_impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            out = self._eager(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def _eager(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        t = q.shape[-2]
        scores = q @ k.transpose(-2, -1) * self.scale
        mask = torch.triu(torch.full((t, t), float("-inf"), device=q.device, dtype=scores.dtype), 1)
        scores = scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=_compute_dtype(scores.dtype)).to(q.dtype)
        return probs @ v


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    """treefx's small Llama-style decoder in pure torch (see the module's docstring)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) for every Linear/Embedding weight, ones for norms: deterministic under a seed."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def rope(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin of shape [B, T, head_dim] for position_ids [B, T] (rotate_half layout)."""
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """input_ids [B, T] (long), position_ids [B, T] (or [T]) or None (= arange(T)) -> logits [B, T, V]."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        x = self.tok_embeddings(input_ids)
        cos, sin = self.rope(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
