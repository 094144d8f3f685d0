"""Supervised fine-tuning on chat data: ``program: sft`` and the ``sft`` section.

``program: sft`` is pretraining's loop (checkpoints, resume, layouts, reports) with another
batch source: the conversations of ``data`` (JSONL or Parquet; each record's
``messages_key`` field a list of ``{role, content}``), each rendered with the chat template of
``tokenizer`` into ids and an assistant mask (core.data.sft), one conversation per row,
right-padded to ``model.seq_length`` + 1 tokens. The loss is the cross entropy of the
assistant tokens only, averaged over the assistant tokens of the whole global batch
(core.model.gpt.step), so it does not depend on dp, the micro batch or tp/pp.

``tokenizer``: ``hf`` (the tokenizer of ``init_from: hf:FOLDER``), a local Hugging Face
tokenizer folder (``hf:`` prefix optional: core.data.hf_tokenizer), or ``byte`` (UTF-8 bytes with a built-in plain chat format: demos and tests).
``too_long``: a conversation of more than ``model.seq_length`` + 1 tokens is refused naming its
record (``refuse``, the default: a silently cut conversation teaches a different answer),
left out (``drop``) or cut at the end (``truncate``). ``chat_template_kwargs``: extra variables of the chat
template (as ``rl.chat_template_kwargs``: Qwen3's ``enable_thinking: false``). Every check that reads the file runs
on the login node at submit (core.data.sft.check), before anything is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from core.config.inputs import check_file
from core.config.rl import check_template_variables
from core.config.tokvocab import HF_PREFIX, hf_init_folder
from core.errors import ConfigError

BYTE = "byte"  # the built-in byte tokenizer's name (core.data.sft.ByteChat)
FROM_INIT = "hf"  # the tokenizer of init_from: hf:FOLDER


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    data: str | None = None  # a .jsonl or .parquet file of conversations
    messages_key: str = "messages"
    tokenizer: str = FROM_INIT  # hf (init_from's), byte, or a local tokenizer folder
    too_long: Literal["refuse", "drop", "truncate"] = "refuse"
    # extra chat template variables (e.g. Qwen3's enable_thinking: false), as rl.chat_template_kwargs
    chat_template_kwargs: dict[str, bool | int | str | float | None] = field(default_factory=dict)


def tokenizer_path(sft: SFTConfig, init_from: str | None) -> str:
    """What ``sft.tokenizer`` names: ``byte``, or a local folder (``hf`` resolved to init_from's)."""
    if sft.tokenizer != FROM_INIT:
        return sft.tokenizer.removeprefix(HF_PREFIX)
    folder = hf_init_folder(init_from)
    if folder is None:
        raise ConfigError(f"sft.tokenizer: 'hf' reads the tokenizer of init_from: hf:FOLDER, but init_from is "
                          f"{init_from!r}; give sft.tokenizer a local tokenizer folder (or byte)")
    return folder


def check(sft: SFTConfig, *, program: str, init_from: str | None) -> None:
    """The section against ``program``: read only with ``program: sft``, which needs a data file
    and a tokenizer that exists (what the file holds is checked at submit: core.data.sft)."""
    if program != "sft":
        if sft != SFTConfig():
            raise ConfigError(f"sft: read only with program: sft (now {program!r}); set program=sft or drop "
                              "the sft section")
        return
    if sft.data is None:
        raise ConfigError("sft.data: program: sft needs a .jsonl or .parquet file of conversations")
    check_file("sft.data", sft.data, "give a .jsonl or .parquet file of conversations")
    if not sft.messages_key:
        raise ConfigError("sft.messages_key: empty; name the field of each record that holds its messages")
    path = tokenizer_path(sft, init_from)
    if path != BYTE and not Path(path).is_dir():
        raise ConfigError(f"sft.tokenizer: {path!r} is neither byte nor an existing local tokenizer folder "
                          "(nothing is downloaded)")
    check_template_variables("sft.chat_template_kwargs", sft.chat_template_kwargs)
    if path == BYTE and sft.chat_template_kwargs:
        raise ConfigError("sft.chat_template_kwargs: the byte tokenizer has no chat template to pass them to; drop "
                          "them or give sft.tokenizer a Hugging Face folder")
