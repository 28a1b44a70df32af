"""Build trees from an agent's model calls, given as chat messages or as token ids.

Trees from an agent's model calls: chat messages through a tokenizer's chat template, or the
token ids an inference engine returned.

One task's model calls (the turns of an agent, the rollouts of a GRPO group) become one
:class:`~treefx.Tree`, one sequence per call, merged where their **token ids** agree: two calls
share exactly the prefix they share as ids, and branch at the first token that differs, even
where the text would agree (a re-rendered turn tokenized differently from how it was sampled).

- :func:`from_ids`: calls as the inference engine saw them, :class:`Call` (``prompt_ids`` +
  ``completion_ids``, with the per-token sampling log-probabilities of the completion). The loss
  mask trains the completion; the log-probabilities go onto the tree's metadata
  (``"logprobs"``), where :func:`treefx.rl.from_metadata` finds them for the objectives.
- :func:`from_chats`: calls as chat messages, tokenized the way the model saw them through the
  tokenizer's chat template (``apply_chat_template``): the call's last message is its completion,
  the messages before it, rendered with the generation prompt, its prompt (see
  :func:`chat_call`).
- :func:`from_trajectories`: agent runs as public trajectory files store them (one
  conversation per run: mini-swe-agent, τ-bench, OpenAI-style messages; read by
  :func:`treefx.trajectories.read_trajectories`), one tree per task.
- :func:`group`: the trees of several rollouts of one task (a GRPO group) as one tree, with each
  call's rollout and the rollouts' rewards in its metadata.

A think-mode template that drops the reasoning of earlier turns (Qwen3 keeps it only within the
current tool loop) renders an earlier assistant turn differently in a later call: the calls
branch there, as they must, since the model saw different tokens.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .chat_pieces import PieceTokenizer
from .trajectories import Trajectory, conversation_calls
from .tree import SEQUENCE_KEYS, Tree, as_token_array, values_equal

__all__ = ["Call", "chat_call", "from_chats", "from_ids", "from_trajectories", "group"]

TRAIN_ON = ("last", "all")

# `{% generation %}` / `{%- generation -%}`: the markers return_assistant_tokens_mask reads.
log = logging.getLogger(__name__)

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Call:
    """One model call as token ids, the way an inference engine returns it.

    One model call: the ``prompt_ids`` the model was given and the ``completion_ids`` it
    sampled (both non-empty lists of token ids).

    ``logprobs``: the sampling log-probability of each completion token (as many as
    ``completion_ids``; None for a token without one), or None. ``loss_mask``: 0/1 per token of
    the whole call (prompt, then completion), or None to train exactly the completion. A
    completion that holds text the model did not sample (tool output spliced into one
    sequence) sets 0 there.
    """

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float | None] | None = None
    loss_mask: Sequence[int] | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        prompt = as_token_array(self.prompt_ids, "prompt_ids")
        completion = as_token_array(self.completion_ids, "completion_ids")
        set_(self, "prompt_ids", tuple(prompt.tolist()))
        set_(self, "completion_ids", tuple(completion.tolist()))
        if self.logprobs is not None:
            lp = self.logprobs.tolist() if hasattr(self.logprobs, "tolist") else self.logprobs
            if isinstance(lp, (str, bytes)) or not isinstance(lp, Iterable):
                raise TypeError(f"logprobs must be a list of numbers, got {type(lp).__name__}")
            lp = list(lp)
            if len(lp) != len(completion):
                raise ValueError(
                    f"logprobs has {len(lp)} entries but completion_ids has {len(completion)} "
                    "tokens; give one sampling log-probability per completion token (None "
                    "where there is none)")
            for j, x in enumerate(lp):
                if x is not None and (isinstance(x, bool) or not isinstance(x, numbers.Real)):
                    raise TypeError(f"logprobs, entry {j}: {x!r} is not a number (or None)")
                if x is not None and math.isinf(x) and x > 0:
                    raise ValueError(f"logprobs, entry {j}: {x} is not a log-probability")
            set_(self, "logprobs", tuple(None if x is None else float(x) for x in lp))
        if self.loss_mask is not None:
            m = self.loss_mask.tolist() if hasattr(self.loss_mask, "tolist") else self.loss_mask
            m = list(m)
            n = len(prompt) + len(completion)
            if len(m) != n:
                raise ValueError(f"loss_mask has {len(m)} entries but the call has {n} tokens "
                                 f"({len(prompt)} prompt + {len(completion)} completion)")
            bad = [j for j, x in enumerate(m) if isinstance(x, str) or x not in (0, 1)]
            if bad:
                raise ValueError(f"loss_mask, entry {bad[0]}: {m[bad[0]]!r} is not 0 or 1")
            set_(self, "loss_mask", tuple(int(x) for x in m))

    @property
    def ids(self) -> list[int]:
        """The call's tokens: prompt, then completion."""
        return [*self.prompt_ids, *self.completion_ids]

    def mask(self) -> list[int]:
        """The call's loss mask: ``loss_mask``, or 0 on the prompt and 1 on the completion."""
        if self.loss_mask is not None:
            return list(self.loss_mask)
        return [0] * len(self.prompt_ids) + [1] * len(self.completion_ids)

    def sequence_logprobs(self) -> list[float | None] | None:
        """The log-probabilities in :mod:`treefx.rl`'s convention: one entry per predicted
        token of the call (entry k for token k + 1), None on the prompt's tokens."""
        if self.logprobs is None:
            return None
        return [None] * (len(self.prompt_ids) - 1) + list(self.logprobs)


def _as_call(c) -> Call:
    if isinstance(c, Call):
        return c
    if isinstance(c, Mapping):
        unknown = set(c) - {"prompt_ids", "completion_ids", "logprobs", "loss_mask"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; a call has prompt_ids, "
                             "completion_ids, and optionally logprobs and loss_mask")
        if "prompt_ids" not in c or "completion_ids" not in c:
            raise ValueError("a call needs prompt_ids and completion_ids")
        return Call(**c)
    raise TypeError(f"a call must be a treefx.data.Call or a dict with prompt_ids and "
                    f"completion_ids, got {type(c).__name__}")


def from_ids(calls: Iterable[Call | Mapping], *, weights=None, metadata=None) -> Tree:
    """A tree of model calls given as token ids (:class:`Call`, or dicts with its fields).

    Each call is one sequence, ``prompt_ids + completion_ids``, with its loss mask (default: the
    completion). Where calls carry ``logprobs``, the tree's metadata ``"logprobs"`` holds them
    per sequence in :mod:`treefx.rl`'s convention (NaN on prompt tokens; a call without them:
    NaN throughout), for ``rl.from_metadata(batch, "logprobs")``. ``weights``: one per call;
    ``metadata``: more metadata (task id, rewards, ...; see :mod:`treefx.tree`).
    """
    if isinstance(calls, (str, bytes, Mapping, Call)) or not isinstance(calls, Iterable):
        raise TypeError("calls must be a list of calls (treefx.data.Call or dicts)")
    checked = []
    for i, c in enumerate(calls):
        try:
            checked.append(_as_call(c))
        except (TypeError, ValueError) as e:
            raise type(e)(f"call {i}: {e}") from None
    if not checked:
        raise ValueError("calls is empty; a tree needs at least one call")
    meta = dict(metadata or {})
    if any(c.logprobs is not None for c in checked):
        if "logprobs" in meta:
            raise ValueError("the calls carry logprobs and metadata has 'logprobs' too; give "
                             "them once")
        meta["logprobs"] = [c.sequence_logprobs() for c in checked]
    return Tree.from_sequences([c.ids for c in checked], weights=weights,
                               loss_masks=[c.mask() for c in checked], metadata=meta or None)


# ---------------------------------------------------------------------- chats


def _messages(call, tools):
    """(messages, tools) of one chat call: a list of messages, or a dict with "messages" and
    optionally its own "tools"."""
    if isinstance(call, Mapping):
        unknown = set(call) - {"messages", "tools"}
        if unknown or "messages" not in call:
            raise ValueError('a chat call is a list of messages or a dict with "messages" (and '
                             f'optionally "tools"); got keys {sorted(call)}')
        tools = call.get("tools", tools)
        call = call["messages"]
    if isinstance(call, (str, bytes)) or not isinstance(call, Sequence):
        raise TypeError(f"a chat call must be a list of messages, got {type(call).__name__}")
    msgs = list(call)
    for j, m in enumerate(msgs):
        if not isinstance(m, Mapping) or "role" not in m:
            raise TypeError(f"message {j} must be a dict with a 'role', got {m!r}")
    if not msgs or msgs[-1]["role"] != "assistant":
        last = msgs[-1]["role"] if msgs else None
        raise ValueError(f"the last message must be the model's completion (role "
                         f"'assistant'), got {last!r}")
    if len(msgs) < 2:
        raise ValueError("the call has no prompt: give at least one message before the "
                         "completion")
    return msgs, tools


def _overlaps(start: int, end: int, spans) -> bool:
    return any(max(start, a) < min(end, b) for a, b in spans)


def _render(tokenizer, messages, kw, *, generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt, **kw)


def _marked_spans(tokenizer, messages, kw) -> list[tuple[int, int]]:
    """Character spans of the template's ``{% generation %}`` blocks in the rendered chat, read
    from ``return_assistant_tokens_mask`` (runs of marked tokens, as character ranges)."""
    enc = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        tokenizer_kwargs={"return_offsets_mapping": True}, **kw)
    spans, start = [], None
    offsets, marks = enc["offset_mapping"], enc["assistant_masks"]
    for k, m in enumerate([*marks, 0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            spans.append((offsets[start][0], offsets[k - 1][1]))
            start = None
    return spans


def _span_by_prefix(tokenizer, messages, i, full_text, end_of_turn, kw, rendered=None
                    ) -> tuple[int, int]:
    """Where assistant message ``i`` lies in ``full_text`` without generation markers: from
    the end of ``messages[:i]`` rendered with the generation prompt to the end of the last
    ``end_of_turn`` in ``messages[:i + 1]`` rendered. Assumes each of those renderings is a
    prefix of the whole chat's. ``rendered``: those two renderings, where the caller has them."""
    if rendered is None:
        rendered = (_render(tokenizer, messages[:i], kw, generation_prompt=True),
                    _render(tokenizer, messages[: i + 1], kw))
    before, upto = rendered
    if not (upto.startswith(before) and full_text.startswith(upto)):
        raise ValueError(
            f"the chat template renders message {i} (assistant) differently once later "
            "messages follow it (a think-mode template dropping earlier reasoning does), and it "
            "has no {% generation %} markers, so the message's tokens cannot be located; use "
            "train_on='last', or a template with generation markers")
    end = len(upto)
    if end_of_turn:
        k = upto.rfind(end_of_turn, len(before))
        if k >= 0:
            end = k + len(end_of_turn)
    return len(before), end


def _chat_texts(tokenizer, msgs, kw) -> tuple[str, str]:
    """(prompt text, whole chat's text) of one call; the first must start the second."""
    prompt_text = _render(tokenizer, msgs[:-1], kw, generation_prompt=True)
    full_text = _render(tokenizer, msgs, kw)
    if not full_text.startswith(prompt_text):
        k = next((j for j, (a, b) in enumerate(zip(prompt_text, full_text)) if a != b),
                 min(len(prompt_text), len(full_text)))
        raise ValueError(
            "the chat template renders the conversation so that it does not start with the "
            f"prompt (the messages before the completion, with the generation prompt); they "
            f"differ at character {k}: {prompt_text[k:k + 30]!r} vs {full_text[k:k + 30]!r}. "
            "The completion cannot be told apart from the prompt: give the ids the engine "
            "used (treefx.data.from_ids)")
    return prompt_text, full_text


def _trained_spans(tokenizer, msgs, kw, texts, train_on, end_of_turn, marked_spans
                   ) -> tuple[int, list[tuple[int, int]]]:
    """(end of the completion, trained character spans) of one call, whose texts are
    ``texts`` (:func:`_chat_texts`). ``marked_spans(msgs, full_text)``: the character spans
    of the template's ``{% generation %}`` blocks, as runs of marked tokens."""
    prompt_text, full_text = texts
    start = len(prompt_text)
    template = tokenizer.get_chat_template(kw["chat_template"], kw["tools"])
    if _GENERATION.search(template):
        spans = marked_spans(msgs, full_text)
        last = [(a, b) for a, b in spans if b > start]
        if not last:
            raise ValueError("the chat template's {% generation %} markers mark nothing in the "
                             "last assistant message")
        end = max(b for _, b in last)
        trained = [(max(a, start), b) for a, b in last]
        if train_on == "all":
            trained += [(a, b) for a, b in spans if b <= start]
    else:
        eot = tokenizer.eos_token if end_of_turn is None else end_of_turn
        _, end = _span_by_prefix(tokenizer, msgs, len(msgs) - 1, full_text, eot, kw,
                                 rendered=texts)
        trained = [(start, end)]
        if train_on == "all":
            trained += [_span_by_prefix(tokenizer, msgs, i, full_text, eot, kw)
                        for i, m in enumerate(msgs[:-1]) if m["role"] == "assistant"]
    if end <= start:
        raise ValueError("the completion is empty: the template renders nothing for the last "
                         "assistant message")
    return end, trained


def chat_call(messages, tokenizer, *, tools=None, train_on: str = "last",
              end_of_turn: str | None = None, chat_template: str | None = None,
              **template_kwargs) -> Call:
    """One chat-format model call as the model saw it: a :class:`Call`.

    ``messages``: the call's chat (a list of message dicts, or a dict with ``"messages"`` and
    ``"tools"``); its last message is the model's completion (role ``"assistant"``, with
    ``content``, and as the template reads them ``reasoning_content`` and ``tool_calls``).

    - ``prompt_ids``: ``tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)``,
      what an inference engine feeds the model.
    - ``completion_ids``: the text the whole chat's rendering adds after the prompt's, up to the
      end of the completion, tokenized on its own: a model samples its completion token by
      token after the prompt, so no token of it merges with the prompt's. Text after the
      completion (a newline after its end-of-turn token) is left out: the model never
      produced it, and the next call's prompt holds it.
    - Loss mask: with ``train_on="last"`` (default) the completion's tokens; with
      ``train_on="all"`` also every earlier assistant message, as this call renders it (SFT on
      every assistant turn; with a template that drops earlier reasoning those turns are not
      what the model sampled: ``"last"`` trains each turn once, in its own call).

    Where the completion starts and ends, and which tokens are the assistant's: with a template
    that has ``{% generation %}`` markers, the marked text (``return_assistant_tokens_mask``;
    marked text that is part of the prompt, a generation prompt's empty ``<think></think>``
    say, stays in the prompt and is not trained). **Fallback** without markers: assistant
    message i spans from the end of ``messages[:i]`` rendered with the generation prompt to
    the last ``end_of_turn`` (default ``tokenizer.eos_token``) in ``messages[:i + 1]``
    rendered, or its end if there is none; this assumes a conversation's rendering starts
    with the rendering of each of its prefixes, which ``"last"`` always meets (the prompt
    must be a prefix of the chat, or this raises) and ``"all"`` checks for each message.

    ``tools``, ``chat_template`` and ``template_kwargs`` (``enable_thinking=False``, ...) go to
    ``apply_chat_template``. Needs a fast tokenizer (character offsets). This tokenizes the
    call's whole text through the tokenizer; :func:`from_chats` gives the same calls for a
    whole task in time that grows with its distinct text.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    msgs, tools = _messages(messages, tools)
    kw = dict(tools=tools, chat_template=chat_template, **template_kwargs)
    texts = _chat_texts(tokenizer, msgs, kw)
    end, trained = _trained_spans(tokenizer, msgs, kw, texts, train_on, end_of_turn,
                                  lambda m, _: _marked_spans(tokenizer, m, kw))
    prompt_text, full_text = texts
    start = len(prompt_text)
    try:
        prompt = tokenizer.apply_chat_template(
            msgs[:-1], tokenize=True, return_dict=True, add_generation_prompt=True,
            tokenizer_kwargs={"return_offsets_mapping": True}, **kw)
        completion = tokenizer(full_text[start:end], add_special_tokens=False,
                               return_offsets_mapping=True)
    except NotImplementedError as e:
        raise TypeError("from_chats needs a fast tokenizer (one with character offsets, a "
                        f"PreTrainedTokenizerFast): {e}") from None
    mask = [int(_overlaps(a, b, trained)) for a, b in prompt["offset_mapping"]]
    mask += [int(_overlaps(start + a, start + b, trained))
             for a, b in completion["offset_mapping"]]
    return Call(prompt["input_ids"], completion["input_ids"], loss_mask=mask)


def _span_mask(starts: np.ndarray, ends: np.ndarray, spans) -> np.ndarray:
    """0/1 per token: whether its character range [start, end) overlaps any span (what
    :func:`_overlaps` tells one token at a time)."""
    spans = sorted((a, b) for a, b in spans if b > a)
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if not merged:
        return np.zeros(len(starts), dtype=np.int64)
    lo, hi = np.asarray(merged, dtype=np.int64).T
    k = np.searchsorted(hi, starts, side="right")  # the first span ending after the start
    hit = k < len(hi)
    out = np.zeros(len(starts), dtype=bool)
    out[hit] = (lo[k[hit]] < ends[hit]) & (starts[hit] < ends[hit])
    return out.astype(np.int64)


class _ChatEncoder:
    """The calls of one task, each as :func:`chat_call` gives it, with every distinct piece
    of text tokenized once (:class:`~treefx.chat_pieces.PieceTokenizer`) and each call's
    ``{% generation %}`` spans read from one rendering, without tokenizing it again."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pieces = PieceTokenizer(tokenizer)
        self._render_marked = _jinja_renderer()

    def _marked_spans(self, msgs, full_text, kw) -> list[tuple[int, int]]:
        indices = None
        if self._render_marked is not None:
            rest = {k: v for k, v in kw.items() if k not in ("tools", "chat_template")}
            template = self.tokenizer.get_chat_template(kw["chat_template"], kw["tools"])
            try:
                texts, gen = self._render_marked(
                    conversations=[[{k: v for k, v in m.items() if v is not None}
                                    for m in msgs]],
                    tools=kw["tools"], chat_template=template,
                    return_assistant_tokens_mask=True,
                    **{**self.tokenizer.special_tokens_map, **rest})
                if texts[0] == full_text:  # rendered as apply_chat_template renders it
                    indices = gen[0]
            except Exception:  # another transformers' signature: the tokenizer's own way
                self._render_marked = None
        if indices is None:
            return _marked_spans(self.tokenizer, msgs, kw)
        # as return_assistant_tokens_mask marks tokens, as runs of marked tokens
        _, starts, ends = self.pieces.encode(full_text)
        marked = _span_mask(starts, ends, indices).astype(bool)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], marked.view(np.int8), [0]])))
        return [(int(starts[a]), int(ends[b - 1])) for a, b in zip(edges[::2], edges[1::2])]

    def call(self, msgs, kw, train_on, end_of_turn) -> tuple[np.ndarray, np.ndarray]:
        """(ids, loss mask) of one call, as :func:`chat_call` gives them (``kw``: its
        template arguments)."""
        texts = _chat_texts(self.tokenizer, msgs, kw)
        end, trained = _trained_spans(self.tokenizer, msgs, kw, texts, train_on, end_of_turn,
                                      lambda m, full: self._marked_spans(m, full, kw))
        prompt_text, full_text = texts
        start = len(prompt_text)
        p_ids, p_starts, p_ends = self.pieces.encode(prompt_text)
        c_ids, c_starts, c_ends = self.pieces.encode(full_text[start:end])
        if not len(p_ids) or not len(c_ids):
            raise ValueError("the call's prompt or completion tokenizes to nothing")
        mask = np.concatenate([_span_mask(p_starts, p_ends, trained),
                               _span_mask(c_starts + start, c_ends + start, trained)])
        return np.concatenate([p_ids, c_ids]), mask


def _jinja_renderer():
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return None
    return render_jinja_template


def from_chats(calls, tokenizer, *, tools=None, train_on: str = "last",
               end_of_turn: str | None = None, chat_template: str | None = None,
               weights=None, metadata=None, **template_kwargs) -> Tree:
    """Build one tree from chat-format model calls through a tokenizer's chat template.

    A tree of chat-format model calls, each as :func:`chat_call` gives it (its keyword
    arguments are this function's), merged as :func:`from_ids` merges them. ``calls``: per
    call, its messages (a list of message dicts, or a dict with ``"messages"`` and its own
    ``"tools"``). ``weights``: one per call; ``metadata``: the tree's (task id, rewards, ...).

    Cost: each call's chat is rendered through the template (the template's own cost), but
    text is tokenized once per distinct piece between the tokenizer's added tokens
    (:class:`~treefx.chat_pieces.PieceTokenizer`: the trunk an agent's calls repeat is
    tokenized once, not once per call), and masks and the merge run on arrays. The first
    call is also built through :func:`chat_call` and must agree exactly, or every call is
    (a warning says so); a tokenizer whose added tokens strip whitespace takes that way
    throughout.
    """
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Iterable):
        raise TypeError("calls must be a list of chat calls (each a list of messages)")
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    opts = dict(tools=tools, train_on=train_on, end_of_turn=end_of_turn,
                chat_template=chat_template, **template_kwargs)
    calls = list(calls)
    if not calls:
        raise ValueError("calls is empty; a tree needs at least one call")
    why = PieceTokenizer.supports(tokenizer)
    if why is not None:
        if why != "not a fast tokenizer":  # (which chat_call refuses, naming it)
            log.warning("treefx.data.from_chats: tokenizing each call in full (%s)", why)
        return _each_in_full(calls, tokenizer, opts, weights, metadata)
    encoder = _ChatEncoder(tokenizer)
    seqs, masks = [], []
    for i, c in enumerate(calls):
        msgs, call_tools = _named(i, _messages, c, tools)
        kw = dict(tools=call_tools, chat_template=chat_template, **template_kwargs)
        ids, mask = _named(i, encoder.call, msgs, kw, train_on, end_of_turn)
        if i == 0:
            ref = _named(0, chat_call, c, tokenizer, **opts)
            if not (np.array_equal(ids, ref.ids) and np.array_equal(mask, ref.mask())):
                log.warning("treefx.data.from_chats: tokenizing by pieces disagrees with the "
                            "tokenizer on the first call; tokenizing each call in full")
                return _each_in_full(calls, tokenizer, opts, weights, metadata)
        seqs.append(ids)
        masks.append(mask)
    return Tree.from_sequences(seqs, weights=weights, loss_masks=masks, metadata=metadata)


def _named(i: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, its TypeError / ValueError naming call ``i``."""
    try:
        return fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"call {i}: {e}") from None


def _each_in_full(calls, tokenizer, opts, weights, metadata) -> Tree:
    return from_ids([_named(i, chat_call, c, tokenizer, **opts) for i, c in enumerate(calls)],
                    weights=weights, metadata=metadata)


# ---------------------------------------------------------------------- groups


def group(rollouts: Sequence[Tree], *, rewards=None, task=None) -> Tree:
    """Join the rollouts of one task (a GRPO group) into one tree, with their rewards.

    The rollouts of one task (a GRPO group), each a tree of its model calls
    (:func:`from_chats` / :func:`from_ids`), as one tree: their sequences in order, with
    metadata ``"rollouts"`` (which rollout each call is from), ``"rewards"`` (``rewards[g]`` on
    every call of rollout g; or the rollouts' own ``"rewards"`` metadata), ``"task"`` (``task``,
    or the rollouts' common one), and their ``"logprobs"`` / ``"advantages"`` joined. Any other
    metadata key must be equal in every rollout that has it. Rollouts keep their weights and
    loss masks. The shared prompt is then stored once: that is the tree.
    """
    if isinstance(rollouts, Tree) or not isinstance(rollouts, Iterable):
        raise TypeError("rollouts must be a list of trees, one per rollout")
    trees = list(rollouts)
    for g, t in enumerate(trees):
        if not isinstance(t, Tree):
            raise TypeError(f"rollouts[{g}] is a {type(t).__name__}, not a treefx.Tree")
        if "rollouts" in t.metadata:
            raise ValueError(f"rollouts[{g}] is already a group (its metadata has 'rollouts')")
    if not trees:
        raise ValueError("rollouts is empty; a group needs at least one rollout")
    counts = [t.num_sequences for t in trees]
    meta: dict = {"rollouts": [g for g, n in enumerate(counts) for _ in range(n)]}

    tasks = {t.metadata["task"] for t in trees if "task" in t.metadata}
    if task is not None:
        if tasks - {task}:
            raise ValueError(f"task={task!r} but rollouts carry task ids {sorted(map(str, tasks))}")
        meta["task"] = task
    elif len(tasks) > 1:
        raise ValueError(f"the rollouts carry different task ids {sorted(map(str, tasks))}; "
                         "a group is one task")
    elif tasks:
        meta["task"] = tasks.pop()

    have = [t for t in trees if "rewards" in t.metadata]
    if rewards is not None:
        if have:
            raise ValueError("rewards given, and some rollouts carry rewards already")
        r = rewards.tolist() if hasattr(rewards, "tolist") else list(rewards)
        if len(r) != len(trees):
            raise ValueError(f"rewards has {len(r)} entries but there are {len(trees)} "
                             "rollouts; give one reward per rollout")
        meta["rewards"] = [r[g] for g, n in enumerate(counts) for _ in range(n)]
    elif have:
        if len(have) != len(trees):
            raise ValueError("some rollouts carry rewards and others do not")
        meta["rewards"] = np.concatenate([t.metadata["rewards"] for t in trees])

    if any("logprobs" in t.metadata for t in trees):
        meta["logprobs"] = [
            lp for t in trees for lp in t.metadata.get("logprobs", [None] * t.num_sequences)]
    have = [t for t in trees if "advantages" in t.metadata]
    if have:
        if len(have) != len(trees):
            raise ValueError("some rollouts carry advantages and others do not")
        per_token = [not isinstance(t.metadata["advantages"], np.ndarray) for t in trees]
        if all(per_token):
            meta["advantages"] = [a for t in trees for a in t.metadata["advantages"]]
        elif not any(per_token):
            meta["advantages"] = np.concatenate([t.metadata["advantages"] for t in trees])
        else:
            raise ValueError("some rollouts carry advantages per sequence, others per token")

    for t in trees:
        for k, v in t.metadata.items():
            if k in SEQUENCE_KEYS or k == "task":
                continue
            if k in meta and not values_equal(meta[k], v):
                raise ValueError(f"the rollouts' metadata {k!r} differs; group keeps only "
                                 "values that all rollouts share")
            meta[k] = v

    masks = None
    if any(t.loss_masks is not None for t in trees):
        masks = [t.loss_mask(i) for t in trees for i in range(t.num_sequences)]
    return Tree.from_sequences(
        [s for t in trees for s in t.sequences],
        weights=np.concatenate([t.weights for t in trees]), loss_masks=masks, metadata=meta)


# ---------------------------------------------------------------------- trajectories


def from_trajectories(trajectories: Iterable[Trajectory], tokenizer, **options) -> Iterator[Tree]:
    """Trees of agent runs, one tree per task.

    The runs are :class:`~treefx.trajectories.Trajectory` records, as
    :func:`treefx.trajectories.read_trajectories` reads them. Each run's calls are :func:`~treefx.trajectories.conversation_calls` of its conversation,
    built by :func:`from_chats` (``options`` are its keyword arguments, but ``weights`` and
    ``metadata``), with metadata ``"task"``. Runs of one task (several trials, τ-bench's ``k``)
    become one tree through :func:`group`, with their rewards where every run has one. Trees
    come in the order their tasks first appear; a task's runs are gathered first, so a task
    is built once all its runs were read.
    """
    for key in ("weights", "metadata"):
        if key in options:
            raise TypeError(f"from_trajectories does not take {key}=; set it on the trees")
    by_task: dict = {}
    for k, t in enumerate(trajectories):
        if not isinstance(t, Trajectory):
            raise TypeError(f"trajectory {k} is a {type(t).__name__}, not a "
                            "treefx.trajectories.Trajectory")
        by_task.setdefault(t.task, []).append(t)
    for task, runs in by_task.items():
        trees = []
        for t in runs:
            try:
                calls = conversation_calls(t.messages)
                trees.append(from_chats(calls, tokenizer, metadata={"task": task}, **options))
            except (TypeError, ValueError) as e:
                trial = "" if t.trial is None else f", trial {t.trial}"
                raise type(e)(f"task {task!r}{trial}: {e}") from None
        if len(trees) == 1 and runs[0].reward is None:
            yield trees[0]
            continue
        rewards = [t.reward for t in runs]
        yield group(trees, rewards=None if None in rewards else rewards, task=task)
