"""Tokenizers for ``baton data build``: a built-in byte tokenizer, Qwen3's (``qwen3``,
offline: core.data.qwen), or a local Hugging Face one.

The byte tokenizer maps UTF-8 bytes to ids 0..255 and adds one special token, EOS = 256
(vocab 257). Text is encoded with ``surrogatepass`` so that *any* Python string, lone
surrogates included, round-trips exactly: ``decode(encode(s)) == s``.

A Hugging Face tokenizer is used only when a local path is given and ``tokenizers`` (for a
``tokenizer.json`` file) or ``transformers`` (for a folder) is importable. Nothing is ever
downloaded (``Tokenizer.from_file``, ``local_files_only=True``).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from core.data.qwen import QWEN3, load_qwen3
from core.errors import UserError

logger = logging.getLogger(__name__)

BYTE = "byte"
# Looked up, in this order, to find a Hugging Face tokenizer's end-of-document token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


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


@dataclass(frozen=True, kw_only=True)
class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local file or folder."""

    name: str
    vocab_size: int
    eos_id: int
    backend: Any  # tokenizers.Tokenizer or a transformers PreTrainedTokenizer

    def encode(self, text: str) -> list[int]:
        """Text → ids, without special tokens (EOS is appended per document by the builder)."""
        if hasattr(self.backend, "encode_batch"):  # tokenizers.Tokenizer
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        return list(self.backend.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Ids → text, special tokens skipped."""
        return str(self.backend.decode([int(i) for i in ids], skip_special_tokens=True))


def _find_eos(path: Path, token_to_id: Any) -> int:
    for token in EOS_CANDIDATES:
        tid = token_to_id(token)
        if tid is not None:
            return int(tid)
    raise TokenizerError(f"{path}: no end-of-document token found (looked for {', '.join(EOS_CANDIDATES)}); "
                         "use a tokenizer that defines one, or --tokenizer byte")


def _from_tokenizer_json(path: Path) -> HFTokenizer:
    try:
        from tokenizers import Tokenizer as HFBackend  # optional: only a tokenizer.json needs it
    except ImportError:
        raise TokenizerError(f"{path}: reading a tokenizer.json needs the tokenizers library; "
                             "pip install tokenizers (or use --tokenizer byte)") from None
    try:
        backend = HFBackend.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for malformed files
        raise TokenizerError(f"{path}: not a valid tokenizer.json ({exc})") from None
    return HFTokenizer(name=str(path), vocab_size=int(backend.get_vocab_size(with_added_tokens=True)),
                       eos_id=_find_eos(path, backend.token_to_id), backend=backend)


def _from_folder(path: Path) -> HFTokenizer:
    try:
        from transformers import AutoTokenizer  # optional: only a tokenizer folder needs it
    except ImportError:
        if (path / "tokenizer.json").is_file():
            return _from_tokenizer_json(path / "tokenizer.json")
        raise TokenizerError(f"{path}: a tokenizer folder needs transformers (pip install transformers), "
                             "or pass the path of a tokenizer.json with tokenizers installed") from None
    try:
        backend = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: transformers cannot load a tokenizer from this folder "
                             f"({str(exc).splitlines()[0]})") from None
    eos = backend.eos_token_id
    if eos is None:
        eos = _find_eos(path, lambda t: backend.convert_tokens_to_ids(t) if t in backend.get_vocab() else None)
    return HFTokenizer(name=str(path), vocab_size=len(backend), eos_id=int(eos), backend=backend)


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"byte"`` → the built-in byte tokenizer; ``"qwen3"`` → Qwen3's (offline); a local
    path → a Hugging Face tokenizer."""
    if str(spec) == BYTE:
        return ByteTokenizer()
    if str(spec) == QWEN3:
        return load_qwen3()
    path = Path(spec)
    if not path.exists():
        raise TokenizerError(f"--tokenizer {spec}: no such file or folder; pass 'byte', 'qwen3' or the local path "
                             "of a tokenizer.json / tokenizer folder (nothing is downloaded)")
    tok = _from_folder(path) if path.is_dir() else _from_tokenizer_json(path)
    logger.info("tokenizer %s: vocab %d, eos %d", tok.name, tok.vocab_size, tok.eos_id)
    return tok
