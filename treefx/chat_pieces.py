"""Tokenize many renderings of one growing chat in time that grows with its distinct text.

An agent's model calls render the same conversation again and again, each call a little
longer: tokenizing every call's text in full costs the sum of the calls' lengths, many times
the text there is. :class:`PieceTokenizer` tokenizes each distinct *piece* once.

Why pieces are exact: a Hugging Face fast tokenizer first cuts its input at the added tokens
(``<|im_start|>``, ``<think>``, ...; leftmost, longest match), then normalizes, pre-tokenizes
and encodes each piece between them on its own; an added token becomes its id. So a text's
tokens are its pieces' tokens, each piece tokenized alone, with the added tokens' ids between
them, provided that no added token strips the whitespace beside it (``lstrip`` / ``rstrip``),
matches only whole words (``single_word``) or is matched on normalized text while the
tokenizer normalizes (``normalized`` with a normalizer): :meth:`PieceTokenizer.supports`
checks those, and callers (:func:`treefx.data.from_chats`) compare one call against the
tokenizer's own result before trusting the rest.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = ["PieceTokenizer"]


class PieceTokenizer:
    """Token ids and character offsets of texts, each distinct piece tokenized once.

    ``tokenizer``: a ``transformers`` fast tokenizer (``PreTrainedTokenizerFast``). Texts are
    tokenized as ``tokenizer(text, add_special_tokens=False)`` would (what
    ``apply_chat_template`` does to a rendered chat). Raises ``TypeError`` for a tokenizer
    without a fast backend and ``ValueError`` where :meth:`supports` is false (the reason
    named)."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError("PieceTokenizer needs a fast tokenizer (a PreTrainedTokenizerFast)")
        reason = self.supports(tokenizer)
        if reason:
            raise ValueError(reason)
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._added = {tok.content: i for i, tok in added.items()}
        names = sorted(self._added, key=len, reverse=True)  # longest first at each position
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        self._added_pieces = {
            c: (np.array([i], dtype=np.int64), np.zeros(1, dtype=np.int64),
                np.array([len(c)], dtype=np.int64)) for c, i in self._added.items()}
        self._cache: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @staticmethod
    def supports(tokenizer) -> str | None:
        """None where pieces tokenize exactly as the whole text, else why not."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return "not a fast tokenizer"
        normalizes = backend.normalizer is not None
        for tok in backend.get_added_tokens_decoder().values():
            if tok.lstrip or tok.rstrip or tok.single_word:
                return (f"added token {tok.content!r} strips whitespace or matches whole words "
                        "only, so the text beside it tokenizes differently alone")
            if tok.normalized and normalizes:
                return (f"added token {tok.content!r} is matched after normalization, which "
                        "can join it with the text beside it")
        return None

    @property
    def distinct_pieces(self) -> int:
        """How many distinct pieces were tokenized so far."""
        return len(self._cache)

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, starts, ends) of ``text``'s tokens: int64 ids and each token's character
        range in ``text``, as the tokenizer's ``offset_mapping`` gives them."""
        # re.split with a group: text, added token, text, ... (texts possibly empty)
        parts = self._split.split(text) if self._split is not None else [text]
        cache = self._cache
        new = {p for p in parts[::2] if p and p not in cache}
        if new:
            new = list(new)
            for piece, enc in zip(new, self._backend.encode_batch(new, add_special_tokens=False)):
                off = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
                cache[piece] = (np.asarray(enc.ids, dtype=np.int64), off[:, 0], off[:, 1])
        added = self._added_pieces
        entries = [cache[p] if j % 2 == 0 else added[p]
                   for j, p in enumerate(parts) if p]
        if not entries:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        # each token's offsets are relative to its piece: add where the piece starts
        bases = np.cumsum([0] + [len(p) for p in parts if p][:-1])
        counts = [len(e[0]) for e in entries]
        base = np.repeat(bases, counts)
        return (np.concatenate([e[0] for e in entries]),
                np.concatenate([e[1] for e in entries]) + base,
                np.concatenate([e[2] for e in entries]) + base)
