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


def enable_activation_checkpointing(model, **checkpoint_kwargs) -> None:
    """Turn on a Hugging Face model's activation checkpointing, by the name its transformers has.

    transformers 5.17 has ``gradient_checkpointing_enable``; 5.24 names it
    ``activation_checkpointing_enable`` and keeps the old name as an alias that warns it goes
    away in v6. This calls the new name where the model has it, else the old one: it works on
    both, without the warning. ``checkpoint_kwargs`` (e.g. ``use_reentrant=False``) go to
    ``torch.utils.checkpoint.checkpoint``; none given: transformers' default. Train mode is left
    to the caller. A ``TypeError`` for a model with neither method."""
    kwargs = checkpoint_kwargs or None
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise TypeError(f"{type(model).__name__} has no activation checkpointing to enable "
                        "(a Hugging Face PreTrainedModel has activation_checkpointing_enable, "
                        "or gradient_checkpointing_enable in older transformers such as 5.17)")


__all__ = ["Decoder", "DecoderConfig", "HybridDecoder", "tiny_chat_tokenizer", "tiny_decoder",
           "tiny_hybrid"]
