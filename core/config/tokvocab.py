"""What the login node checks of an RL run's tokenizer, without a tokenizer library.

``rl.tokenizer`` names ``byte``, ``qwen3``, ``hf`` (the ``init_from: hf:PATH`` folder's
tokenizer; the default when ``init_from`` is ``hf:``), or a local Hugging Face folder (or its
``tokenizer.json``, ``hf:`` prefix optional). ``source`` resolves it to what
core.data.tokenizer.load_tokenizer takes. A folder's vocabulary (its largest id + 1, added
tokens included) and its token strings are read from ``tokenizer.json`` as plain JSON, so a
model vocabulary smaller than the tokenizer's ids and an ``rl.stop`` token the tokenizer
lacks are refused before anything is written. The job side loads the same files with
``tokenizers`` (core.data.hf_tokenizer).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from core.hf import families

HF = "hf"
HF_PREFIX = "hf:"
BUILTIN_VOCAB = {"byte": 257, "qwen3": 151669}  # core.data.tokenizer's built-ins


def hf_init_folder(init_from: str | None) -> str | None:
    """``init_from: hf:PATH`` → PATH (``~`` expanded); anything else → None."""
    folder = None if init_from is None else families.split_source(init_from)
    return None if folder is None else str(Path(folder).expanduser())


def source(tokenizer: str | None, init_from: str | None) -> str:
    """``rl.tokenizer`` resolved: ``byte``, ``qwen3`` or ``hf:FOLDER`` (``None``: ``hf`` when
    ``init_from`` is ``hf:``, else ``byte``)."""
    folder = hf_init_folder(init_from)
    if tokenizer is None:
        tokenizer = HF if folder is not None else "byte"
    if tokenizer == HF:
        if folder is None:
            raise ConfigError(f"rl.tokenizer: hf reads the tokenizer of init_from: hf:PATH, but init_from is "
                              f"{init_from!r}; set init_from: hf:PATH, or give rl.tokenizer a tokenizer folder")
        return HF_PREFIX + folder
    if tokenizer in BUILTIN_VOCAB:
        return tokenizer
    return tokenizer if tokenizer.startswith(HF_PREFIX) else HF_PREFIX + tokenizer


@dataclass(frozen=True)
class Vocab:
    size: int  # the largest id + 1
    ids: dict[str, int]  # token string → id (empty for the built-ins)


def has_tokenizer(folder: str | None) -> bool:
    """Whether ``folder`` (a model folder) holds a Hugging Face tokenizer (its ``tokenizer.json``)."""
    return folder is not None and _tokenizer_json(folder).is_file()


def _tokenizer_json(folder: str) -> Path:
    path = Path(folder)
    return path if path.is_file() else path / "tokenizer.json"


def read_vocab(spec: str) -> Vocab:
    """The vocabulary of a resolved ``source``; a folder's from its ``tokenizer.json``."""
    if spec in BUILTIN_VOCAB:
        return Vocab(size=BUILTIN_VOCAB[spec], ids={})
    folder = spec[len(HF_PREFIX):]
    if not Path(folder).exists():
        raise ConfigError(f"rl.tokenizer: {folder!r} is neither byte, qwen3, hf nor an existing local tokenizer "
                          "folder (nothing is downloaded)")
    path = _tokenizer_json(folder)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"rl.tokenizer: {path} does not exist; give a Hugging Face folder with its tokenizer.json "
                          "(nothing is downloaded), byte or qwen3") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"rl.tokenizer: {path} is not a readable tokenizer.json ({exc}); restore the file") from None
    ids = _model_vocab(data.get("model") if isinstance(data, dict) else None)
    for added in (data.get("added_tokens") or []) if isinstance(data, dict) else []:
        if isinstance(added, dict) and isinstance(added.get("content"), str) and isinstance(added.get("id"), int):
            ids[added["content"]] = added["id"]
    if not ids:
        raise ConfigError(f"rl.tokenizer: {path} holds no vocabulary; give a tokenizer.json saved by a fast tokenizer")
    return Vocab(size=max(ids.values()) + 1, ids=ids)


def _model_vocab(model: Any) -> dict[str, int]:
    """BPE and WordPiece keep ``{token: id}``; Unigram a list of ``[token, score]`` in id order."""
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        return {str(k): int(v) for k, v in vocab.items() if isinstance(v, int)}
    if isinstance(vocab, list):
        return {str(entry[0]): i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry}
    return {}


def check(tokenizer: str | None, init_from: str | None, stop: tuple[int | str, ...] | None, *,
          vocab_size: int) -> None:
    """The tokenizer exists and fits ``model.vocab_size``; every ``rl.stop`` token is one of its own."""
    spec = source(tokenizer, init_from)
    vocab = read_vocab(spec)
    name = spec if spec in BUILTIN_VOCAB else spec[len(HF_PREFIX):]
    if vocab.size > vocab_size:
        raise ConfigError(f"rl.tokenizer: {name} has {vocab.size} tokens > model.vocab_size = {vocab_size}; "
                          f"raise model.vocab_size to at least {vocab.size}")
    if stop is None:
        return
    if not stop:
        raise ConfigError("rl.stop: an empty list stops nothing; drop rl.stop (the tokenizer's stop tokens) or "
                          "name tokens")
    bad_ids = [t for t in stop if isinstance(t, int) and not 0 <= t < vocab.size]
    unknown = [t for t in stop if isinstance(t, str) and t not in vocab.ids]
    if bad_ids:
        raise ConfigError(f"rl.stop: {_some(map(str, bad_ids))} not an id of {name} (0..{vocab.size - 1}); "
                          "give ids below its vocabulary")
    if unknown and not vocab.ids:
        raise ConfigError(f"rl.stop: token strings ({_some(map(repr, unknown))}) need a Hugging Face tokenizer; "
                          f"{name} takes ids (its end of text: the tokenizer's stop)")
    if unknown:
        raise ConfigError(f"rl.stop: {_some(map(repr, unknown))} not a token of {name}; give tokens of its "
                          "vocabulary (as tokenizer.json writes them: <|im_end|>, <|eot_id|>) or ids")


def _some(items: Iterable[str], most: int = 8) -> str:
    """At most ``most`` items, and how many more."""
    shown = list(items)
    more = f" and {len(shown) - most} more" if len(shown) > most else ""
    return ", ".join(shown[:most]) + more
