"""The run's device, dtype and backends, and the model it times."""

from __future__ import annotations

import torch

from .. import common

BLOCK = 128  # FlexAttention block size everywhere


class Env:
    """Device, dtype, backends; everything that differs between the GPU run and the dry run."""

    def __init__(self, args):
        self.dry = args.dry_run
        self.cuda = common.use_cuda(self.dry)
        self.dev = "cuda" if self.cuda else "cpu"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        # torch.compile backend of the baselines; treefx's backend.
        self.backend = "inductor" if self.cuda else "aot_eager"
        self.tree_backend = "inductor" if self.cuda else "eager"
        # Attention of the packed steps: FlexAttention + BlockMask on the GPU; SDPA with
        # the same mask as a dense 4-D bool tensor on the CPU (no FlexAttention backward there).
        self.mask_kind = "flex" if self.cuda else "dense"
        self.chunk = 128 if self.dry else 8192  # cross-entropy chunk (tokens)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def set_attn(model, impl: str) -> None:
    """Switch the HF model's attention implementation (the methods share one model)."""
    if model.config._attn_implementation != impl:
        model.config._attn_implementation = impl


# The HF attention implementation treefx captures.
TREE_ATTN = "sdpa"


def attn_impl(env: Env) -> str:
    """The HF attention implementation of the packed steps."""
    return "flex_attention" if env.mask_kind == "flex" else "sdpa"


# Real hybrid models' layer shapes (``--arch``; ``--hidden`` does not apply, ``--layers`` does):
# Qwen3-Next-80B-A3B's (its MoE of 512 experts, 10 per token and a shared one, as a dense MLP
# of the active width, 10 x 512 + 512) and Qwen3.5's (the 9B-class dense text model), each
# transformers' config defaults; the dry run's tiny ones.
_GDN = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4)
ARCH_SHAPES = {
    "qwen3_next": dict(_GDN, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=256, num_experts=0),
    "qwen3_5": dict(_GDN, hidden_size=4096, intermediate_size=12288, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=256),
}
_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
_ARCH_TINY = {"qwen3_next": dict(_TINY, num_experts=0), "qwen3_5": _TINY}
# The transformers model type of each --arch (the text model of Qwen3.5).
MODEL_TYPES = {"qwen3_5": "qwen3_5_text"}


def build_model(env: Env, hidden: int, args):
    """HF Qwen3 from a config, in training mode: ``--heads``, ``--kv-heads``, head_dim 128,
    intermediate 3 x hidden (a tiny one in the dry run); ``--arch qwen3_next`` / ``qwen3_5``:
    :data:`ARCH_SHAPES`, Gated DeltaNet : attention 3 : 1. Returns the model and its config."""
    if args.arch in ARCH_SHAPES:
        layers = 4 if env.dry else args.layers
        cfg = dict((_ARCH_TINY if env.dry else ARCH_SHAPES)[args.arch], vocab_size=args.vocab,
                   num_hidden_layers=layers,
                   layer_types=[("full_attention" if i % 4 == 3 else "linear_attention")
                                for i in range(layers)])
        if args.arch == "qwen3_next":
            cfg["mlp_only_layers"] = list(range(layers))
    elif env.dry:
        cfg = dict(vocab_size=args.vocab, hidden_size=64, intermediate_size=192,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16)
    else:
        cfg = dict(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                   num_key_value_heads=args.kv_heads, head_dim=128)
    model = common.hf_model(MODEL_TYPES.get(args.arch, args.arch), dev=env.dev,
                            dtype=env.dtype, seed=0, on_device=True, use_cache=False,
                            train=True, **cfg)
    return model, dict(cfg, arch=args.arch)
