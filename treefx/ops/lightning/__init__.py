"""Lightning attention (MiniMax): the recurrence in chunks with an initial state (:mod:`.fast`)
and token by token (:mod:`.reference`)."""

from .fast import lightning_attention
from .reference import lightning_attention_reference

__all__ = ["lightning_attention", "lightning_attention_reference"]
