"""treefx.chat_pieces: tokenizing a text piece by piece between the added tokens gives what
the tokenizer gives for the whole text, ids and offsets; treefx.data.from_chats built on it
gives every call exactly as chat_call (the tokenizer on each call's whole text) does, and
tokenizes each distinct piece once."""

import logging

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from test_data import CALLS, CORPUS, TOOLS  # noqa: E402

from treefx import chat_pieces, data  # noqa: E402
from treefx.models import tiny_chat_tokenizer  # noqa: E402

TEXTS = [
    "",
    "plain text, no added tokens",
    "<|im_start|>",
    "<|im_start|><|im_end|>",
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>",
    "  spaces before <think>and after</think>  \n\n",
    "<tool_call>\n{\"name\": \"calculator\"}\n</tool_call><|im_end|><|endoftext|>",
    "ünïcödé ✓ <|im_end|>日本語 text",
    "<think></think><think>",
    "a partial <|im_sta token and <|im_start",
]


@pytest.fixture(scope="module", params=[True, False], ids=["words", "no-word-split"])
def tok(request):
    return tiny_chat_tokenizer(CORPUS, split_words=request.param)


def test_pieces_tokenize_as_the_whole_text(tok):
    pieces = chat_pieces.PieceTokenizer(tok)
    for text in TEXTS + [t * 3 for t in TEXTS]:
        ids, starts, ends = pieces.encode(text)
        want = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids.tolist() == want["input_ids"], text
        assert list(zip(starts.tolist(), ends.tolist())) == \
            [tuple(o) for o in want["offset_mapping"]], text
    # the repeated texts were served from the pieces tokenized before
    assert pieces.distinct_pieces < sum(len(t) for t in TEXTS)


def test_a_tokenizer_whose_added_tokens_strip_is_not_split():
    from tokenizers import AddedToken
    tok = tiny_chat_tokenizer(CORPUS)
    assert chat_pieces.PieceTokenizer.supports(tok) is None
    tok.add_tokens([AddedToken("<tag>", lstrip=True)])
    why = chat_pieces.PieceTokenizer.supports(tok)
    assert why is not None and "<tag>" in why
    with pytest.raises(ValueError, match="<tag>"):
        chat_pieces.PieceTokenizer(tok)


@pytest.mark.parametrize("markers", [True, False], ids=["markers", "no-markers"])
@pytest.mark.parametrize("train_on", ["last", "all"])
def test_from_chats_gives_each_call_as_chat_call_does(markers, train_on):
    tok = tiny_chat_tokenizer(CORPUS, generation_markers=markers)
    calls = CALLS if markers or train_on == "last" else CALLS[:2]
    tree = data.from_chats(calls, tok, tools=TOOLS, train_on=train_on)
    for i, c in enumerate(calls):
        ref = data.chat_call(c, tok, tools=TOOLS, train_on=train_on)
        assert tree.sequence(i).tolist() == ref.ids
        assert tree.loss_mask(i).tolist() == ref.mask()


def test_pieces_that_disagree_on_the_first_call_fall_back_to_whole_calls(monkeypatch, caplog):
    tok = tiny_chat_tokenizer(CORPUS)
    want = data.from_chats(CALLS, tok, tools=TOOLS)
    real = chat_pieces.PieceTokenizer.encode

    def off_by_one(self, text):
        ids, s, e = real(self, text)
        return ids + 1, s, e

    monkeypatch.setattr(chat_pieces.PieceTokenizer, "encode", off_by_one)
    with caplog.at_level(logging.WARNING, logger="treefx.data"):
        got = data.from_chats(CALLS, tok, tools=TOOLS)
    assert "disagrees" in caplog.text
    assert got == want


def test_a_tokenizer_that_strips_takes_each_call_in_full(caplog):
    from tokenizers import AddedToken
    tok = tiny_chat_tokenizer(CORPUS)
    tok.add_tokens([AddedToken("<tag>", rstrip=True)])
    with caplog.at_level(logging.WARNING, logger="treefx.data"):
        tree = data.from_chats(CALLS, tok, tools=TOOLS)
    assert "in full" in caplog.text
    assert tree.sequences == [data.chat_call(c, tok, tools=TOOLS).ids for c in CALLS]


def test_an_agents_growing_chat_is_tokenized_about_once(monkeypatch):
    """40 calls of one tool loop: laid out call by call, the calls hold ~20x the text of the
    last one; the tokenizer is asked for each distinct piece once, about the last call's
    text (each completion twice: its own call's rendering keeps a think block the later
    calls drop), not for every call's."""
    tok = tiny_chat_tokenizer(CORPUS)
    msgs = [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "Add the numbers one by one."}]
    calls = []
    for k in range(40):
        msgs = msgs + [{"role": "assistant", "reasoning_content": f"Step {k}: add {k}.",
                        "content": f"The running total is {k * (k + 1) // 2}."}]
        calls.append(msgs)
        msgs = msgs + [{"role": "user", "content": f"Next number: {k + 1}. " * 3}]
    asked = []
    real = chat_pieces.PieceTokenizer.encode

    def counting(self, text):
        before = set(self._cache)
        out = real(self, text)
        asked.extend(len(p) for p in set(self._cache) - before)
        return out

    monkeypatch.setattr(chat_pieces.PieceTokenizer, "encode", counting)
    tree = data.from_chats(calls, tok)
    last = len(tok.apply_chat_template(calls[-1], tokenize=False))
    laid_out = sum(len(tok.apply_chat_template(c, tokenize=False)) for c in calls)
    assert laid_out > 15 * last
    assert sum(asked) < 2 * last
    for i, c in enumerate(calls[::13]):
        assert tree.sequence(13 * i).tolist() == data.chat_call(c, tok).ids
    assert np.all(tree.sequence_lengths > 0)
