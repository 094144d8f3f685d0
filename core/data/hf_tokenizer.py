"""A Hugging Face model folder's tokenizer and chat template, without transformers.

``load_hf_tokenizer(folder)`` reads what ``transformers.AutoTokenizer`` reads, with the
libraries it delegates to: ``tokenizer.json`` runs in ``tokenizers`` (the same Rust code
transformers' fast tokenizers call), the chat template (``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template``) renders in jinja2 exactly as
``apply_chat_template`` renders it: a sandboxed environment with ``trim_blocks``,
``lstrip_blocks`` and loop controls, the ``raise_exception`` and ``strftime_now`` globals,
a ``tojson`` that does not escape HTML, ``{% generation %}`` blocks, and the named special
tokens (``bos_token``, ``eos_token``, ...) as variables. Text is encoded without added
special tokens (a template writes its own ``<|im_start|>``); a special token written in
the text is that token. ``decode`` skips special tokens (transformers 5 skips
``clean_up_tokenization_spaces`` for BPE models, the only kind Baton imports).

Ids: ``eos_id`` is ``tokenizer_config.json``'s ``eos_token`` (the end of a document in
``baton data build``, the left padding of RL prompts); ``stop_ids`` are
``generation_config.json``'s ``eos_token_id`` (an int or a list: a chat model stops at
``<|im_end|>`` or ``<|eot_id|>``), else ``(eos_id,)``.

This module is the only one that imports ``tokenizers`` and ``jinja2``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

from core.errors import UserError

HF_PREFIX = "hf:"
# Looked up, in this order, when tokenizer_config.json names no eos_token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the template sees each one the folder names.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names apply_chat_template sets itself (its parameters): not template variables a config may give.
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")
Message = Mapping[str, Any]


class HFTokenizerError(UserError):
    """A Hugging Face folder whose tokenizer files are missing or unusable."""


class ChatTemplateError(HFTokenizerError):
    """A chat template that is missing, fails to render, or cannot mark assistant tokens."""


@dataclass(frozen=True, kw_only=True, eq=False)
class HFTokenizer:
    """A local Hugging Face tokenizer: core.data.tokenizer's ``Tokenizer`` plus the chat template."""

    name: str
    vocab_size: int  # the largest id + 1, added tokens included
    eos_id: int
    pad_id: int  # tokenizer_config.json's pad_token, else eos_id
    stop_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: Mapping[str, str]  # bos_token, eos_token, ... as the template sees them
    backend: Any = field(repr=False)  # tokenizers.Tokenizer
    _template: Any = field(default=None, repr=False)  # the compiled chat template

    def encode(self, text: str) -> list[int]:
        """Text → ids, no special tokens added (``build_dataset`` appends EOS per document)."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Ids → text, special tokens skipped."""
        return str(self.backend.decode([int(i) for i in ids], skip_special_tokens=True))

    def token_id(self, token: str) -> int | None:
        """The id of one token string (``<|im_end|>``, ``Ġthe``), or None."""
        tid = self.backend.token_to_id(token)
        return None if tid is None else int(tid)

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool, **variables: Any) -> str:
        """The conversation as the chat template writes it (``apply_chat_template(tokenize=False,
        **variables)``): ``variables`` are extra template variables (Qwen3's ``enable_thinking``),
        over the special tokens' names as in transformers."""
        if self._template is None:
            raise ChatTemplateError(f"{self.name}: has no chat template (no chat_template.jinja, no chat_template in "
                                    "tokenizer_config.json); give prompts as text, or use an instruct model's folder")
        if clash := sorted(set(variables) & set(RESERVED_VARIABLES)):
            raise ChatTemplateError(f"{self.name}: chat template variables {', '.join(clash)} are set by Baton "
                                    "itself; drop them from the template variables")
        try:
            return str(self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **{**self.special_tokens, **variables}))
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: a message the template cannot join
            raise ChatTemplateError(f"{self.name}: the chat template refused the conversation ({exc}); "
                                    "fix the messages (roles, order) or the template") from None

    def chat_ids(self, messages: Sequence[Message], *, add_generation_prompt: bool, **variables: Any) -> list[int]:
        """The rendered conversation's ids (``apply_chat_template(tokenize=True, **variables)``)."""
        return self.encode(self.render(messages, add_generation_prompt=add_generation_prompt, **variables))

    def sft_ids(self, messages: Sequence[Message], **variables: Any) -> tuple[list[int], list[bool]]:
        """The conversation's ids and, per id, whether it is an assistant token that carries loss.

        The ids are the whole conversation's (``chat_ids(messages, add_generation_prompt=False)``,
        one encode). Assistant message ``i`` owns what generation would produce: from where
        ``messages[:i]`` rendered with the generation prompt ends (that text must begin the
        whole conversation's, else refused) to the first stop token (``stop_ids``) after it,
        included: its content as the whole render writes it (Qwen3's empty ``<think>`` block on
        the last turn, or an earlier turn with its reasoning stripped) and its end of turn
        (``<|im_end|>``, not the newline after it). Character positions become token positions
        through the tokenizer's offsets: a token holding any generated character carries loss.
        """
        if messages and messages[0].get("role") == "assistant":  # no prompt before it to tell its tokens by
            raise ChatTemplateError(f"{self.name}: the conversation opens with an assistant message; begin it with a "
                                    "system or user message")
        text = self.render(messages, add_generation_prompt=False, **variables)
        encoding = self.backend.encode(text, add_special_tokens=False)
        ids, ends = [int(i) for i in encoding.ids], [int(end) for _, end in encoding.offsets]
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        firsts = [self._first_generated(messages, i, text, ends, variables) for i in turns]
        mask = [False] * len(ids)
        for k, (i, first) in enumerate(zip(turns, firsts, strict=True)):
            bound = firsts[k + 1] if k + 1 < len(turns) else len(ids)
            stop = next((t for t in range(first, bound) if ids[t] in self.stop_ids), None)
            if stop is None:
                names = ", ".join(repr(self.backend.id_to_token(s)) for s in self.stop_ids)
                raise ChatTemplateError(f"{self.name}: assistant messages[{i}] ends with none of the stop tokens "
                                        f"({names}) before the next turn, so its end cannot be learned; set "
                                        "generation_config.json's eos_token_id to the template's end of turn")
            mask[first: stop + 1] = [True] * (stop + 1 - first)
        return ids, mask

    def _first_generated(self, messages: Sequence[Message], i: int, text: str, ends: Sequence[int],
                         variables: Mapping[str, Any]) -> int:
        """The first token of assistant message ``i`` that generation produces in ``text``."""
        stops = {t for s in self.stop_ids if (t := self.backend.id_to_token(s)) is not None}
        held = sorted(s for s in stops for v in messages[i].values() if isinstance(v, str) and s in v)
        if held:
            raise ChatTemplateError(f"{self.name}: assistant messages[{i}] holds the stop token {held[0]!r}, where "
                                    "generation would end; remove it from the message")
        prompt = self.render(messages[:i], add_generation_prompt=True, **variables)
        if not text.startswith(prompt):
            raise ChatTemplateError(
                f"{self.name}: the chat template renders messages[:{i}] with the generation prompt otherwise than "
                "the start of the whole conversation (as Qwen3 with enable_thinking false before an earlier "
                "assistant turn), so that turn's generated tokens cannot be marked; train on conversations that "
                "end with that turn, or drop the template variable")
        return next((t for t, end in enumerate(ends) if end > len(prompt)), len(ends))


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str, where: str) -> Any:
    """A chat template compiled in transformers' environment."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{where}: the chat template is not valid jinja ({exc.message}, line {exc.lineno}); "
                                "fix the template") from None


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFTokenizerError(f"{path}: not a readable JSON file ({exc}); restore the model folder's file") from None
    if not isinstance(data, dict):
        raise HFTokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _stop_ids(folder: Path, eos_id: int, vocab_size: int) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    value = _json(path).get("eos_token_id")
    ids = [value] if isinstance(value, int) else value if isinstance(value, list) else [eos_id]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise HFTokenizerError(f"{path}: eos_token_id {value!r} is not an id or a list of ids below the tokenizer's "
                             f"{vocab_size}; fix generation_config.json")
    return tuple(dict.fromkeys(int(i) for i in ids))


def _load_backend(path: Path) -> Any:
    if not path.is_file():
        raise HFTokenizerError(f"{path}: no such file; a Hugging Face tokenizer needs the folder's tokenizer.json "
                             "(save the tokenizer with a fast tokenizer: save_pretrained writes it)")
    try:
        return Backend.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for malformed files
        raise HFTokenizerError(f"{path}: not a valid tokenizer.json ({exc})") from None


def load_hf_tokenizer(folder: str | Path) -> HFTokenizer:
    """The tokenizer of a local Hugging Face folder (``hf:PATH``, ``PATH`` or its
    ``tokenizer.json``); nothing is downloaded."""
    spec = Path(str(folder)[len(HF_PREFIX):] if str(folder).startswith(HF_PREFIX) else folder)
    tokenizer_json = spec if spec.is_file() else spec / "tokenizer.json"
    root = tokenizer_json.parent
    backend = _load_backend(tokenizer_json)
    vocab = backend.get_vocab(with_added_tokens=True)
    vocab_size = max(vocab.values(), default=-1) + 1
    config = _json(root / "tokenizer_config.json")
    legacy = _json(root / "special_tokens_map.json")
    special = {k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(k, legacy.get(k)))) is not None}
    eos_text = special.get("eos_token")
    eos = vocab.get(eos_text) if eos_text else None
    if eos is None:
        eos = next((vocab[t] for t in EOS_CANDIDATES if t in vocab), None)
    if eos is None:
        raise HFTokenizerError(f"{tokenizer_json}: no end-of-document token (tokenizer_config.json's eos_token "
                             f"{eos_text!r}, nor any of {', '.join(EOS_CANDIDATES)}); set eos_token in "
                             "tokenizer_config.json")
    pad = vocab.get(special.get("pad_token", ""), eos)
    template = _chat_template(root, config)
    return HFTokenizer(name=str(root), vocab_size=vocab_size, eos_id=int(eos), pad_id=int(pad),
                       stop_ids=_stop_ids(root, int(eos), vocab_size), chat_template=template,
                       special_tokens=special, backend=backend,
                       _template=None if template is None else compile_template(template, str(root)))
