"""A small chat tokenizer built offline, for tests and examples: a byte-level BPE trained on a few
lines of text, with a Qwen3-style chat template (``<think>`` reasoning, tool calls, tool
results).

The template follows Qwen3's rules: an assistant message after the last user query (the current
tool-calling loop) keeps its reasoning as ``<think>\\n...\\n</think>\\n\\n``; earlier ones drop
it, so the calls of a multi-turn agent share their prefix within a tool loop and branch at the
first assistant message when a new user turn starts. ``{% generation %}`` marks each assistant
message from after its header through ``<|im_end|>``, for ``return_assistant_tokens_mask``.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["QWEN3_STYLE_TEMPLATE", "tiny_chat_tokenizer"]

QWEN3_STYLE_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call one, write <tool_call>\n' }}
    {{- '{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content %}
        {%- if reasoning is not string %}{%- set reasoning = '' %}{%- endif %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""".strip()

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added (not special) tokens, as in Qwen3's tokenizer: decoded as text, never split by the BPE.
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                "</tool_response>")

_DEFAULT_CORPUS = (
    "You are a helpful assistant. Think step by step, then answer.",
    "What is 2 + 3? Let me add the numbers: 2 + 3 = 5. The answer is 5.",
    "What is 12 * 7? I will call the calculator. The result is 84.",
    "The weather in Paris is sunny, 21 degrees. In Berlin it rains.",
    '{"name": "calculator", "arguments": {"expression": "12 * 7"}}',
    '{"name": "search", "arguments": {"query": "weather in Paris"}}',
    "Okay, the user wants the sum. First add the tens, then the ones.",
    "Hello! How can I help you today? Thanks, that is all.",
)


def tiny_chat_tokenizer(corpus: Iterable[str] | None = None, *, vocab_size: int = 400,
                        generation_markers: bool = True, split_words: bool = True):
    """A small chat tokenizer built offline: a byte-level BPE with a Qwen3-style chat template.

    A ``transformers.PreTrainedTokenizerFast`` with a byte-level BPE trained on ``corpus``
    (default: a few built-in lines) and :data:`QWEN3_STYLE_TEMPLATE` as its chat template.

    ``generation_markers=False`` removes ``{% generation %}`` from the template (what
    :func:`treefx.data.from_chats` does without them is its documented fallback).
    ``split_words=False`` trains and tokenizes without splitting text at words and
    whitespace first, so merges may span them (``"\\nThe"`` can be one token): then the same
    text tokenized alone or inside a longer text may give different tokens. Needs
    ``tokenizers`` and ``transformers``; builds in well under a second, offline.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = list(_DEFAULT_CORPUS if corpus is None else corpus)
    if not lines or not all(isinstance(t, str) for t in lines):
        raise ValueError("corpus must be a non-empty list of strings")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    template = QWEN3_STYLE_TEMPLATE
    if not generation_markers:
        template = template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=template,
    )
