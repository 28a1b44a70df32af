"""Models for treefx: small pure-torch decoders (gpt-fast style), dense and hybrid."""

from .chat import tiny_chat_tokenizer
from .dense import Decoder, DecoderConfig
from .hybrid import HybridDecoder

TINY_CONFIG = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)


def tiny_decoder(**overrides) -> Decoder:
    """A small Decoder for tests and examples; keyword overrides go to DecoderConfig."""
    return Decoder(DecoderConfig(**{**TINY_CONFIG, **overrides}))


def tiny_hybrid(layer_types=("gdn", "attention"), **overrides) -> HybridDecoder:
    """A small Gated DeltaNet + attention hybrid; keyword overrides go to DecoderConfig."""
    cfg = {**TINY_CONFIG, **overrides, "n_layers": len(layer_types)}
    return HybridDecoder(DecoderConfig(**cfg), layer_types=layer_types)


__all__ = ["Decoder", "DecoderConfig", "HybridDecoder", "tiny_chat_tokenizer", "tiny_decoder",
           "tiny_hybrid"]
