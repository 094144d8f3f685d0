"""Chat data for ``program: sft``: a file of conversations, tokenized with a chat template.

Each record of ``sft.data`` (JSONL or Parquet, read by core.data.prompts.records) holds in its
``sft.messages_key`` field a conversation: a non-empty list of ``{"role": str, "content": str}``.
The chat tokenizer renders it into ids and an assistant mask (1 on every id the assistant
writes, its end-of-turn token included): a Hugging Face tokenizer folder's chat template
(core.data.hf_tokenizer.load_hf_tokenizer), or ``byte`` (``ByteChat``: a plain byte format).

The row trained on is ``ids[:-1]`` predicting ``ids[1:]``, so a conversation fits
``model.seq_length`` when it has at most seq_length + 1 ids; a longer one is refused naming its
record (``too_long: refuse``), left out (``drop``) or cut (``truncate``). A conversation with
no assistant id left to predict teaches nothing and is refused (its denominator would be 0).
``check`` runs all of this on the login node at submit, and the run folder keeps what it read
(``FROZEN``: ids, masks and records as one .npz, ``to_bytes`` / ``load``): the workers of every
allocation train on exactly the conversations submit checked, tokenized once, even if the
file changes later (a resume stays bit for bit).
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from core.data.prompts import PromptFileError, records
from core.errors import UserError

KEY = "sft.data"
BYTE = "byte"
FROZEN = "sft_data.npz"  # in the run folder: the conversations submit read


class ConversationFileError(UserError):
    """A conversations file that cannot be trained on as the config says."""


class ChatTokenizer(Protocol):
    """What SFT needs from a tokenizer: a conversation's ids and assistant mask."""

    eos_id: int
    vocab_size: int

    def sft_ids(self, messages: Sequence[dict[str, Any]], **variables: Any) -> tuple[list[int], list[int]]: ...


@dataclass(frozen=True, kw_only=True)
class ByteChat:
    """UTF-8 bytes (ids 0..255) with EOS = 256 ending every turn; a turn is ``<|role|>\\n`` then
    its content then EOS. The assistant's content and its EOS are the assistant's ids."""

    vocab_size: int = 257
    eos_id: int = 256

    def sft_ids(self, messages: Sequence[dict[str, Any]], **variables: Any) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        for m in messages:
            head = list(f"<|{m['role']}|>\n".encode("utf-8", errors="surrogatepass"))
            body = [*m["content"].encode("utf-8", errors="surrogatepass"), self.eos_id]
            ids += head + body
            mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
        return ids, mask


def load_chat_tokenizer(name: str) -> ChatTokenizer:
    """``byte`` or a local Hugging Face tokenizer folder (its chat template); nothing downloaded."""
    if name == BYTE:
        return ByteChat()
    from core.data.hf_tokenizer import load_hf_tokenizer  # tokenizers and jinja2 only for a tokenizer folder

    return load_hf_tokenizer(name)  # type: ignore[no-any-return]


@dataclass(frozen=True, kw_only=True)
class Conversations:
    """A file's conversations as ids (int64) and assistant masks (bool), in file order."""

    ids: list[np.ndarray] = field(repr=False)
    masks: list[np.ndarray] = field(repr=False)
    where: list[str] = field(repr=False)  # each one's record: "FILE:LINE" or "FILE row I"
    eos_id: int
    vocab_size: int
    dropped: int = 0  # too_long: drop

    def __len__(self) -> int:
        return len(self.ids)


def _messages(where: str, record: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The record's conversation, or one line naming the record and what is wrong with it."""
    if key not in record:
        fields = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise ConversationFileError(f"{KEY}: {where}: no field {key!r} (fields: {fields}); set sft.messages_key to "
                                    "the field that holds the messages")
    messages = record[key]
    fix = f"each record's {key!r} must be a non-empty list of {{role, content}} messages with text content"
    if not isinstance(messages, list) or not messages:
        raise ConversationFileError(f"{KEY}: {where}: {key!r} is {type(messages).__name__}"
                                    f"{' (empty)' if messages == [] else ''}, not a conversation; {fix}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConversationFileError(f"{KEY}: {where}: message {i} of {key!r} is not a {{role, content}} message "
                                        f"of text ({str(m)[:60]!r}); {fix}")
    return messages


def read_conversations(path: str | Path, *, key: str, tokenizer: ChatTokenizer, seq_length: int,
                       too_long: str = "refuse", variables: dict[str, Any] | None = None) -> Conversations:
    """Every conversation of ``path``, tokenized, fitted to ``seq_length`` (``too_long``)."""
    path, limit = Path(path), seq_length + 1
    ids_out: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    where_out: list[str] = []
    dropped = 0
    try:
        for where, record in records(path, KEY):
            messages = _messages(where, record, key)
            try:
                ids, mask = tokenizer.sft_ids(messages, **(variables or {}))
            except UserError as exc:  # a chat template that refuses this conversation: name the record
                raise ConversationFileError(f"{KEY}: {where}: {exc}") from None
            cut = False
            if len(ids) != len(mask):
                raise ConversationFileError(f"{KEY}: {where}: the tokenizer gave {len(ids)} ids but {len(mask)} "
                                            "mask entries; check sft.tokenizer's chat template")
            if len(ids) > limit:
                if too_long == "drop":
                    dropped += 1
                    continue
                if too_long != "truncate":
                    raise ConversationFileError(
                        f"{KEY}: {where}: the conversation is {len(ids)} tokens > model.seq_length + 1 = {limit}; "
                        "raise model.seq_length, shorten it, or set sft.too_long=drop (or truncate)")
                ids, mask, cut = ids[:limit], mask[:limit], True
            if not any(mask[1:]):
                raise ConversationFileError(f"{KEY}: {where}: no assistant token to learn from "
                                            f"({'none left after truncation' if cut else 'no assistant turn'}); "
                                            "give each conversation an assistant message, or remove it")
            ids_out.append(np.asarray(ids, dtype=np.int64))
            masks.append(np.asarray(mask, dtype=bool))
            where_out.append(where)
    except PromptFileError as exc:
        raise ConversationFileError(str(exc)) from None
    except OSError as exc:
        raise ConversationFileError(f"{KEY}: {path}: cannot read ({exc.strerror or exc})") from None
    if not ids_out:
        why = f" ({dropped} dropped as too long)" if dropped else ""
        raise ConversationFileError(f"{KEY}: {path}: holds no conversation to train on{why}; give a file with at "
                                    "least one")
    return Conversations(ids=ids_out, masks=masks, where=where_out, eos_id=tokenizer.eos_id,
                         vocab_size=tokenizer.vocab_size, dropped=dropped)


def check(path: str, *, key: str, tokenizer: str, seq_length: int, vocab_size: int, too_long: str,
          variables: dict[str, Any] | None = None) -> Conversations:
    """The login node's check of ``program: sft``'s input: the tokenizer loads, the model's
    vocabulary holds it, every record is a conversation that fits. The conversations."""
    tok = load_chat_tokenizer(tokenizer)
    if tok.vocab_size > vocab_size:
        raise ConversationFileError(f"sft.tokenizer: {tokenizer} has {tok.vocab_size} tokens > model.vocab_size = "
                                    f"{vocab_size}; raise model.vocab_size to at least {tok.vocab_size}")
    return read_conversations(path, key=key, tokenizer=tok, seq_length=seq_length, too_long=too_long,
                              variables=variables)


def to_bytes(conv: Conversations) -> bytes:
    """``conv`` as one .npz (no pickle): the ids and masks end to end with their offsets."""
    buf = io.BytesIO()
    np.savez(buf, ids=np.concatenate(conv.ids), masks=np.concatenate(conv.masks),
             offsets=np.cumsum([0] + [len(i) for i in conv.ids]), where=np.array(conv.where, dtype=str),
             meta=np.array([conv.eos_id, conv.vocab_size, conv.dropped], dtype=np.int64))
    return buf.getvalue()


def load(path: str | Path) -> Conversations:
    """The conversations ``to_bytes`` wrote to ``path``."""
    try:
        with np.load(path, allow_pickle=False) as f:
            ids, masks, offsets, where, meta = (f[k] for k in ("ids", "masks", "offsets", "where", "meta"))
    except (OSError, KeyError, ValueError) as exc:
        raise ConversationFileError(f"{path}: not the conversations submit saved ({exc}); submit the run again") from None
    cuts = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
    return Conversations(ids=[ids[a:b] for a, b in cuts], masks=[masks[a:b] for a, b in cuts],
                         where=[str(w) for w in where], eos_id=int(meta[0]), vocab_size=int(meta[1]),
                         dropped=int(meta[2]))
