"""Small Hugging Face tokenizer folders built locally (nothing downloaded), as real model
folders hold them: a byte-level BPE trained with ``tokenizers`` on a few sentences, with the
model family's pre-tokenizer, saved by transformers' ``PreTrainedTokenizerFast.save_pretrained``
with a chat template and the family's ``tokenizer_class``, and a ``generation_config.json``
written by transformers' ``GenerationConfig``.

``chatml_folder``: Qwen2.5-style (NFC, Qwen's split pattern: single digits;
``tokenizer_class: Qwen2Tokenizer``, which transformers 5 rebuilds from the vocabulary and
merges with Qwen's own pipeline; ``<|im_start|>role\\n...<|im_end|>\\n``, a default system
message, eos ``<|im_end|>``, pad ``<|endoftext|>``). ``llama3_folder``: Llama-3-style (digits
in threes; ``PreTrainedTokenizerFast``: tokenizer.json as is; ``<|begin_of_text|>`` as bos,
``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``, roles checked with
``raise_exception``). ``qwen3_folder``: Qwen3's (ChatML's tokens plus ``<think>``,
``</think>`` and the tool tags as plain added tokens, Qwen3's own chat template verbatim,
stop tokens ``<|im_end|>`` and ``<|endoftext|>``). The ChatML and Llama 3 templates mark assistant content with
``{% generation %}``, so transformers' ``return_assistant_tokens_mask`` is an independent
reference for the assistant mask.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. How can I help you today?",
    "Hello! What is two plus two? Two plus two is four.",
    "héllo wörld, naïve café — 你好，世界 🎉 ça va?",
    "def add(a, b):\n    return a + b\n",
    "In 2024 there were 1234567 tokens; I'LL count 3.14159 of them.",
]
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
              r"""\s+(?!\S)|\s+""")
LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if loop.first and message['role'] == 'system' %}{% continue %}{% endif %}\n"
    "{%- if message['role'] == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
# Qwen3's chat template (Qwen/Qwen3-8B's tokenizer_config.json), verbatim: tools in the system
# header; the last user query found by walking the messages backwards; an assistant turn's
# reasoning (``reasoning_content``, or its content before ``</think>``) kept only on turns after
# the last query, the last turn always written with its (maybe empty) ``<think>`` block;
# ``enable_thinking=false`` adds an empty think block to the generation prompt.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
# Qwen3's added tokens that are not special: they stay in decoded text.
QWEN3_TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role'] | tojson) }}{%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}\n"
    "    {%- else %}\n"
    "        {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)


def _bpe(specials: list[str], split: str, *, nfc: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return tok


def chatml_folder(folder: Path, *, eos_token_id: int | list[int] | None = None,
                  template: str = CHATML_TEMPLATE) -> Path:
    """A Qwen-style folder; ``eos_token_id`` (default: ``<|im_end|>``'s) goes to generation_config.json."""
    backend = _bpe(CHATML_SPECIALS, QWEN_SPLIT, nfc=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(folder)
    _set_class(folder, "Qwen2Tokenizer")
    eos = backend.token_to_id("<|im_end|>") if eos_token_id is None else eos_token_id
    GenerationConfig(eos_token_id=eos, pad_token_id=backend.token_to_id("<|endoftext|>")).save_pretrained(folder)
    return folder


def qwen3_folder(folder: Path) -> Path:
    """A Qwen3-style folder: ChatML's special tokens, the think and tool tags as added tokens
    that are not special, Qwen3's chat template, eos ``<|im_end|>``, pad ``<|endoftext|>`` and
    generation_config.json's eos list ``[<|im_end|>, <|endoftext|>]``."""
    backend = _bpe(CHATML_SPECIALS, QWEN_SPLIT, nfc=True)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_TEXT_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN3_TEMPLATE
    fast.save_pretrained(folder)
    _set_class(folder, "Qwen2Tokenizer")
    end, eot = backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")
    GenerationConfig(eos_token_id=[end, eot], pad_token_id=eot).save_pretrained(folder)
    return folder


def llama3_folder(folder: Path) -> Path:
    """A Llama-3-Instruct-style folder: bos ``<|begin_of_text|>``, eos ``<|eot_id|>``, and
    generation_config.json's eos list ``[<|end_of_text|>, <|eot_id|>]``."""
    backend = _bpe(LLAMA3_SPECIALS, LLAMA3_SPLIT, nfc=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    fast.chat_template = LLAMA3_TEMPLATE
    fast.save_pretrained(folder)
    _set_class(folder, "PreTrainedTokenizerFast")
    GenerationConfig(bos_token_id=backend.token_to_id("<|begin_of_text|>"),
                     eos_token_id=[backend.token_to_id("<|end_of_text|>"), backend.token_to_id("<|eot_id|>")]
                     ).save_pretrained(folder)
    return folder


def _set_class(folder: Path, name: str) -> None:
    """tokenizer_config.json's tokenizer_class, as the model family's folders write it."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = name
    path.write_text(json.dumps(config, indent=2))


QWEN_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


def with_qwen_ids(folder: Path) -> Path:
    """``folder``'s ChatML special tokens moved to Qwen2/3's own ids (151643-151645), so the
    real generation_config.json's eos ids name them; the rest of the small vocabulary stays."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    for token in data["added_tokens"]:
        token["id"] = QWEN_SPECIAL_IDS.get(token["content"], token["id"])
    vocab = data["model"]["vocab"]
    vocab.update({k: v for k, v in QWEN_SPECIAL_IDS.items() if k in vocab})
    path.write_text(json.dumps(data))
    return folder
