"""Models for treefx: a small pure-torch dense decoder (gpt-fast style)."""

from .dense import Decoder, DecoderConfig

TINY_CONFIG = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)


def tiny_decoder(**overrides) -> Decoder:
    """A small Decoder for tests and examples; keyword overrides go to DecoderConfig."""
    return Decoder(DecoderConfig(**{**TINY_CONFIG, **overrides}))


__all__ = ["Decoder", "DecoderConfig", "tiny_decoder"]
