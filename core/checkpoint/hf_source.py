"""What an export takes from the run besides its weights: the Hugging Face folder it was
imported from (``init_from: hf:PATH``, followed through runs started from runs), that
folder's dtype, tokenizer files and generation config.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from core.config import run as config_mod
from core.config.rl import init_from
from core.config.run import RunConfig
from core.errors import UserError

HF_PREFIX = "hf:"
# The tokenizer's files a Hugging Face folder may hold (copied where they exist).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model")
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_MAX_CHAIN = 32  # runs started from runs: a longer chain is a loop


def hf_source(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The Hugging Face folder the run's weights came from, or None (trained from scratch)."""
    seen = {Path(run_dir).resolve()}
    for _ in range(_MAX_CHAIN):
        if cfg.init_from is None:
            return None
        if cfg.init_from.startswith(HF_PREFIX):
            return Path(cfg.init_from[len(HF_PREFIX):]).expanduser()
        parent = Path(init_from(cfg.init_from)[0]).expanduser()
        if parent.resolve() in seen or not (parent / "config.yaml").is_file():
            return None  # the run it started from is gone: nothing more to learn from it
        seen.add(parent.resolve())
        cfg = config_mod.load(parent / "config.yaml")
    return None


def source_config(source: Path | None) -> dict[str, Any]:
    """The source folder's config.json ({} without a source)."""
    if source is None:
        return {}
    path = source / "config.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable ({exc}); the run was imported from {source}, which must still hold its "
                        "config.json for an export to take its dtype and tokenizer") from None


def export_dtype(source_cfg: dict[str, Any]) -> str:
    """The source's ``dtype`` (or ``torch_dtype``) for an imported run, else float32."""
    value = source_cfg.get("dtype") or source_cfg.get("torch_dtype") or "float32"
    return DTYPES.get(str(value).removeprefix("torch."), "float32")


def copy_tokenizer(source: Path | None, out: Path) -> list[str]:
    """Copy the source's tokenizer files that exist into ``out``; their names."""
    if source is None:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return copied


def generation_config(source: Path | None, config: dict[str, Any]) -> dict[str, Any]:
    """The source's generation_config.json, else the token ids of ``config`` (as transformers
    derives one from a model config)."""
    if source is not None and (source / "generation_config.json").is_file():
        try:
            return dict(json.loads((source / "generation_config.json").read_text()))
        except (OSError, ValueError) as exc:
            raise UserError(f"{source / 'generation_config.json'}: unreadable ({exc}); fix or remove it") from None
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {"_from_model_config": True, **{k: config[k] for k in keys if config.get(k) is not None}}
