"""Tokenizers for ``baton data build``: a built-in byte tokenizer, Qwen3's (``qwen3``,
offline: core.data.qwen), or a local Hugging Face one.

The byte tokenizer maps UTF-8 bytes to ids 0..255 and adds one special token, EOS = 256
(vocab 257). Text is encoded with ``surrogatepass`` so that *any* Python string, lone
surrogates included, round-trips exactly: ``decode(encode(s)) == s``.

A Hugging Face tokenizer (core.data.hf_tokenizer: ``tokenizers`` and jinja2, not
transformers) is read from a local folder or its ``tokenizer.json``, given as ``hf:PATH`` or
``PATH``. Nothing is ever downloaded.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from core.data.qwen import QWEN3, load_qwen3
from core.errors import UserError

logger = logging.getLogger(__name__)

BYTE = "byte"


class TokenizerError(UserError):
    """A tokenizer path or library is missing or unusable."""


class Tokenizer(Protocol):
    """What ``build_dataset`` needs from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, kw_only=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOS = 256."""

    name: str = BYTE
    vocab_size: int = 257
    eos_id: int = 256

    def encode(self, text: str) -> list[int]:
        """Text → byte ids (no EOS; ``build_dataset`` appends one per document)."""
        return list(text.encode("utf-8", errors="surrogatepass"))

    def decode(self, ids: Sequence[int], *, errors: str = "surrogatepass") -> str:
        """Byte ids → text, skipping special tokens.

        Exact for ids that ``encode`` produced. A window cut inside a multi-byte
        character raises ``UnicodeDecodeError``; pass ``errors="replace"`` to show it anyway.
        """
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors=errors)


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"byte"`` → the built-in byte tokenizer; ``"qwen3"`` → Qwen3's (offline); ``hf:PATH``
    or a local path (a model folder or its tokenizer.json) → a Hugging Face tokenizer with its
    chat template (core.data.hf_tokenizer)."""
    if str(spec) == BYTE:
        return ByteTokenizer()
    if str(spec) == QWEN3:
        return load_qwen3()
    text = str(spec)
    path = Path(text[3:] if text.startswith("hf:") else text)
    if not path.exists():
        raise TokenizerError(f"--tokenizer {spec}: no such file or folder; pass 'byte', 'qwen3' or the local path "
                             "of a tokenizer.json / tokenizer folder (nothing is downloaded)")
    from core.data.hf_tokenizer import load_hf_tokenizer  # tokenizers and jinja2: only a HF tokenizer needs them

    tok = load_hf_tokenizer(path)
    logger.info("tokenizer %s: vocab %d, eos %d", tok.name, tok.vocab_size, tok.eos_id)
    return tok


def stop_ids(tok: Tokenizer, stop: Sequence[int | str] | None) -> tuple[int, ...]:
    """``rl.stop`` resolved on ``tok``: None → the tokenizer's own stop tokens (a Hugging Face
    folder's ``stop_ids``: generation_config.json's ``eos_token_id``; else its end of text);
    ids are kept, token strings looked up in a Hugging Face tokenizer; an unknown one is
    refused naming it."""
    if stop is None:
        return tuple(getattr(tok, "stop_ids", (tok.eos_id,)))
    lookup = getattr(tok, "token_id", None)
    found: list[int] = []
    unknown: list[str] = []
    for token in stop:
        tid = token if isinstance(token, int) else lookup(token) if lookup is not None else None
        if tid is None or not 0 <= tid < tok.vocab_size:
            unknown.append(repr(token))
        else:
            found.append(tid)
    if unknown or not found:
        raise TokenizerError(f"rl.stop: {', '.join(unknown) or 'an empty list'}: not a token of {tok.name}; give "
                             "its tokens (as tokenizer.json writes them: <|im_end|>) or ids below its vocabulary")
    return tuple(dict.fromkeys(found))


def text_before_stop(tok: Tokenizer, stop: Sequence[int], ids: Sequence[int]) -> str:
    """A response's text for the reward (``response_text``) and samples.jsonl: its ids up to
    its first stop token, the stop token itself excluded (what follows it never reaches the
    reward), special tokens skipped; bytes that are no UTF-8 (a byte tokenizer's) as U+FFFD."""
    end = next((i for i, t in enumerate(ids) if t in stop), len(ids))
    body = [int(t) for t in ids[:end]]
    try:
        return tok.decode(body)
    except UnicodeDecodeError:  # only the byte tokenizer raises: a model may emit bytes that are no UTF-8
        return ByteTokenizer().decode(body, errors="replace")
