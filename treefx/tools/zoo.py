"""The zoo: every causal-LM class of the installed transformers against the per-branch oracle.

    python -m treefx.tools.zoo                         # all of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    python -m treefx.tools.zoo --models qwen3,gpt2     # a subset
    python -m treefx.tools.zoo --checkpointing --models qwen3,llama

Each model type is built from a tiny config with random weights (no download), run by
``treefx.compile(model, backend="eager")`` on a small forest of odd-shaped trees, and compared
with ``treefx.reference`` (the unmodified model on each sequence alone): per-token log-probs and
the gradient of every parameter. Each model runs in its own subprocess with a timeout, so a
crash or a hang costs one row, not the sweep. The results go to ``docs/zoo.md`` (a table per
mode) and a JSON file of the raw numbers.

A parameter's gradient error is relative to its own gradient (at least 1e-6 of the whole
gradient's norm), so a parameter the loss barely reaches is judged too. Such a parameter's
gradient is often a sum that cancels (Differential attention's ``lambda_*``, Gated DeltaNet's
``A_log``), and the oracle's own rounding there can exceed the dtype's tolerance. Where a
parameter is over the tolerance, the oracle's own floor is measured as ``treefx.verify`` does
(:func:`treefx.verification.oracle_floor_gradients`: the oracle's gradients computed another
way) and that parameter's tolerance is ``FLOOR_FACTOR`` times its floor where that is larger.

A float64 run (the re-run of a float32 failure, or ``--dtype float64``) computes in float64
throughout: Hugging Face models cast to float32 inside (RMSNorm, Gated DeltaNet's kernel,
routers, ``sum(dtype=torch.float32)``), which would leave float32 rounding in a float64 run;
those casts are lifted to float64 (:class:`float64_throughout`), and MoE experts run
``batched_mm`` where their ``grouped_mm`` takes no float64. The row's detail names what was
changed (``float64 (float32 casts lifted, experts batched_mm)``).

Statuses (the promise is "the oracle's values and gradients, or a clear error"):

- ``exact``: log-probs and gradients within the tolerances of the dtype run.
- ``rounding``: outside the float32 tolerances, within the float64 ones: float32 rounding.
- ``WRONG``: ran without an error and differs, in float64 too (or float64 could not run, the
  detail says why): silently wrong training.
- ``refused``: a :class:`treefx.TreeCompileError` (or subclass): the promised clear error.
  ``treefx.compile`` checks itself on its first call (``verify``, on by default) and refuses
  with a ``TreeVerificationError`` when its rewrite disagrees with the unmodified model on its
  own probe; the zoo then runs the model again without that check to record what the rewrite
  computes (``unverified``), since that is a wrong rewrite caught, not a refusal by a pass.
- ``error``: another exception in treefx's path (compile, tree forward or backward).
- ``not a decoder``: the model is not causal (a prefix's logits change when tokens are appended),
  so no tree computation can match it; treefx's outcome is in the detail.
- ``config failed``: the tiny model could not be built, or the oracle itself failed.
- ``timeout``: the subprocess ran past ``--timeout`` (the detail says in which phase).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

import treefx
from treefx.models import enable_activation_checkpointing

log = logging.getLogger("treefx.zoo")

STATUSES = ("exact", "rounding", "WRONG", "refused", "error", "not a decoder", "config failed",
            "timeout")

# (log-prob absolute, gradient relative) tolerances per dtype.
TOLERANCES = {"float32": (1e-4, 1e-4), "float64": (1e-9, 1e-8)}
# A parameter's gradient tolerance is at least this many times the oracle's own floor there
# (as treefx.verify's).
FLOOR_FACTOR = treefx.verification.FLOOR_FACTOR

VOCAB = 128
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
MAX_POSITIONS = 256
# Shorter than the longest probe sequences (~20 tokens), so that sliding windows, attention
# chunks and SSM chunks are crossed inside a sequence and their masks/carries matter.
WINDOW = 5
CHUNK = 8

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # treefx/


# --------------------------------------------------------------------------------------------
# Tiny configs
# --------------------------------------------------------------------------------------------

# Config attribute names (the canonical Hugging Face name first, then aliases used by configs
# without an attribute_map entry) -> the tiny value. A key is only changed when the config has
# it, and, unless it is in _FILL_NONE, when it is not None: None often means "feature off"
# (q_lora_rank=None: no query compression).
_RULES: dict[str, int] = {}


def _rule(value: int, *names: str) -> None:
    for n in names:
        _RULES[n] = value


_rule(HIDDEN, "hidden_size", "n_embd", "d_model", "embed_dim", "emb_dim", "model_dim",
      "word_embed_proj_dim", "input_embedding_size", "output_embedding_size", "embedding_size",
      "embedding_dim", "attention_hidden_size", "lru_width", "ple_embed_dim", "adapter_in_dim",
      "adapter_out_dim", "adapter_input_size")
_rule(HEADS, "num_attention_heads", "n_head", "n_heads", "decoder_attention_heads",
      "attention_heads", "num_decoder_attention_heads", "encoder_attention_heads",
      "num_encoder_attention_heads", "swa_num_attention_heads",
      "num_attention_heads_per_layer")
_rule(HEAD_DIM, "head_dim", "kv_channels", "attention_head_dim", "attention_head_size",
      "d_head", "dim_head", "swa_head_dim", "index_head_dim", "indexer_head_dim",
      "linear_head_dim", "v_head_dim")
_rule(INTERMEDIATE, "intermediate_size", "n_inner", "d_ff", "dff", "ffn_dim", "decoder_ffn_dim",
      "encoder_ffn_dim", "feed_forward_size", "intermediate_size_mlp", "ffn_hidden_size",
      "dense_intermediate_size", "prefix_dense_intermediate_size", "dim_ff", "d_inner")
_rule(INTERMEDIATE // 2, "moe_intermediate_size", "shared_expert_intermediate_size",
      "moe_shared_expert_intermediate_size", "shared_intermediate_size",
      "shared_experts_intermediate_size", "expert_ffn_hidden_size")
_rule(VOCAB, "vocab_size", "decoder_vocab_size", "unpadded_vocab_size",
      "vocab_size_per_layer_input")
_rule(MAX_POSITIONS, "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
      "context_length", "max_target_positions", "model_max_length")
# MoE: few experts, top-2, one shared expert.
_rule(4, "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_rule(2, "num_experts_per_tok", "moe_topk", "top_k_experts", "num_experts_per_token", "moe_k")
_rule(1, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
# Multi-head latent attention (DeepSeek): small ranks; rope and nope halves of the head.
_rule(32, "kv_lora_rank", "q_lora_rank", "o_lora_rank")
_rule(HEAD_DIM // 2, "qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim")
_rule(HEAD_DIM, "qk_head_dim")
# Sparse attention indexers (DeepSeek V3.2, GLM DSA, ...): a top-k smaller than the sequences,
# so the selection matters, and 16 heads (real ones have 32-64). A key's index score is a sum
# of relu'd per-head scores: with 4 heads all four are zero for one key in 16, such keys tie
# at 0, and the top-k breaks a tie as its implementation does (torch's CPU topk differs with
# the row's length: the model alone is then not consistent with its own longer sequences).
_rule(4, "index_topk")
_rule(16, "index_n_heads", "indexer_n_heads")
# State-space and linear-attention mixers: expand * hidden = heads * head_dim = 8 * 16.
_rule(16, "mamba_d_state", "state_size", "ssm_state_size", "mamba_d_head", "mamba_head_dim",
      "mamba_headdim", "linear_key_head_dim", "linear_value_head_dim")
_rule(8, "mamba_n_heads", "mamba_num_heads", "time_step_rank", "mamba_dt_rank")
_rule(2, "mamba_n_groups", "mamba_ngroups", "n_groups", "linear_num_key_heads")
_rule(4, "linear_num_value_heads", "linear_num_heads")
_rule(CHUNK, "mamba_chunk_size", "chunk_size", "attention_chunk_size")
_rule(WINDOW, "sliding_window", "sliding_window_size", "attention_window_size",
      "local_attention_window_len", "window_size")

_KV_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
             "num_query_groups", "swa_num_key_value_heads", "indexer_kv_heads")
# None here is a default the model cannot run with (head_dim=None means hidden / heads in the
# model's eyes only in some configs; num_experts_per_tok=None crashes DeepSeek-V2's router).
_FILL_NONE = {"head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts",
              "n_shared_experts"}
_LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                "num_decoder_layers", "num_blocks", "encoder_layers", "num_encoder_layers")
_GROUP_NAMES = ("n_group", "num_expert_group")
# Scalars meaning "the first k layers are dense" / "the last k layers share KV": kept as a
# per-layer feature when layers are picked, so both kinds of layer remain.
_FIRST_K_NAMES = ("first_k_dense_replace", "num_dense_layers")
_LAST_K_NAMES = ("num_kv_shared_layers",)
# Lists of layer indices (attention layers, MoE layers, ...): turned into per-layer flags.
_INDEX_LIST = re.compile(r"(idx|idxs|indices|_ids|_layers)$")
# Randomness in training mode that is not called dropout.
_NOISE_NAMES = ("router_jitter_noise", "input_jitter_noise")

# Per-model settings the generic rules cannot infer, with the reason.
OVERRIDES: dict[str, dict] = {
    # Mamba2's num_heads are SSM heads: expand * hidden = num_heads * head_dim.
    "mamba2": dict(num_heads=8, head_dim=16),
    # xLSTM: HF's native chunkwise kernel raises a shape error when the qk head dim differs
    # from the v head dim (qk_dim_factor 0.5, its default, at these sizes).
    "xlstm": dict(num_heads=4, qk_dim_factor=1.0),
    # Falcon-H1's SSM width is its own setting: mamba_n_heads * mamba_d_head.
    "falcon_h1": dict(mamba_d_ssm=128),
    # Jamba places attention and experts by period/offset instead of a list: with 2
    # layers, layer 0 is Mamba (dense MLP) and layer 1 attention (experts).
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    # Zamba2's shared attention block: attention_hidden_size is 2 * hidden (concatenated input).
    "zamba2": dict(attention_hidden_size=2 * HIDDEN, attention_head_dim=2 * HIDDEN // HEADS,
                   n_mamba_heads=8, mamba_headdim=16),
    # Bamba places attention by an index list that defaults to None (no attention at all).
    "bamba": dict(attn_layer_indices=[1]),
    # GraniteMoeHybrid's default is Mamba only; its attention layer is the interesting part.
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    # RecurrentGemma repeats block_types (recurrent, recurrent, attention) cyclically.
    "recurrent_gemma": dict(num_hidden_layers=3),
    # LFM2-MoE's default layer_types is None (no model builds from it).
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # Qwen MoE's decoder_sparse_step=1 makes every layer sparse; one dense layer too.
    "qwen2_moe": dict(mlp_only_layers=[0]),
    "qwen3_moe": dict(mlp_only_layers=[0]),
    # ERNIE 4.5 MoE: MoE layers from an index range.
    "ernie4_5_moe": dict(moe_layer_start_index=1, moe_layer_end_index=1),
    # ZAYA supports top-1 routing only.
    "zaya": dict(num_experts_per_tok=1),
    # Qwen4-Exp: its indexer has no defaults; n-gram per-layer embeddings (PLE) on layer 1,
    # with a small n-gram table (the default is 20M rows).
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                           indexer_budget=8, indexer_compress_ratio=2, hc_lowrank=16,
                           ple_layer_ids=[1], ngram_vocab_size_base=256, split_ngram_parts=2,
                           make_ngram_vocab_size_divisible_by=8, eos_token_id=1),
    # Zamba shares one transformer block between its hybrid layers: it needs two of them.
    "zamba": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2,
                  attention_hidden_size=2 * HIDDEN, attention_head_dim=2 * HIDDEN // HEADS,
                  n_mamba_heads=2),
    # dots3: the sliding-window layers' head_dim must be their qk_nope + qk_rope, and their
    # qk_nope is a per-layer override (scaled to 12 here): 12 + 8.
    "dots3_note_text": dict(head_dim=20),
    # Reformer's axial position embeddings must factor max positions and hidden.
    "reformer": dict(axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32]),
}
OVERRIDES["qwen4_exp"] = {"text_config": OVERRIDES["qwen4_exp_text"]}
OVERRIDES["dots3_note"] = {"text_config": OVERRIDES["dots3_note_text"]}

# Model types whose causal-LM class cannot run on token ids alone.
NEEDS_SPECIAL_INPUTS = {
    "gemma4_assistant": "a speculative-decoding drafter: its forward needs the target model's "
                        "inputs_embeds and shared_kv_states",
    "gemma4_unified_assistant": "a speculative-decoding drafter: its forward needs the target "
                                "model's inputs_embeds and shared_kv_states",
}


# Set-up a model needs after it is built.
_POST_BUILD = {
    # X-MOD routes every layer through a language adapter chosen by a default language.
    "xmod": lambda model: model.set_default_language("en_XX"),
}


def _keys(cfg) -> dict:
    """The config's own attributes (what its __init__ stored), without private ones."""
    return {k: v for k, v in vars(cfg).items() if not k.startswith("_")}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tiny_value(k: str, v):
    """The tiny value for attribute ``k`` (current value ``v``), or ``v`` unchanged."""
    low = k.lower()
    if isinstance(v, float) and ("dropout" in low or "pdrop" in low or "layerdrop" in low
                                 or low.endswith("_drop") or "drop_rate" in low
                                 or "drop_path" in low or k in _NOISE_NAMES):
        return 0.0
    if v is None and k not in _FILL_NONE:
        return v
    if not (_is_int(v) or v is None):
        return v
    if k in _KV_NAMES:
        return 1 if v == 1 else KV_HEADS  # multi-query models stay multi-query
    if k in _GROUP_NAMES:  # two routing groups (of two experts) of which one is picked
        return 2 if v is not None and v > 1 else v
    if k == "topk_group":
        return 1 if v is not None and v > 1 else v
    if k in _RULES and not (k in ("n_shared_experts", "num_shared_experts",
                                  "moe_num_shared_experts") and v == 0):
        return _RULES[k]
    return v


def _pick_layers(attrs: dict, n_layers: int, per_layer_config: dict | None
                 ) -> tuple[list[int], dict]:
    """Indices of the layers to keep so that every distinct kind of layer stays (per-layer
    lists, index lists, first-k / last-k scalars, per_layer_config entries), at least two;
    and the attributes rewritten for the kept layers."""
    per_layer, index_lists, first_k, last_k = {}, {}, {}, {}
    for k, v in attrs.items():
        if isinstance(v, (list, tuple)) and v and _INDEX_LIST.search(k) and all(
                _is_int(x) for x in v) and list(v) == sorted(set(v)) and v[-1] < n_layers:
            index_lists[k] = set(v)
        elif isinstance(v, (list, tuple)) and len(v) == n_layers and n_layers > 1:
            per_layer[k] = list(v)
        elif k in _FIRST_K_NAMES and _is_int(v) and 0 < v < n_layers:
            first_k[k] = v
        elif k in _LAST_K_NAMES and _is_int(v) and 0 < v < n_layers:
            last_k[k] = v
    plc = {int(i): o for i, o in (per_layer_config or {}).items()}

    def kind(i):
        return (tuple(repr(v[i]) for v in per_layer.values())
                + tuple(i in s for s in index_lists.values())
                + tuple(i < k for k in first_k.values())
                + tuple(i >= n_layers - k for k in last_k.values())
                + (repr(sorted(plc.get(i, {}))),))

    keep: list[int] = []
    seen = set()
    for i in range(n_layers):
        if kind(i) not in seen:
            seen.add(kind(i))
            keep.append(i)
    for i in range(n_layers):  # at least two layers: the second one sees the first's output
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    keep.sort()
    new: dict = {}
    for k, v in per_layer.items():
        vals = [_tiny_value(k, v[i]) for i in keep]  # per-layer sizes (gemma3n)
        new[k] = tuple(vals) if isinstance(v, tuple) else vals
    for k, s in index_lists.items():
        new[k] = [j for j, i in enumerate(keep) if i in s]
    for k, n in first_k.items():
        new[k] = sum(i < n for i in keep)
    for k, n in last_k.items():
        new[k] = sum(i >= n_layers - n for i in keep)
    if per_layer_config:
        new["per_layer_config"] = {}
        for j, i in enumerate(keep):
            if i in plc:
                o = {k: _scaled(k, v, attrs.get(k)) for k, v in plc[i].items()}
                if plc[i].get("num_key_value_heads") == plc[i].get("num_attention_heads", -1):
                    o["num_key_value_heads"] = o["num_attention_heads"]  # MHA stays MHA
                new["per_layer_config"][j] = o
    return keep, new


def _scaled(k: str, v, default):
    """A per-layer override of ``k``: the tiny value scaled by the override's ratio to the
    config-wide value (a layer with twice the head_dim keeps twice the tiny head_dim)."""
    tiny = _tiny_value(k, default)
    if _is_int(v) and _is_int(default) and _is_int(tiny) and default > 0 and tiny != default:
        return max(1, round(tiny * v / default))
    return _tiny_value(k, v)


def shrink(cfg) -> dict:
    """Keyword overrides that make ``cfg`` tiny (recursing into sub-configs): sizes, layers
    (one of each kind), dropout 0, token ids inside the vocabulary."""
    from transformers import PretrainedConfig

    attrs = _keys(cfg)
    out: dict = {}
    for k, v in attrs.items():
        if isinstance(v, PretrainedConfig):
            sub = shrink(v)
            mt = getattr(v, "model_type", None)
            out[k] = {"model_type": mt, **sub} if mt else sub
            continue
        new = _tiny_value(k, v)
        if new != v:
            out[k] = new
    # Multi-head latent attention: K/V come from one latent, so KV heads = query heads; the
    # config's head_dim is its rope part when they were equal (DeepSeek-V3's convention).
    if attrs.get("kv_lora_rank") is not None and "qk_rope_head_dim" in attrs:
        if attrs.get("num_key_value_heads") not in (None, 1):
            out["num_key_value_heads"] = out.get("num_attention_heads", HEADS)
        if attrs.get("head_dim") is not None and attrs.get("head_dim") == attrs.get(
                "qk_rope_head_dim"):
            out["head_dim"] = _RULES["qk_rope_head_dim"]
    # Layers: one of each kind. The number of layers may be stored under several names.
    n_layers = next((attrs[n] for n in _LAYER_NAMES if _is_int(attrs.get(n))), None)
    if n_layers:
        # Heterogeneous configs store per-layer overrides apart ({"05": {"head_dim": 512}}).
        keep, lists = _pick_layers(attrs, n_layers, cfg.to_dict().get("per_layer_config"))
        out.update(lists)
        for n in _LAYER_NAMES:
            if _is_int(attrs.get(n)) and attrs[n] > 0:
                out[n] = len(keep)
    # Token ids outside the tiny vocabulary move to its top end.
    free = iter(range(VOCAB - 1, VOCAB // 2, -1))
    for k, v in attrs.items():
        if not re.search(r"(_token_id|_token_index|_token_ids)$", k):
            continue
        if _is_int(v) and v >= VOCAB:
            out[k] = next(free)
        elif isinstance(v, (list, tuple)) and v and all(_is_int(x) for x in v):
            out[k] = [x if x < VOCAB else next(free) for x in v]
    return out


def _merge(base: dict, extra: dict) -> dict:
    """``base`` updated with ``extra``, sub-config dicts merged key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else v
    return out


def tiny_config(model_type: str):
    """``AutoConfig.for_model(model_type, ...)`` with the tiny sizes of :func:`shrink` and the
    per-model :data:`OVERRIDES`."""
    from transformers import AutoConfig

    if model_type in NEEDS_SPECIAL_INPUTS:
        raise NotImplementedError(f"needs special inputs: {NEEDS_SPECIAL_INPUTS[model_type]}")
    default = AutoConfig.for_model(model_type)
    kwargs = _merge(shrink(default), OVERRIDES.get(model_type, {}))
    # BERT-like classes are causal LMs only as decoders (their LM head class says so).
    if "is_decoder" in _keys(default):
        kwargs["is_decoder"] = True
    cfg = AutoConfig.for_model(model_type, **kwargs)
    _zero_dropout(cfg)
    return cfg


def _zero_dropout(cfg) -> None:
    """Every dropout-like float attribute to 0, in the config and its sub-configs (some are
    derived in __init__ and not taken as arguments)."""
    from transformers import PretrainedConfig

    for k, v in list(_keys(cfg).items()):
        if isinstance(v, PretrainedConfig):
            _zero_dropout(v)
        elif isinstance(v, float) and _tiny_value(k, v) == 0.0 and v != 0.0:
            setattr(cfg, k, 0.0)


def special_token_ids(cfg) -> set[int]:
    """Every token id the config names (pad, bos, image tokens, ...): kept out of the probe
    trees, since a model may treat them specially (masks from pad, image-feature scatter)."""
    from transformers import PretrainedConfig

    ids: set[int] = set()
    for k, v in vars(cfg).items():
        if isinstance(v, PretrainedConfig):
            ids |= special_token_ids(v)
        elif re.search(r"(_token_id|_token_index|_token_ids|_index)$", k):
            for x in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(x, int) and not isinstance(x, bool):
                    ids.add(x)
    return ids


def build_model(model_type: str, dtype: torch.dtype = torch.float32, *,
                checkpointing: bool = False, **overrides) -> torch.nn.Module:
    """The tiny model, seeded, in ``dtype``; eval mode (train mode with gradient checkpointing
    when ``checkpointing``: the config's dropout is 0, so train mode changes nothing else).
    ``overrides``: config attributes set on top of the tiny config."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dtype)
    model.eval()
    if model_type in _POST_BUILD:
        _POST_BUILD[model_type](model)
    if checkpointing:
        enable_activation_checkpointing(model)
        model.train()
    return model


# --------------------------------------------------------------------------------------------
# Probe trees
# --------------------------------------------------------------------------------------------

def _random_sequences(rng, tokens, n: int = 7, max_len: int = 16) -> list[list[int]]:
    seqs: list[list[int]] = []
    for _ in range(n):
        if seqs and rng.random() < 0.7:  # branch off an earlier sequence
            base = seqs[rng.integers(len(seqs))]
            cut = int(rng.integers(0, len(base) + 1))
            tail = rng.choice(tokens, size=int(rng.integers(0, max_len // 2 + 1))).tolist()
            s = base[:cut] + tail
        else:
            s = rng.choice(tokens, size=int(rng.integers(1, max_len + 1))).tolist()
        seqs.append(s or [int(rng.choice(tokens))])
    return seqs


def _odd_tree(seed: int, tokens, *, masks: bool) -> treefx.Tree:
    """Every odd shape at once (the idea of tests/trees.py): branches, a sequence that is a
    prefix of another, a duplicate, single-token nodes, a one-token sequence; random sequence
    weights and loss masks."""
    rng = np.random.default_rng(seed)
    seqs = _random_sequences(rng, tokens)
    a = max(seqs, key=len) + rng.choice(tokens, size=3).tolist()  # the longest, ~20 tokens
    one = [int(rng.choice(tokens))]
    seqs += [a, a[:2], list(a), a + [int(tokens[0])], a + [int(tokens[1])], one]
    weights = rng.uniform(0.1, 1.0, size=len(seqs))
    loss_masks = [(rng.random(len(s)) < 0.8).astype(int).tolist() for s in seqs] if masks \
        else None
    return treefx.Tree.from_sequences(seqs, weights=weights, loss_masks=loss_masks)


def probe_forest(vocab: int = VOCAB, exclude=(), seed: int = 0) -> list[treefx.Tree]:
    """Two odd trees over token ids below ``vocab`` that avoid ``exclude``."""
    tokens = np.array([t for t in range(vocab) if t not in set(exclude)])
    return [_odd_tree(seed, tokens, masks=True), _odd_tree(seed + 1, tokens, masks=False)]


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------

class _Phase:
    """Where a worker is (written to its result file at every change), so a timeout or a crash
    can say which phase it stopped in."""

    def __init__(self, result: dict, path: str | None):
        self.result, self.path = result, path

    def __call__(self, name: str) -> None:
        self.result["phase"] = name
        if self.path:
            _write_json(self.path, self.result)


def _first_line(e: BaseException) -> str:
    """The message's first line, and the next one when the first only announces it
    ("Graph breaks:")."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (
        lines[0] if lines else "")
    return text[:400]


def _unwrap(e: BaseException) -> BaseException:
    """The exception under Dynamo's wrappers (BackendCompilerFailed, InternalTorchDynamoError)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "inner_exception", None) or (
            e.__cause__ if type(e).__module__.startswith("torch._dynamo") else None)
        if inner is None:
            break
        e = inner
    return e


def _treefx_frame(e: BaseException) -> str | None:
    """The innermost frame in treefx's own code (not the zoo), as ``path:line in function``."""
    frame = None
    for ex in (e, _unwrap(e)):
        for fs in traceback.extract_tb(ex.__traceback__):
            p = Path(fs.filename).resolve()
            if _PACKAGE_DIR in p.parents and p.name != "zoo.py":
                frame = f"{p.relative_to(_PACKAGE_DIR.parent)}:{fs.lineno} in {fs.name}"
    return frame


def _exception_info(e: BaseException) -> dict:
    inner = _unwrap(e)
    info = {"type": type(inner).__name__, "message": _first_line(inner)}
    if inner is not e:
        info["wrapper"] = type(e).__name__
    frame = _treefx_frame(e)
    if frame:
        info["treefx_frame"] = frame
    return info


def _grads(loss: torch.Tensor, params: list[tuple[str, torch.nn.Parameter]]):
    gs = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for (_, p), g in zip(params, gs)]


def relative_errors(got, ref, total: float) -> list[float]:
    """Per parameter, ``|got - ref| / max(|ref|, 1e-6 · total)`` (``total``: the norm of the
    whole reference gradient), so rounding noise on a gradient that is ~0 (unused, or a sum
    that cancels to nothing) does not read as an infinite relative error. Not finite: inf."""
    out = []
    for a, r in zip(got, ref):
        r = r.double()
        den = max(float(r.norm()), 1e-6 * total, 1e-30)
        err = float((a.double() - r).norm()) / den
        out.append(err if math.isfinite(err) else math.inf)
    return out


def judge_gradients(names: list[str], errors: list[float], tolerance: float,
                    floors: list[float] | None = None) -> dict:
    """The gradient verdict: every parameter within its tolerance, ``tolerance`` or, with
    ``floors`` (the oracle's own relative error per parameter), ``FLOOR_FACTOR`` times its floor
    where that is larger. Returns ``ok`` and the parameter nearest to (or furthest over) its
    tolerance: ``grad_err``, ``grad_param`` (and ``grad_floor``, ``grad_tol`` with floors)."""
    if not names:
        return {"ok": True, "grad_err": 0.0, "grad_param": None}
    tols = [tolerance] * len(names) if floors is None else [
        max(tolerance, FLOOR_FACTOR * f) for f in floors]
    ratios = [math.inf if e == math.inf else e / t for e, t in zip(errors, tols)]
    i = max(range(len(names)), key=ratios.__getitem__)  # the first of equals
    out = {"ok": all(e <= t for e, t in zip(errors, tols)), "grad_err": errors[i],
           "grad_param": names[i]}
    if floors is not None:
        out.update(grad_floor=floors[i], grad_tol=tols[i])
    return out


def _causal_err(model, seq: list[int]) -> float:
    """Largest change of a prefix's logits when the rest of the sequence is appended, relative
    to the logits' scale (at least 1): rounding for a causal model, O(1e-2) for one that is
    not (bidirectional attention, batch-dependent routing)."""
    from ..reference import logits_of

    ids = torch.as_tensor(seq)[None]
    k = max(1, len(seq) // 2)
    with torch.no_grad():
        full = logits_of(model(ids))[0, :k].double()
        part = logits_of(model(ids[:, :k]))[0].double()
    return float((full - part).abs().max()) / max(1.0, float(full.abs().max()))


def compare(model: torch.nn.Module, trees, *, tolerances: tuple[float, float],
            phase=lambda name: None, verify: bool | None = None) -> dict:
    """Oracle against treefx on ``trees``: log-probs and the gradient of every parameter.

    Returns ``{"status": ..., ...}`` with ``status`` one of "exact", "WRONG" (differs), "refused",
    "error", "config failed" (the oracle failed) or "not a decoder", and the numbers.
    ``verify``: ``treefx.compile``'s self-check on the first call (None: its default).
    """
    lp_tol, grad_tol = tolerances
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    res: dict = {}

    phase("oracle")
    try:
        longest = max((t.sequence(i) for t in trees for i in range(t.num_sequences)), key=len)
        res["causal_err"] = _causal_err(model, longest)
        batch = treefx.pack(trees, reduction="mean")
        ref_lp = treefx.reference.sequence_logprobs(model, trees)
        ref_loss = treefx.reference.sequence_loss(model, trees, reduction=batch.reduction)
        g_ref = _grads(ref_loss, params)
    except Exception as e:  # the unmodified model failed: nothing to compare against
        return {**res, "status": "config failed", "stage": "oracle", **_exception_info(e)}
    # Far above float32 rounding (~1e-7 here): appending tokens changed earlier logits.
    causal = res["causal_err"] <= 1e-5

    phase("treefx")
    try:
        tm = treefx.compile(model, backend="eager",
                            **({} if verify is None else {"verify": verify}))
        out = tm(batch)
        phase("treefx backward")
        loss = treefx.tree_loss(out, batch)
        g_tree = _grads(loss, params)
    except treefx.TreeCompileError as e:
        info = _exception_info(e)
        return {**res, "status": "refused" if causal else "not a decoder",
                "stage": "treefx", **info}
    except Exception as e:
        inner = _unwrap(e)
        if isinstance(inner, treefx.TreeCompileError):
            return {**res, "status": "refused" if causal else "not a decoder",
                    "stage": "treefx", **_exception_info(e)}
        return {**res, "status": "error" if causal else "not a decoder", "stage": "treefx",
                **_exception_info(e)}

    phase("compare")
    # Under Dynamo, activation checkpointing is a higher-order op around a subgraph: counted
    # so a checkpointing run shows that it exercised it.
    res["checkpoint_regions"] = sum(
        1 for ctx in tm.contexts for n in ctx.gm.graph.nodes
        if n.op == "call_function" and "checkpoint" in str(n.target))
    lp_err = 0.0
    for i, lp in enumerate(ref_lp):
        got = out.token_logprobs[batch.sequence_index(i)[1:]].detach().double()
        if got.numel():
            lp_err = max(lp_err, float((got - lp.detach().double()).abs().max()))
    res["logprob_err"] = lp_err
    res["loss_ref"] = float(ref_loss.detach())
    res["loss_tree"] = float(loss.detach())
    # Relative error per parameter (relative_errors); a parameter over the tolerance is judged
    # against the oracle's own floor there too (judge_gradients), measured only then.
    total = math.sqrt(sum(float(g.double().norm()) ** 2 for g in g_ref))
    names = [n for n, _ in params]
    errors = relative_errors(g_tree, g_ref, total)
    verdict = judge_gradients(names, errors, grad_tol)
    if not verdict["ok"] and lp_err <= lp_tol and causal:
        phase("oracle floor")
        try:
            other = treefx.verification.oracle_floor_gradients(model, trees,
                                                               reduction=batch.reduction)
            floors = relative_errors([other[n] for n in names], g_ref, total)
            verdict = judge_gradients(names, errors, grad_tol, floors)
        except Exception as e:  # noqa: BLE001 - no floor: the dtype's tolerance alone
            res["grad_floor_error"] = _exception_info(e)
    ok = lp_err <= lp_tol and verdict.pop("ok")
    res.update(verdict)
    res["grad_norm"] = total
    if not causal:
        res["status"] = "not a decoder"
    else:
        res["status"] = "exact" if ok else "WRONG"
    return res


class float64_throughout(TorchFunctionMode):  # noqa: N801 - used as a context manager
    """Inside it, a cast to float32 is a cast to float64: ``.float()`` is ``.double()`` and a
    ``torch.float32`` argument (``.to(torch.float32)``, ``sum(dtype=torch.float32)``,
    ``softmax(dtype=...)``, ``zeros(dtype=...)``) is ``torch.float64``; a reinterpreting
    ``view(dtype)`` is left alone. A float64 model then computes in float64 throughout, also
    where Hugging Face's code casts to float32 (RMSNorm, Gated DeltaNet's kernels, routers),
    which would leave float32 rounding in its gradients. Dynamo traces through the mode, so it
    holds for treefx's compiled graph as for the oracle. ``lifted``: the casts changed outside
    a compiled graph (the oracle's), 0 when the model has none."""

    def __init__(self):
        super().__init__()
        self.lifted = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.view:
            return func(*args, **kwargs)
        if func is torch.Tensor.float:
            new_func, new_args, new_kwargs = torch.Tensor.double, args, kwargs
        else:
            new_func = func
            new_args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            new_kwargs = {k: torch.float64 if v is torch.float32 else v
                          for k, v in kwargs.items()}
        if new_func is not func or any(a is not b for a, b in zip(new_args, args)) or any(
                new_kwargs[k] is not kwargs[k] for k in kwargs):
            if not torch.compiler.is_compiling():
                self.lifted += 1
        return new_func(*new_args, **new_kwargs)


def float64_setup(model: torch.nn.Module) -> list[str]:
    """What the float64 run changes in ``model`` besides the dtype: MoE experts on
    ``batched_mm`` where they would run ``grouped_mm`` (the same computation; torch's grouped
    matmul takes no float64). Returns the changes, in words."""
    grouped = any(getattr(getattr(m, "config", None), "_experts_implementation", None)
                  == "grouped_mm" for m in model.modules())
    setter = getattr(model, "set_experts_implementation", None)
    if grouped and callable(setter):
        setter("batched_mm")
        return ["experts batched_mm"]
    return []


def _caught_by_verification(r: dict) -> bool:
    return r.get("status") == "refused" and r.get("type") == "TreeVerificationError"


def run_model(model_type: str, *, dtype: str = "float32", checkpointing: bool = False,
              verify: bool | None = None, result: dict | None = None,
              result_path: str | None = None) -> dict:
    """Build ``model_type`` tiny and compare treefx with the oracle: one row of the zoo.

    The first run uses ``treefx.compile``'s defaults (``verify``: its self-check on the first
    call; None: its default, on). Two follow-ups measure the rewrite itself, without the
    self-check: when the self-check refused the model (``unverified``: what training would
    have computed), and when float32 differs, a float64 run that tells rounding from a real
    error (``float64``).
    """
    result = {} if result is None else result
    result.update(model_type=model_type, dtype=dtype, checkpointing=checkpointing)
    phase = _Phase(result, result_path)
    t0 = time.perf_counter()

    def attempt(dt: str, verify: bool | None) -> dict:
        torch._dynamo.reset()
        phase(f"build {dt}")
        try:
            # The float64 follow-up without checkpointing: under float64_throughout a
            # checkpoint's recomputation in the backward runs outside the mode, in float32,
            # and torch.utils.checkpoint refuses the mismatch (oracle and tree alike).
            # Checkpointing changes no arithmetic; the float32 run exercised it.
            model = build_model(model_type, getattr(torch, dt),
                                checkpointing=checkpointing and dt != "float64")
        except Exception as e:
            return {"status": "config failed", "stage": "build", **_exception_info(e)}
        result.setdefault("class", type(model).__name__)
        result.setdefault("attn_implementation",
                          getattr(model.config, "_attn_implementation", None))
        result.setdefault("parameters", sum(p.numel() for p in model.parameters()))
        trees = probe_forest(VOCAB, special_token_ids(model.config))
        if dt != "float64":
            return compare(model, trees, tolerances=TOLERANCES[dt], verify=verify,
                           phase=lambda name: phase(f"{name} {dt}"))
        setup = float64_setup(model)
        with float64_throughout() as mode:
            res = compare(model, trees, tolerances=TOLERANCES[dt], verify=verify,
                          phase=lambda name: phase(f"{name} {dt}"))
        if mode.lifted:
            setup.insert(0, "float32 casts lifted")
        if checkpointing:
            setup.append("without checkpointing")
        if setup:
            res["setup"] = setup
        return res

    first = attempt(dtype, verify)
    result[dtype] = first
    status = first["status"]
    if _caught_by_verification(first):
        under = attempt(dtype, False)
        result["unverified"] = {dtype: under}
        if under["status"] == "WRONG" and dtype == "float32":
            result["unverified"]["float64"] = attempt("float64", False)
    elif status == "WRONG" and dtype == "float32":
        result["float64"] = attempt("float64", False)
        if result["float64"]["status"] == "exact":
            status = "rounding"
        # Otherwise WRONG stays: float64 differs too, or could not run (the detail says why).
    result["status"] = status
    result["detail"] = detail(result)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result.pop("phase", None)
    return result


def _floor(x: dict) -> str:
    """The oracle's own floor at the parameter named, where it was measured."""
    if "grad_floor" not in x:
        return ""
    return f"; the oracle's own floor there {x['grad_floor']:.1e}, tolerance {x['grad_tol']:.1e}"


def _err(x: dict) -> str | None:
    if "logprob_err" not in x:
        return None
    return (f"log-prob err {x['logprob_err']:.1e}, grad err {x['grad_err']:.1e} "
            f"({x['grad_param']}{_floor(x)})")


def _exc(x: dict) -> str:
    s = f"{x.get('type')}: {x.get('message')}"
    if x.get("treefx_frame"):
        s += f" [at {x['treefx_frame']}]"
    return s


def _runs(runs: dict) -> str:
    """float32 and float64 comparisons in one line."""
    parts = []
    for d in ("float32", "float64"):
        x = runs.get(d)
        if not x:
            continue
        label = d + (f" ({', '.join(x['setup'])})" if x.get("setup") else "")
        if _err(x):
            parts.append(f"{label}: {_err(x)}")
        elif "type" in x and d == "float64":
            stage = x.get("stage")
            parts.append(f"{label} could not run ({f'{stage}: ' if stage else ''}{_exc(x)}), "
                         "so float32 rounding is not told from an error")
        elif "type" in x:
            parts.append(f"{label}: {x['status']} ({_exc(x)})")
    return "; ".join(parts)


def detail(r: dict) -> str:
    """One line for the table: the reason, or the error numbers."""
    status = r.get("status")
    first = r.get(r.get("dtype", "float32"), {}) or {}
    if status == "exact":
        s = f"log-prob err {first.get('logprob_err', 0):.1e}, grad err " \
            f"{first.get('grad_err', 0):.1e}"
        if first.get("grad_err", 0) > TOLERANCES.get(r.get("dtype"), (0, 1))[1] \
                and "grad_floor" in first:
            s += (f" ({first['grad_param']}: within {FLOOR_FACTOR:g} x the oracle's own floor "
                  f"{first['grad_floor']:.1e} there)")
        if r.get("checkpointing"):
            s += f"; {first.get('checkpoint_regions', 0)} checkpointed regions in the graph"
        return s
    if status in ("WRONG", "rounding"):
        return _runs(r)
    if status == "timeout":
        return r.get("detail") or "timeout"
    if status == "not a decoder":
        s = f"not causal (prefix logits change by {first.get('causal_err', float('nan')):.1e} " \
            f"when tokens are appended)"
        if "type" in first:
            return s + f"; treefx: {_exc(first)}"
        if "logprob_err" in first:
            return s + f"; treefx ran without refusing: {_err(first)}"
        return s
    if _caught_by_verification(first):  # its message (in the JSON) repeats the numbers
        return (f"TreeVerificationError: the self-check caught a wrong rewrite || without it: "
                f"{_runs(r.get('unverified', {}))}")
    if "type" in first:
        stage = first.get("stage")
        return (f"{stage}: " if status == "config failed" and stage else "") + _exc(first)
    return r.get("detail", "")


# --------------------------------------------------------------------------------------------
# The sweep: one subprocess per model
# --------------------------------------------------------------------------------------------

def all_model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _write_json(path, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def run_in_subprocess(model_type: str, *, dtype: str, checkpointing: bool, timeout: float,
                      verify: bool | None = None, threads: int | None = None) -> dict:
    """:func:`run_model` in a fresh interpreter (its own Dynamo caches and memory), killed
    with its process group after ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="treefx_zoo_") as tmp:
        path = os.path.join(tmp, "result.json")
        errlog = os.path.join(tmp, "stderr.txt")
        cmd = [sys.executable, "-m", "treefx.tools.zoo", "--worker", model_type, "--worker-out",
               path, "--dtype", dtype] + (["--checkpointing"] if checkpointing else []) + (
            ["--no-verify"] if verify is False else [])
        env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        t0 = time.perf_counter()
        with open(errlog, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                    start_new_session=True)  # its own group: kill it all
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        seconds = round(time.perf_counter() - t0, 1)
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {"model_type": model_type, "dtype": dtype, "checkpointing": checkpointing}
        first = result.get(dtype) or {}
        if rc is None and first.get("status") in ("WRONG", "refused"):
            # The first comparison finished; a follow-up run (float64, or without the
            # self-check) did not: keep the first's status and say what is missing.
            result["status"] = first["status"]
            result["detail"] = f"{detail(result)} (timed out after {timeout:.0f} s in phase " \
                               f"{result.get('phase')})"
        elif rc is None:
            result["status"] = "timeout"
            result["detail"] = f"no result after {timeout:.0f} s (in phase: " \
                               f"{result.get('phase', 'start')})"
        elif "status" not in result or rc != 0:
            with open(errlog) as f:
                tail = [ln for ln in f.read().splitlines() if ln.strip()][-3:]
            result["status"] = "error"
            result["detail"] = f"worker exited with code {rc} in phase " \
                               f"{result.get('phase', 'start')}: {' | '.join(tail)[:400]}"
        result["seconds"] = seconds
        result.pop("phase", None)
        return result


def sweep(models: list[str], *, dtype: str = "float32", checkpointing: bool = False,
          timeout: float = 240, jobs: int = 1, verify: bool | None = None) -> list[dict]:
    """Every model in its own subprocess, ``jobs`` at a time; a progress line per model."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    done = 0

    def one(mt):
        nonlocal done
        r = run_in_subprocess(mt, dtype=dtype, checkpointing=checkpointing, timeout=timeout,
                              verify=verify, threads=threads)
        done += 1
        log.warning("[%d/%d] %s: %s (%.0f s) %s", done, len(models), mt, r["status"],
                    r["seconds"], "" if r["status"] == "exact" else r.get("detail", "")[:160])
        return r

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, models))


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def counts(results: list[dict]) -> dict[str, int]:
    c = {s: 0 for s in STATUSES}
    for r in results:
        c[r["status"]] = c.get(r["status"], 0) + 1
    return {s: n for s, n in c.items() if n}


def _md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def git_revision() -> str | None:
    """The checkout's commit (with "+dirty" for uncommitted changes), if it is a git one."""
    try:
        cwd = _PACKAGE_DIR.parent
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "treefx"], cwd=cwd,
                               text=True, capture_output=True, check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def markdown_section(results: list[dict], *, command: str, date: str, dtype: str,
                     checkpointing: bool, revision: str | None = None,
                     reruns: list[str] = (), verify: bool | None = None) -> str:
    """The header (date, versions, command, tolerances, counts) and one row per model;
    ``reruns``: later commands that re-ran some of the rows (``--merge``)."""
    import transformers

    mode = "gradient checkpointing, train mode" if checkpointing else "eval mode"
    lp32, g32 = TOLERANCES["float32"]
    lp64, g64 = TOLERANCES["float64"]
    c = counts(results)
    lines = [
        f"## {'Gradient checkpointing' if checkpointing else 'All causal-LM model types'}",
        "",
        f"- date: {date}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, CPU, treefx backend `eager`, {mode}, {dtype}"
        + (f", treefx at {revision}" if revision else ""),
        f"- command: `{command}`" + "".join(f"; re-run: `{c}`" for c in reruns),
        f"- tolerances: float32 log-prob abs {lp32:g}, gradient relative {g32:g} (norm of "
        f"difference / norm, per parameter), or {FLOOR_FACTOR:g} x the oracle's own floor for "
        f"that parameter where larger (measured for a parameter over {g32:g}: "
        f"`treefx.verification.oracle_floor_gradients`, the oracle's gradients computed "
        f"another way); a float32 failure is re-run in float64 (log-prob {lp64:g}, gradient "
        f"{g64:g}, the same floor rule; float64 throughout: the model's casts to float32 "
        f"lifted, MoE experts `batched_mm`, activation checkpointing off): within them it "
        f"is `rounding`, outside `WRONG`",
        "- treefx's first-call self-check (`verify`): "
        + ("off (`--no-verify`)" if verify is False else
           "on (its default); a model it refuses (`TreeVerificationError`) is run again "
           "without it, and the detail gives what training would have computed (after `||`)"),
        f"- probe: 2 odd trees (branches, single-token nodes, a prefix sequence, duplicates, "
        f"sequences up to ~20 tokens, random weights and loss masks), reduction `mean`; tiny "
        f"configs: hidden {HIDDEN}, {HEADS} heads / {KV_HEADS} KV heads, vocab {VOCAB}, "
        f"one layer of each kind (at least 2), windows {WINDOW}, chunks {CHUNK}",
        "- counts: " + ", ".join(f"{s} {n}" for s, n in c.items()) + f" (of {len(results)})",
        "",
        "| model type | status | detail | s |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {_md_cell(r['model_type'])} | {r['status']} | "
                     f"{_md_cell(r.get('detail', ''))} | {r.get('seconds', '')} |")
    return "\n".join(lines) + "\n"


_INTRO = """# treefx zoo: every causal-LM class of the installed transformers

Generated by `python -m treefx.tools.zoo` (see `treefx/tools/zoo.py` for the statuses). Each
model type is built from a tiny config with random weights and compared with `treefx.reference`
(the unmodified model on each sequence alone): log-probs and every parameter's gradient.
"""


def write_markdown(path, section: str, *, checkpointing: bool) -> None:
    """Write ``section`` into ``path`` between its mode's markers, keeping the other mode's."""
    key = "checkpointing" if checkpointing else "default"
    begin, end = f"<!-- zoo:{key} -->", f"<!-- /zoo:{key} -->"
    block = f"{begin}\n{section}{end}\n"
    path = Path(path)
    text = path.read_text() if path.exists() else _INTRO
    if begin in text and end in text:
        a, b = text.index(begin), text.index(end) + len(end) + 1
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    # The default table first, the checkpointing one after it.
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_order_sections(text))


def _order_sections(text: str) -> str:
    sections = {}
    for key in ("default", "checkpointing"):
        m = re.search(rf"<!-- zoo:{key} -->.*?<!-- /zoo:{key} -->\n", text, re.S)
        if m:
            sections[key] = m.group(0)
            text = text.replace(m.group(0), "")
    return text.rstrip("\n") + "\n\n" + "\n".join(sections[k] for k in ("default",
                                                                          "checkpointing")
                                                  if k in sections)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m treefx.tools.zoo",
                                description=__doc__.split("\n")[0])
    p.add_argument("--models", help="comma-separated model types (default: all)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per model (240)")
    p.add_argument("--jobs", type=int, default=1, help="models at a time (1)")
    p.add_argument("--out", default="docs/zoo.md", help="markdown file (docs/zoo.md)")
    p.add_argument("--json", help="raw results (benchmarks/results/zoo_<date>_cpu[_"
                                  "checkpointing].json)")
    p.add_argument("--checkpointing", action="store_true",
                   help="gradient checkpointing on, train mode (dropout is 0)")
    p.add_argument("--dtype", default="float32", choices=sorted(TOLERANCES))
    p.add_argument("--no-verify", dest="verify", action="store_const", const=False,
                   default=None, help="treefx.compile(verify=False): the rewrite alone, "
                                      "without its first-call self-check")
    p.add_argument("--merge", metavar="JSON",
                   help="re-run the --models into this earlier results file: their rows are "
                        "replaced, the others kept (written to --json, default this file)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        import warnings

        warnings.filterwarnings("ignore")
        result: dict = {}
        try:
            run_model(args.worker, dtype=args.dtype, checkpointing=args.checkpointing,
                      verify=args.verify, result=result, result_path=args.worker_out)
        finally:
            if args.worker_out:
                _write_json(args.worker_out, result)
        return 0

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    models = all_model_types()
    if args.models:
        wanted = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = sorted(set(wanted) - set(models))
        if unknown:
            p.error(f"not causal-LM model types here: {', '.join(unknown)}")
        models = wanted
    date = datetime.date.today().isoformat()
    suffix = "_checkpointing" if args.checkpointing else ""
    json_path = Path(args.json or args.merge
                     or f"benchmarks/results/zoo_{date}_cpu{suffix}.json")
    command = "python -m treefx.tools.zoo" + ("" if argv is None and len(sys.argv) <= 1 else " "
                                              + shlex.join(sys.argv[1:] if argv is None else argv))
    revision = git_revision()  # before the sweep: the checkout it started from
    t0 = time.perf_counter()
    results = sweep(models, dtype=args.dtype, checkpointing=args.checkpointing,
                    timeout=args.timeout, jobs=args.jobs, verify=args.verify)
    seconds = round(time.perf_counter() - t0)
    reruns: list[str] = []
    if args.merge:  # the earlier sweep's rows, these models' replaced in place
        with open(args.merge) as f:
            prev = json.load(f)
        if prev.get("checkpointing") != args.checkpointing or prev.get("dtype") != args.dtype:
            p.error(f"{args.merge} is a sweep of another mode or dtype")
        new = {r["model_type"]: r for r in results}
        results = [new.pop(r["model_type"], r) for r in prev["results"]] + list(new.values())
        reruns = prev.get("reruns", []) + [f"{command} (on {date}, treefx at {revision})"]
        date, command, revision = prev["date"], prev["command"], prev.get("revision")
        seconds += prev.get("seconds", 0)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(json_path, {
        "date": date, "command": command, "revision": revision, "reruns": reruns,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "dtype": args.dtype, "checkpointing": args.checkpointing, "verify": args.verify,
        "tolerances": TOLERANCES, "floor_factor": FLOOR_FACTOR,
        "seconds": seconds, "counts": counts(results), "results": results})
    write_markdown(args.out, markdown_section(results, command=command, date=date,
                                              dtype=args.dtype,
                                              checkpointing=args.checkpointing,
                                              revision=revision, reruns=reruns,
                                              verify=args.verify),
                   checkpointing=args.checkpointing)
    log.warning("%s; wrote %s and %s", ", ".join(f"{s} {n}" for s, n in counts(results).items()),
                args.out, json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
