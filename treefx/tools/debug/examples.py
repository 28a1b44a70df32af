"""Small Hugging Face models with random weights, for trying treefx without a download.

Small model factories for ``treefx explain MODULE:FACTORY``: Hugging Face decoders built from
small configs with random weights (no download), vocabulary 256.

    treefx explain treefx.tools.debug.examples:qwen3_tiny
    treefx explain treefx.tools.debug.examples:llama_tiny --html llama.html
"""

from __future__ import annotations

import torch

__all__ = ["VOCAB", "demo_tree", "llama_tiny", "qwen3_tiny", "qwen3_tiny_eager", "tiny_decoder"]

VOCAB = 256


def _hf(model_type: str, attn: str, **cfg) -> torch.nn.Module:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is the [hf] extra
        raise ImportError("this example needs transformers: pip install 'treefx[hf]'") from e
    config = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, **cfg)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def qwen3_tiny() -> torch.nn.Module:
    """Qwen3, 2 layers, hidden 64, GQA (4 query / 2 key-value heads), SDPA attention."""
    return _hf("qwen3", "sdpa", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def qwen3_tiny_eager() -> torch.nn.Module:
    """A tiny Qwen3 with Hugging Face's eager attention.

    :func:`qwen3_tiny` with Hugging Face's eager attention (matmul, softmax, matmul)."""
    return _hf("qwen3", "eager", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def llama_tiny() -> torch.nn.Module:
    """Llama, 2 layers, hidden 64, GQA (4 query / 2 key-value heads), SDPA attention."""
    return _hf("llama", "sdpa", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)


def tiny_decoder() -> torch.nn.Module:
    """treefx's own pure-torch decoder (treefx.models), vocabulary 256."""
    from ...models import tiny_decoder as make

    torch.manual_seed(0)
    return make(vocab_size=VOCAB)


def demo_tree(vocab_size: int = VOCAB, seed: int = 1):
    """A small synthetic agent tree for demos.

    A small synthetic agent tree (two rollouts of a prompt, branching tool calls, a few
    hundred tokens) with token ids below ``vocab_size``: what ``treefx explain`` runs when it is
    given no trees."""
    from ..synth import agent_tree

    return agent_tree(seed, vocab_size=min(int(vocab_size), 32000), system_len=(20, 40),
                      prompt_len=(5, 15), think_len=(5, 20), answer_len=(3, 10),
                      tool_len=(5, 20), rollouts=2, turns=(2, 3), branch_prob=0.5)
