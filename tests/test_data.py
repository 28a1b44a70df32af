"""treefx.data: trees from chat messages (a real BPE tokenizer trained here, offline, with a
Qwen3-style think/tool chat template) and from the token ids an inference engine returned.

The expected ids always come from the tokenizer itself (``apply_chat_template``, or the
tokenizer called on text), never from treefx."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

import treefx  # noqa: E402
from treefx import data, rl  # noqa: E402
from treefx.models import tiny_chat_tokenizer  # noqa: E402

CORPUS = [
    "You are a careful assistant. Use the calculator for arithmetic.",
    "What is 12 * 7? I will call the calculator. The calculator says 84. The answer is 84.",
    "Thanks! And 2 + 3? Adding two and three gives five. It is 5.",
    '{"name": "calculator", "arguments": {"expression": "12 * 7"}}',
    "<tool_response>\n84\n</tool_response>",
]

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]

# One agent task: a tool loop (call, result, answer), then a new user turn.
CHAT = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "reasoning_content": "I will call the calculator.", "content": "",
     "tool_calls": [{"type": "function", "function": {
         "name": "calculator", "arguments": {"expression": "12 * 7"}}}]},
    {"role": "tool", "content": "84"},
    {"role": "assistant", "reasoning_content": "The calculator says 84.",
     "content": "The answer is 84."},
    {"role": "user", "content": "Thanks! And 2 + 3?"},
    {"role": "assistant", "reasoning_content": "Adding two and three gives five.",
     "content": "It is 5."},
]
CALLS = [CHAT[:3], CHAT[:5], CHAT[:7]]  # the agent's three model calls

# A template without think blocks: the completion follows "assistant\n" directly.
CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
          "'<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer(CORPUS)


@pytest.fixture(scope="module")
def tok_plain():
    """The same tokenizer, its template without {% generation %} markers."""
    return tiny_chat_tokenizer(CORPUS, generation_markers=False)


def ids_of(tokenizer, messages, **kw):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              **kw)["input_ids"])


def text_of(tokenizer, messages, **kw):
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def expected_call(tokenizer, messages, **kw):
    """(prompt ids, completion ids) by hand: the prompt as apply_chat_template gives it, the
    completion as the text the full rendering adds, through <|im_end|>, tokenized alone."""
    prompt = ids_of(tokenizer, messages[:-1], add_generation_prompt=True, **kw)
    prompt_text = text_of(tokenizer, messages[:-1], add_generation_prompt=True, **kw)
    full = text_of(tokenizer, messages, **kw)
    assert full.startswith(prompt_text)
    end = full.index("<|im_end|>", len(prompt_text)) + len("<|im_end|>")
    return prompt, tokenizer(full[len(prompt_text):end], add_special_tokens=False)["input_ids"]


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def unique_prefixes(seqs) -> int:
    """Tokens of the prefix tree of ``seqs``, counted without treefx."""
    return len({tuple(s[: k + 1]) for s in seqs for k in range(len(s))})


# ---------------------------------------------------------------------------- chats


def test_calls_are_the_ids_apply_chat_template_gives(tok):
    tree = data.from_chats(CALLS, tok, tools=TOOLS)
    for i, msgs in enumerate(CALLS):
        prompt, completion = expected_call(tok, msgs, tools=TOOLS)
        assert tree.sequences[i] == prompt + completion
        # the prompt is a prefix of the whole chat's tokenization: the same tokens
        assert ids_of(tok, msgs, tools=TOOLS)[: len(prompt)] == prompt
    assert tree.num_tokens == unique_prefixes(tree.sequences)


def test_tool_loop_calls_share_and_a_new_turn_branches_where_reasoning_is_dropped(tok):
    tree = data.from_chats(CALLS, tok, tools=TOOLS)
    s0, s1, s2 = tree.sequences
    # Within the tool loop the template keeps the reasoning: call 0 is a prefix of call 1.
    assert s1[: len(s0)] == s0 and len(s1) > len(s0)
    # The new user turn drops the first answer's reasoning: call 2 branches right after the
    # first assistant header, "<think>" in calls 0 and 1, "<tool_call>" in call 2.
    header = len(ids_of(tok, CHAT[:2], tools=TOOLS, add_generation_prompt=True))
    assert lcp(s0, s2) == lcp(s1, s2) == header
    assert tok.convert_ids_to_tokens([s0[header], s2[header]]) == ["<think>", "<tool_call>"]
    # The tree: the shared header once, call 0 then call 1's continuation, call 2's branch.
    assert tree.segment_lengths.tolist() == [header, len(s0) - header, len(s1) - len(s0),
                                             len(s2) - header]
    assert tree.parents.tolist() == [-1, 0, 1, 0]
    assert tree.num_baseline_tokens == len(s0) + len(s1) + len(s2)


def test_masks_train_exactly_each_calls_completion(tok):
    tree = data.from_chats(CALLS, tok, tools=TOOLS)
    for i, msgs in enumerate(CALLS):
        prompt, completion = expected_call(tok, msgs, tools=TOOLS)
        assert tree.loss_mask(i).tolist() == [0] * len(prompt) + [1] * len(completion)
    trained = [tok.decode([t for t, m in zip(tree.sequences[i], tree.loss_mask(i)) if m])
               for i in range(3)]
    assert trained[0] == ('<think>\nI will call the calculator.\n</think>\n\n<tool_call>\n'
                          '{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n'
                          '</tool_call><|im_end|>')
    assert trained[1] == "<think>\nThe calculator says 84.\n</think>\n\nThe answer is 84.<|im_end|>"
    assert trained[2] == ("<think>\nAdding two and three gives five.\n</think>\n\nIt is 5."
                          "<|im_end|>")
    # The tool result is context: in call 1's prompt, untrained.
    prompt1 = tok.decode(tree.sequences[1][: len(expected_call(tok, CALLS[1], tools=TOOLS)[0])])
    assert prompt1.endswith("<tool_response>\n84\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n")


def test_train_on_all_matches_the_templates_assistant_mask(tok):
    tree = data.from_chats(CALLS, tok, tools=TOOLS, train_on="all")
    for i, msgs in enumerate(CALLS):
        hf = tok.apply_chat_template(msgs, tools=TOOLS, return_dict=True,
                                     return_assistant_tokens_mask=True)
        n_prompt = len(expected_call(tok, msgs, tools=TOOLS)[0])
        # earlier assistant turns: HF's generation mask, on the tokens the call shares with it
        assert tree.loss_mask(i)[:n_prompt].tolist() == hf["assistant_masks"][:n_prompt]
        assert tree.loss_mask(i)[n_prompt:].tolist() == [1] * (len(tree.sequences[i]) - n_prompt)
    # call 2 trains its first answer as it renders it, without the dropped reasoning
    trained = tok.decode([t for t, m in zip(tree.sequences[2], tree.loss_mask(2)) if m])
    assert trained.startswith("<tool_call>\n") and "I will call" not in trained


def test_fallback_without_generation_markers(tok, tok_plain):
    assert "{%- generation %}" not in tok_plain.chat_template
    # The prefix-rendering fallback finds the same completions as the markers.
    assert data.from_chats(CALLS, tok_plain, tools=TOOLS) == data.from_chats(CALLS, tok,
                                                                             tools=TOOLS)
    # Within a tool loop the template renders prefixes as prefixes: "all" works too.
    assert data.from_chats(CALLS[:2], tok_plain, tools=TOOLS, train_on="all") == \
        data.from_chats(CALLS[:2], tok, tools=TOOLS, train_on="all")
    # After a new user turn the earlier answer is re-rendered: its span cannot be located.
    with pytest.raises(ValueError, match=r"call 2: the chat template renders message 2 "
                                         r"\(assistant\) differently"):
        data.from_chats(CALLS, tok_plain, tools=TOOLS, train_on="all")
    # Without markers nor an end-of-turn token, the completion is everything after the prompt
    # (the newline after <|im_end|> too): the documented fallback, stated here.
    call = data.chat_call(CALLS[1], tok_plain, tools=TOOLS, end_of_turn="")
    assert tok.decode(call.completion_ids).endswith("<|im_end|>\n")


def test_generation_prompt_text_is_prompt_not_completion(tok, tok_plain):
    """enable_thinking=False: the generation prompt holds an empty think block, marked as
    generation by the template; it is part of the prompt, and not trained."""
    msgs = [{"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "It is 5."}]
    for t in (tok, tok_plain):
        call = data.chat_call(msgs, t, enable_thinking=False)
        assert tok.decode(call.prompt_ids).endswith("assistant\n<think>\n\n</think>\n\n")
        assert tok.decode(call.completion_ids) == "It is 5.<|im_end|>"
        assert call.mask() == [0] * len(call.prompt_ids) + [1] * len(call.completion_ids)
        assert list(call.prompt_ids) == ids_of(t, msgs[:1], add_generation_prompt=True,
                                               enable_thinking=False)


def test_retokenization_drift_the_tree_follows_the_ids():
    """A tokenizer whose merges span words and newlines: the completion tokenized as sampled
    (after the prompt) differs from the same text tokenized inside the next call's prompt. The
    text of call 0 is a prefix of call 1's, but the calls branch at the first differing id."""
    corpus = ["assistant\nThe answer is 5.\n"] * 5 + ["The weather is nice today."] * 5
    tok = tiny_chat_tokenizer(corpus, split_words=False, vocab_size=300)
    chat = [{"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "The answer is 5."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "The weather is nice today."}]
    calls = [chat[:2], chat]
    tree = data.from_chats(calls, tok, chat_template=CHATML)
    expected = [sum(expected_call(tok, c, chat_template=CHATML), []) for c in calls]
    assert tree.sequences == expected
    s0, s1 = expected
    assert tok.decode(s1).startswith(tok.decode(s0))  # the text agrees
    branch = lcp(s0, s1)
    assert branch < len(s0) - 5  # the ids do not: "assistant\nThe" merged in call 1
    assert tree.segment_lengths.tolist() == [branch, len(s0) - branch, len(s1) - branch]
    assert tree.num_tokens == unique_prefixes(expected)


def test_chat_call_forms_and_errors(tok):
    as_dict = data.from_chats([{"messages": CALLS[0], "tools": TOOLS}], tok)
    assert as_dict == data.from_chats(CALLS[:1], tok, tools=TOOLS)
    with pytest.raises(ValueError, match=r"call 1: the last message must be the model's "
                                         r"completion \(role 'assistant'\), got 'tool'"):
        data.from_chats([CALLS[0], CHAT[:4]], tok, tools=TOOLS)
    with pytest.raises(ValueError, match="call 0: the call has no prompt"):
        data.from_chats([[CHAT[2]]], tok)
    with pytest.raises(ValueError, match="train_on must be one of"):
        data.from_chats(CALLS, tok, train_on="assistant")
    with pytest.raises(TypeError, match="call 0: message 1 must be a dict with a 'role'"):
        data.from_chats([[CHAT[0], "hi", CHAT[2]]], tok)


# ---------------------------------------------------------------------------- ids


def test_from_ids_masks_and_logprobs_arrive_at_the_right_tree_tokens():
    prompt = [1, 2, 3, 4]
    calls = [
        # two samples of one prompt that begin alike (same tokens, same log-probs) then part
        data.Call(prompt, [5, 6, 7], logprobs=[-0.1, -0.2, -0.3]),
        data.Call(prompt, [5, 6, 8, 9], logprobs=[-0.1, -0.2, -1.5, -0.4]),
        # the next turn of call 0: its prompt holds call 0, then a tool result
        {"prompt_ids": [*prompt, 5, 6, 7, 10, 11], "completion_ids": [12, 13],
         "logprobs": [-0.7, None]},
        data.Call([1, 2, 20], [21]),  # no log-probs
    ]
    tree = data.from_ids(calls, metadata={"task": "t7"})
    assert tree.metadata["task"] == "t7"
    assert tree.sequences == [c.ids if isinstance(c, data.Call) else
                              c["prompt_ids"] + c["completion_ids"] for c in calls]
    assert tree.loss_mask(2).tolist() == [0] * 9 + [1, 1]
    lp = tree.metadata["logprobs"]
    assert np.isnan(lp[0][:3]).all() and lp[0][3:].tolist() == [-0.1, -0.2, -0.3]
    assert np.isnan(lp[3]).all() and len(lp[3]) == 3

    batch = treefx.pack(tree)
    per_seq = rl.from_metadata(batch, "logprobs")
    assert [len(x) for x in per_seq] == [n - 1 for n in tree.sequence_lengths]
    # A trained token without a sampling log-prob (call 2's last, call 3's) is an error.
    with pytest.raises(ValueError, match="sequence 2, token 10: value nan is not finite"):
        rl.to_tree(batch, per_seq)
    calls[2] = {**calls[2], "logprobs": [-0.7, -0.05]}
    calls[3] = data.Call([1, 2, 20], [21], logprobs=[-2.0])
    tree = data.from_ids(calls)
    batch = treefx.pack(tree)
    old = rl.to_tree(batch, rl.from_metadata(batch, "logprobs"))
    expected = {  # (call, token position) -> sampled log-prob
        (0, 4): -0.1, (0, 5): -0.2, (0, 6): -0.3, (1, 4): -0.1, (1, 5): -0.2, (1, 6): -1.5,
        (1, 7): -0.4, (2, 9): -0.7, (2, 10): -0.05, (3, 3): -2.0,
        # call 2's prompt holds call 0's completion: one tree token, call 0's sample
        (2, 4): -0.1, (2, 5): -0.2, (2, 6): -0.3,
    }
    for (p, j), value in expected.items():
        assert float(old[batch.sequence_index(p)[j]]) == pytest.approx(value)
    # Tokens nobody sampled (the prompts) hold the fill, 0.
    sampled = {int(batch.sequence_index(p)[j]) for p, j in expected}
    assert float(old[[t for t in range(batch.num_tokens) if t not in sampled]].abs().sum()) == 0


def test_from_ids_disagreeing_samples_of_one_token_are_an_error():
    calls = [data.Call([1, 2], [3, 4], logprobs=[-0.1, -0.2]),
             data.Call([1, 2], [3, 5], logprobs=[-0.9, -0.2])]
    batch = treefx.pack(data.from_ids(calls))
    with pytest.raises(ValueError, match="old_logprobs disagree on a shared token"):
        rl.ppo_clip_loss(torch.zeros(batch.num_tokens), batch, [1.0, -1.0],
                         rl.from_metadata(batch, "logprobs"))


def test_from_ids_drift_branches_at_the_first_differing_id(tok):
    """The engine sampled "The answer is 84." one character a token; the agent's next call
    re-renders the chat, which tokenizes the same text with merged tokens."""
    first = CHAT[:2]
    prompt = ids_of(tok, first, add_generation_prompt=True)
    text = "The answer is 84.<|im_end|>"
    sampled = [i for ch in "The answer is 84." for i in tok(ch, add_special_tokens=False)
               ["input_ids"]] + tok.convert_tokens_to_ids(["<|im_end|>"])
    assert tok.decode(sampled) == text
    chat = [*first, {"role": "assistant", "content": "The answer is 84."},
            {"role": "user", "content": "Thanks! And 2 + 3?"}]
    next_prompt = ids_of(tok, chat, add_generation_prompt=True)
    assert tok.decode(next_prompt).startswith(tok.decode(prompt) + text)  # same text
    tree = data.from_ids([data.Call(prompt, sampled, logprobs=[-0.5] * len(sampled)),
                          data.Call(next_prompt, [5, 6])])
    branch = lcp(prompt + sampled, next_prompt)
    assert len(prompt) <= branch < len(prompt) + len(sampled) - 1  # the ids part
    assert tree.segment_lengths[0] == branch
    assert tree.num_tokens == unique_prefixes([prompt + sampled, next_prompt + [5, 6]])


@pytest.mark.parametrize("call, exc, match", [
    (dict(prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-0.1]), ValueError,
     "call 1: logprobs has 1 entries but completion_ids has 2 tokens"),
    (dict(prompt_ids=[], completion_ids=[3]), ValueError, "call 1: prompt_ids is empty"),
    (dict(prompt_ids=[1], completion_ids=[]), ValueError, "call 1: completion_ids is empty"),
    (dict(prompt_ids=[1], completion_ids=[2], logprobs=["x"]), TypeError,
     "call 1: logprobs, entry 0: 'x' is not a number"),
    (dict(prompt_ids=[1], completion_ids=[2], loss_mask=[1]), ValueError,
     r"call 1: loss_mask has 1 entries but the call has 2 tokens \(1 prompt \+ 1 completion\)"),
    (dict(prompt_ids=[1], completion_ids=[2], loss_mask=[1, 2]), ValueError,
     "call 1: loss_mask, entry 1: 2 is not 0 or 1"),
    (dict(prompt_ids=[1], completion=[2]), ValueError, r"call 1: unknown keys \['completion'\]"),
    ([1, 2, 3], TypeError, "call 1: a call must be a treefx.data.Call or a dict"),
    (dict(prompt_ids=[1, -2], completion_ids=[2]), ValueError,
     "call 1: prompt_ids, position 1: token id -2 is negative"),
])
def test_from_ids_errors_name_the_call(call, exc, match):
    with pytest.raises(exc, match=match):
        data.from_ids([data.Call([1], [2]), call])


def test_call_loss_mask_trains_only_what_the_model_sampled():
    # An agent loop as one sequence: a tool's output spliced into the completion, untrained.
    call = data.Call([1, 2], [3, 4, 50, 51, 5], logprobs=[-0.1, -0.2, None, None, -0.3],
                     loss_mask=[0, 0, 1, 1, 0, 0, 1])
    tree = data.from_ids([call])
    assert tree.loss_mask(0).tolist() == [0, 0, 1, 1, 0, 0, 1]
    batch = treefx.pack(tree)
    old = rl.to_tree(batch, rl.from_metadata(batch, "logprobs"))
    assert old.tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.3])


# ---------------------------------------------------------------------------- groups


def test_group_joins_rollouts_with_rewards_and_grpo_advantages(tok):
    # Four rollouts of one task; rollout 1 makes one call, the others two.
    question = CHAT[:2]
    answers = ["It is 84.", "84", "I think 80.", "The answer is 84."]
    rollouts = []
    for g, answer in enumerate(answers):
        done = {"role": "assistant", "reasoning_content": f"Try {g}.", "content": answer}
        if g == 1:
            rollouts.append(data.from_chats([[*question, done]], tok))
        else:
            rollouts.append(data.from_chats([CALLS[0], [*CHAT[:4], done]], tok, tools=TOOLS))
    rewards = [1.0, 1.0, 0.0, 1.0]
    tree = data.group(rollouts, rewards=rewards, task="mul-12-7")
    assert tree.sequences == [s for t in rollouts for s in t.sequences]
    assert tree.metadata["rollouts"] == (0, 0, 1, 2, 2, 3, 3)
    assert tree.metadata["rewards"].tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert tree.metadata["task"] == "mul-12-7"
    # Rollouts 0, 2, 3 made the same first call: one path in the tree.
    assert tree.num_tokens < sum(t.num_tokens for t in rollouts)

    adv = rl.grpo_advantages(tree)
    r = np.array(rewards)
    per_rollout = (r - r.mean()) / (r.std(ddof=1) + 1e-6)  # each rollout counted once
    assert adv.tolist() == pytest.approx(per_rollout[list(tree.metadata["rollouts"])].tolist())
    assert rl.grpo_advantages(tree, scale=False).tolist() == pytest.approx(
        (r - r.mean())[list(tree.metadata["rollouts"])].tolist())
    # The same group as separate trees of one task: the same advantages.
    split = [t.with_metadata(task="mul-12-7", rewards=[rewards[g]] * t.num_sequences,
                             rollouts=[0] * t.num_sequences) for g, t in enumerate(rollouts)]
    assert rl.grpo_advantages(split).tolist() == pytest.approx(adv.tolist())
    # Stored on the tree, advantages survive a partition into parts.
    stored = tree.with_metadata(advantages=adv.tolist())
    parts = treefx.partition(stored, max(stored.sequence_lengths) + 10)
    assert len(parts) > 1
    got = sorted(x for p in parts for x in rl.from_metadata(treefx.pack(p), "advantages").tolist())
    assert got == pytest.approx(sorted(adv.tolist()))


def test_group_and_advantage_errors(tok):
    a = data.from_ids([data.Call([1], [2]), data.Call([1], [3])])
    with pytest.raises(ValueError, match="rewards has 1 entries but there are 2 rollouts"):
        data.group([a, a], rewards=[1.0])
    with pytest.raises(ValueError, match="different task ids"):
        data.group([a.with_metadata(task="x"), a.with_metadata(task="y")])
    with pytest.raises(ValueError, match="tree 0 has no metadata 'rewards'"):
        rl.grpo_advantages(a)
    bad = a.with_metadata(rewards=[1.0, 0.0], rollouts=[0, 0])
    with pytest.raises(ValueError, match=r"sequences 0 and 1 are calls of one rollout \(0\) "
                                         "but carry different rewards"):
        rl.grpo_advantages(bad)
    with pytest.raises(ValueError, match=r"tree 0 of the batch has no metadata 'advantages'"):
        rl.from_metadata(treefx.pack(a), "advantages")
    # a group of one rollout, or of equal rewards: advantage 0, not NaN
    assert rl.grpo_advantages(a.with_metadata(rewards=[2.0, 2.0])).tolist() == [0.0, 0.0]
    one = data.group([a], rewards=[3.0])
    assert rl.grpo_advantages(one).tolist() == [0.0, 0.0]
    assert not any(math.isnan(x) for x in rl.grpo_advantages(one).tolist())


# ---------------------------------------------------------------------------- the README walk


def readme_walk() -> str:
    """The user guide's "From agent rollouts to a GRPO update" code block, as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text(encoding="utf-8")
    section = text.split("\n## From agent rollouts to a GRPO update\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_grpo_walk_runs_and_is_the_per_call_objective(capsys):
    torch.manual_seed(0)
    ns: dict = {"__name__": "readme_walk"}
    exec(compile(readme_walk(), "docs/guide.md (GRPO walk)", "exec"), ns)
    assert "Tree(task='mul-12-7', sequences=8" in capsys.readouterr().out
    tree, batch, model = ns["tree"], ns["batch"], ns["model"]
    assert tree.metadata["rollouts"] == (0, 0, 1, 1, 2, 2, 3, 3)
    assert batch.num_sequences == 8 and batch.reduction == "mean"

    # The same objective call by call, on the model as it was before the step: GRPO's
    # advantages from the rewards by hand, the ratio 1 (old = the same policy).
    torch.manual_seed(0)
    before = treefx.models.tiny_decoder(vocab_size=len(ns["tokenizer"]))
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), model.parameters()))
    r = np.asarray(ns["rewards"])
    adv = ((r - r.mean()) / (r.std(ddof=1) + 1e-6))[list(tree.metadata["rollouts"])]
    total = torch.zeros(())
    for p, lp in enumerate(treefx.reference.sequence_logprobs(before, tree)):
        m = torch.as_tensor(tree.loss_mask(p)[1:], dtype=lp.dtype)
        ratio = torch.exp(lp - lp.detach())
        surrogate = torch.minimum(ratio * adv[p], ratio.clamp(0.8, 1.2) * adv[p])
        total = total - (m * surrogate).sum() / m.sum()
    total = total / tree.num_sequences
    total.backward()
    assert ns["loss"].item() == pytest.approx(total.item(), abs=1e-6)
    assert sum(float(a.grad.norm()) for a in before.parameters()) > 1e-3  # a real gradient
    for (name, a), b in zip(before.named_parameters(), model.parameters()):
        err = float((a.grad - b.grad).norm() / a.grad.norm().clamp_min(1e-12))
        assert err < 1e-4, name


def test_example_grpo_from_rollouts(capsys):
    import re
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "grpo_from_rollouts.py"),
                   run_name="__main__")
    out = capsys.readouterr().out
    assert "GRPO group: 4 rollouts, 8 calls" in out
    assert float(re.search(r"max relative gradient difference ([\d.e+-]+)", out).group(1)) < 1e-4
