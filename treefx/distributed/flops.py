"""FLOPs of a training step per token and per attended pair, from a model config (what
:meth:`CostModel.from_config <treefx.distributed.CostModel.from_config>` returns)."""

from __future__ import annotations

import logging
import numbers
from types import SimpleNamespace

__all__ = ["ATTENTION_BACKWARD_FACTOR", "MATMUL_FLOPS_FWD_BWD", "step_flops", "text_config"]

log = logging.getLogger("treefx")

# FLOPs per multiply-add of a weight matmul in a training step: 2 forward, 4 backward (the
# input's gradient and the weight's gradient, 2 each).
MATMUL_FLOPS_FWD_BWD = 6.0
# Attention per (query, key) pair and head, forward: q·k (d_qk multiply-adds) and p·v (d_v),
# 2 FLOPs each, so 2·(d_qk + d_v) = 4·head_dim. Backward ≈ 2.5 × forward, the convention of
# FlashAttention and of benchmarks/attention.py: five matmuls (S = QKᵀ recomputed, dV = PᵀdO,
# dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q) against the forward's two.
ATTENTION_BACKWARD_FACTOR = 2.5

# Model types whose MLP is two matrices (up, down) rather than a gated three (gate, up, down).
_UNGATED_MLP = frozenset({
    "gpt2", "gpt_neo", "gptj", "gpt_neox", "gpt_bigcode", "opt", "bloom", "phi", "falcon",
    "codegen", "mpt", "starcoder2", "biogpt", "xglm", "gpt_neox_japanese",
})


_MISSING = object()


def text_config(config):
    """The config of the text model: a multimodal config's text config, a dict as an object."""
    if isinstance(config, dict):
        return SimpleNamespace(**config)
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text(decoder=True)
        except TypeError:
            return get_text()
    return config


def int_attr(cfg, *names, default=_MISSING):
    """The first of ``names`` the config has, a non-negative integer (``default`` if none)."""
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0:
                raise ValueError(f"config.{n} must be a non-negative integer, got {v!r}")
            return int(v)
    if default is _MISSING:
        raise ValueError(f"config has no {' / '.join(names)}; CostModel.from_config needs it")
    return default


def step_flops(cfg) -> tuple[float, float]:
    """FLOPs of a training step (forward + backward) per token and per attended pair, of a text
    config (:func:`text_config`); see :meth:`treefx.distributed.CostModel.from_config`."""
    hidden = int_attr(cfg, "hidden_size", "n_embd", "d_model")
    layers = int_attr(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = int_attr(cfg, "num_attention_heads", "n_head", "num_heads")
    kv_heads = int_attr(cfg, "num_key_value_heads", default=heads)
    head_dim = int_attr(cfg, "head_dim", default=None)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"config has no head_dim and hidden_size {hidden} is not a "
                             f"multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    intermediate = int_attr(cfg, "intermediate_size", "n_inner", default=None) or 4 * hidden
    model_type = str(getattr(cfg, "model_type", "") or "")
    mlp_mats = 2 if model_type in _UNGATED_MLP else 3

    attn_params, d_qk, d_v = _attention_params(cfg, hidden, heads, kv_heads, head_dim)
    mlp_per_layer = _mlp_params_per_layer(cfg, hidden, intermediate, mlp_mats, layers)
    vocab = int_attr(cfg, "vocab_size", default=None) or 0
    matmul_params = layers * attn_params + sum(mlp_per_layer) + vocab * hidden

    pair_fwd = 2.0 * heads * (d_qk + d_v) * _attention_layers(cfg, layers)
    return (MATMUL_FLOPS_FWD_BWD * matmul_params,
            (1.0 + ATTENTION_BACKWARD_FACTOR) * pair_fwd)


def _attention_params(cfg, hidden: int, heads: int, kv_heads: int,
                      head_dim: int) -> tuple[int, int, int]:
    """Attention projections' parameters per layer, and the per-pair head dimensions
    (d_qk, d_v)."""
    kv_lora = int_attr(cfg, "kv_lora_rank", default=None)
    if kv_lora:  # multi-head latent attention (DeepSeek-V2/V3)
        nope = int_attr(cfg, "qk_nope_head_dim")
        rope = int_attr(cfg, "qk_rope_head_dim")
        d_v = int_attr(cfg, "v_head_dim")
        d_qk = nope + rope
        q_lora = int_attr(cfg, "q_lora_rank", default=None)
        q_params = (hidden * q_lora + q_lora * heads * d_qk) if q_lora else hidden * heads * d_qk
        attn_params = (q_params + hidden * (kv_lora + rope) + kv_lora * heads * (nope + d_v)
                       + heads * d_v * hidden)
    else:
        d_qk = d_v = head_dim
        attn_params = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    return attn_params, d_qk, d_v


def _mlp_params_per_layer(cfg, hidden: int, intermediate: int, mlp_mats: int,
                          layers: int) -> list[int]:
    """The MLP's parameters of each layer, dense or MoE (the active experts only)."""
    dense_mlp = mlp_mats * hidden * intermediate
    experts = int_attr(cfg, "num_experts", "num_local_experts", "n_routed_experts",
                       default=None)
    if not (experts and experts > 1):
        return [dense_mlp] * layers
    top_k = int_attr(cfg, "num_experts_per_tok", "moe_topk", "top_k", default=None)
    if top_k is None:
        log.info("CostModel.from_config: %d experts but no num_experts_per_tok; "
                 "counting one active expert per token", experts)
        top_k = 1
    expert_inter = int_attr(cfg, "moe_intermediate_size", default=None) or intermediate
    shared_inter = int_attr(cfg, "shared_expert_intermediate_size", default=None)
    if shared_inter is None:
        shared_inter = (int_attr(cfg, "n_shared_experts", default=None) or 0) * expert_inter
    moe_mlp = (mlp_mats * hidden * (top_k * expert_inter + shared_inter)
               + hidden * experts)
    first_dense = int_attr(cfg, "first_k_dense_replace", default=None) or 0
    only_dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = int_attr(cfg, "decoder_sparse_step", default=None) or 1
    return [
        dense_mlp if (i < first_dense or i in only_dense or (i + 1) % step) else moe_mlp
        for i in range(layers)
    ]


def _attention_layers(cfg, layers: int) -> int:
    """Layers with attention over the whole path: those ``layer_types`` does not mark as
    linear attention / state-space (every layer when it has no ``layer_types``)."""
    layer_types = getattr(cfg, "layer_types", None)
    if not layer_types:
        return layers
    return sum(1 for t in layer_types if "attention" in str(t) and "linear" not in str(t))
