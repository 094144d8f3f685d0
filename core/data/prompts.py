"""RL prompts from a file: ``rl.task: file`` reads ``rl.prompts`` (JSONL or Parquet) once, on
the controller.

Every record is one prompt: its ``rl.prompt_key`` field is either text, tokenized with
``rl.tokenizer`` (``byte``, ``qwen3`` offline, or a Hugging Face folder's), or chat messages
(a list of ``{role, content}``), rendered with the Hugging Face tokenizer's chat template, its
generation prompt and the ``rl.chat_template_kwargs`` variables (``HFTokenizer.chat_ids(messages,
add_generation_prompt=True, **kwargs)``, as ``apply_chat_template`` gives them). The ids are
**left-padded** with the tokenizer's end-of-text id to ``rl.prompt_length`` (the response
follows the prompt's last token). A prompt longer than that is refused naming its record: a
silently cut prompt asks a different question. Each prompt keeps its pad count, and the RL
calls carry it so that the model never sees the pads (core.model.gpt.padding). Every other
field of the record is the prompt's metadata, handed to the reward with ``prompt_text`` (the
text, or the rendered conversation; chat prompts also keep their
``messages``) and, per response, ``response_text``.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.data.tokenizer import Tokenizer
from core.errors import UserError


class PromptFileError(UserError):
    """A prompts file that cannot be read as the config says."""


@dataclass(frozen=True)
class Prompt:
    tokens: tuple[int, ...]  # left-padded to the prompt length
    meta: dict[str, Any]
    pad: int = 0  # the leading pad tokens of ``tokens``


def _jsonl(path: Path, what: str) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise PromptFileError(f"{what}: {path}:{lineno}: not a UTF-8 JSON object ({exc}); "
                                      "each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise PromptFileError(f"{what}: {path}:{lineno}: expected a JSON object, "
                                      f"got {type(record).__name__}")
            yield f"{path}:{lineno}", record


def _parquet(path: Path, what: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq  # optional: only .parquet prompts need it
    except ImportError:
        raise PromptFileError(f"{what}: {path}: reading .parquet needs pyarrow; pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid (an Exception) for non-parquet files
        raise PromptFileError(f"{what}: {path}: not a readable parquet file ({exc})") from None
    for i, record in enumerate(table.to_pylist()):
        yield f"{path} row {i}", record


def records(path: Path, what: str = "rl.prompts") -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) of every record of ``path``, in order; ``what`` (the config key that named
    the file) begins every refusal."""
    if path.suffix == ".jsonl":
        return _jsonl(path, what)
    if path.suffix == ".parquet":
        return _parquet(path, what)
    raise PromptFileError(f"{what}: {path}: unknown extension {path.suffix!r}; give a .jsonl or .parquet file")


def _messages(value: Any) -> list[dict[str, Any]] | None:
    """A chat prompt's messages, or None when ``value`` is not a list of {role, content}."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value):
        return None
    return [dict(m) for m in value]


def _ids(where: str, key: str, value: Any, tokenizer: Tokenizer, variables: Mapping[str, Any],
         what: str = "rl.prompts") -> tuple[Sequence[int], str, dict[str, Any]]:
    """A record's prompt: its ids, its text, what it adds to the metadata."""
    if isinstance(value, str):
        return tokenizer.encode(value), value, {}
    messages = _messages(value)
    if messages is None:
        raise PromptFileError(f"{what}: {where}: field {key!r} is {type(value).__name__}, neither text nor chat "
                              "messages (a list of {role, content}); fix the record or set rl.prompt_key")
    render = getattr(tokenizer, "render", None)
    if render is None:
        raise PromptFileError(f"{what}: {where}: chat messages need a tokenizer with a chat template; "
                              f"{tokenizer.name} has none: set rl.tokenizer to hf (init_from: hf:PATH) or a "
                              "Hugging Face folder")
    text = render(messages, add_generation_prompt=True, **variables)
    return tokenizer.encode(text), text, {"messages": messages}


def read_prompts(path: str | Path, *, key: str, tokenizer: Tokenizer, length: int,
                 template_variables: Mapping[str, Any] | None = None, what: str = "rl.prompts") -> list[Prompt]:
    """Every prompt of the file, tokenized and left-padded to ``length``; chat prompts are
    rendered with ``template_variables`` (``rl.chat_template_kwargs``). ``what``: the key
    that named the file (``rl.prompts``, ``rl.val_prompts``), first in every refusal."""
    path = Path(path)
    out = []
    try:
        for where, record in records(path, what):
            if key not in record:
                fields = ", ".join(sorted(map(str, record))[:8]) or "none"
                raise PromptFileError(f"{what}: {where}: no field {key!r} (fields: {fields}); set "
                                      "rl.prompt_key to the field that holds the prompt")
            ids, text, extra = _ids(where, key, record[key], tokenizer, template_variables or {}, what)
            if len(ids) > length:
                raise PromptFileError(f"{what}: {where}: the prompt is {len(ids)} tokens > rl.prompt_length = "
                                      f"{length}; raise rl.prompt_length (and model.seq_length) or shorten it")
            meta = {k: v for k, v in record.items() if k != key}
            meta.update(extra, prompt_text=text)
            pad = length - len(ids)
            out.append(Prompt(tokens=(tokenizer.eos_id,) * pad + tuple(ids), meta=meta, pad=pad))
    except OSError as exc:
        raise PromptFileError(f"{what}: {path}: cannot read ({exc.strerror or exc})") from None
    if not out:
        raise PromptFileError(f"{what}: {path}: holds no prompt; give a file with at least one record")
    return out
