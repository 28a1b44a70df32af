"""Read public agent-trajectory files into the chat calls :func:`treefx.data.from_chats` takes.

An agent's trajectory is usually stored as one conversation, the last call's: OpenAI-style
messages (``system``, ``user``, ``assistant`` with ``tool_calls``, ``tool``). Every assistant
message in it was one model call, whose prompt was the messages before it:
:func:`conversation_calls` recovers those calls. A think-mode chat template then renders each
call the way the model saw it (earlier reasoning dropped), so the calls branch where that
happens and :func:`treefx.data.from_chats` stores what they share once.

The model's reasoning per call is read from the message's ``reasoning_content`` (vLLM, SGLang,
Qwen), its ``reasoning`` (OpenAI-compatible routers), or, in mini-swe-agent files, the raw
response kept in ``extra``; it becomes ``reasoning_content``, the field chat templates read.

Formats :func:`read_trajectories` knows, each giving :class:`Trajectory` records:

- mini-swe-agent (``*.traj.json``: ``{"messages": [...], "instance_id": ..., "info": ...}``;
  SWE-bench runs);
- τ-bench results (a JSON list of ``{"task_id", "trial", "reward", "traj": [...]}``: several
  trials per task, one :class:`Trajectory` each, with its reward);
- plain conversations: a JSON list of messages, ``{"messages": [...]}``, or a JSONL file of
  those (one per line, with an optional ``"task"`` / ``"id"``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Trajectory", "conversation_calls", "read_trajectories"]

# The keys a chat template reads from a message; anything else (an agent's bookkeeping, raw
# API responses) is left out of the calls.
MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


@dataclass(frozen=True)
class Trajectory:
    """One agent run: its task, its conversation, its reward.

    ``task``: the task id; ``messages``: the run's conversation; ``reward`` and ``trial``:
    where the file gives them."""

    task: str | None
    messages: list
    reward: float | None = None
    trial: int | None = None


def _reasoning(message: Mapping) -> str | None:
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    extra = message.get("extra")
    if isinstance(extra, Mapping):  # mini-swe-agent: the raw API response
        try:
            choice = extra["response"]["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            return None
        if isinstance(choice, Mapping):
            for key in ("reasoning_content", "reasoning"):
                value = choice.get(key)
                if isinstance(value, str) and value:
                    return value
    return None


def _clean(message, j: int) -> dict:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"message {j} is not a chat message (a dict with a 'role'): "
                         f"{str(message)[:80]!r}")
    out = {k: message[k] for k in MESSAGE_KEYS if message.get(k) is not None}
    if message["role"] == "assistant":
        out.pop("reasoning_content", None)
        reasoning = _reasoning(message)
        if reasoning is not None:
            out["reasoning_content"] = reasoning
    return out


def conversation_calls(messages: Sequence[Mapping]) -> list[list[dict]]:
    """The model calls of one conversation, each as the messages up to its completion.

    For each assistant message, the messages up to and including it (its prompt, then its
    completion), each message reduced to the keys a chat template reads, with its reasoning
    as ``reasoning_content``.

    An assistant message first in the conversation (no prompt) is an error, as is a
    conversation without any assistant message.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of chat messages")
    msgs = [_clean(m, j) for j, m in enumerate(messages)]
    calls = [msgs[: j + 1] for j, m in enumerate(msgs) if m["role"] == "assistant"]
    if not calls:
        raise ValueError("the conversation has no assistant message, so no model call")
    if msgs[0]["role"] == "assistant":
        raise ValueError("the conversation starts with an assistant message: that call had "
                         "no prompt")
    return calls


def _records(obj, where: str) -> Iterator[Trajectory]:
    if isinstance(obj, list) and obj and all(isinstance(x, Mapping) and "traj" in x
                                             for x in obj):  # τ-bench results
        for k, r in enumerate(obj):
            reward = r.get("reward")
            yield Trajectory(None if r.get("task_id") is None else str(r["task_id"]),
                             list(r["traj"]), None if reward is None else float(reward),
                             r.get("trial", k))
    elif isinstance(obj, list):  # one conversation
        yield Trajectory(None, obj)
    elif isinstance(obj, Mapping) and isinstance(obj.get("messages"), list):
        task = next((obj[k] for k in ("instance_id", "task", "task_id", "id") if k in obj), None)
        yield Trajectory(None if task is None else str(task), obj["messages"])
    else:
        raise ValueError(f"{where}: not an agent trajectory this reader knows (a list of "
                         "messages, a dict with 'messages' as mini-swe-agent writes, or a "
                         "list of τ-bench results with 'traj')")


def _json(text: str, path: str, line: int | None = None):
    """``text`` (the file ``path``, or its line ``line``) parsed, or a ValueError naming the
    file, the line and the column."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{path}:{line}" if line is not None else f"{path}:{e.lineno}"
        raise ValueError(f"{where}: not valid JSON: {e.msg} at column {e.colno}") from None


def read_trajectories(path: str | os.PathLike) -> Iterator[Trajectory]:
    """The agent runs in one trajectory file.

    The formats are the module docstring's: a ``.jsonl`` file holds one record per line, any
    other file one JSON document. A run without a task id gets the file's name (and line
    number)."""
    path = os.fspath(path)
    name = os.path.basename(path)
    for suffix in (".jsonl", ".json", ".traj"):
        name = name.removesuffix(suffix)
    docs = []
    with open(path) as f:
        if path.endswith(".jsonl"):
            for k, line in enumerate(f):
                if line.strip():
                    docs.append((f"{name}:{k + 1}", _json(line, path, k + 1)))
        else:
            docs.append((name, _json(f.read(), path)))
    for where, doc in docs:
        for t in _records(doc, f"{path} ({where})"):
            yield t if t.task is not None else Trajectory(where, t.messages, t.reward, t.trial)
