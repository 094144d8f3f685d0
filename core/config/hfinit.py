"""``init_from: hf:PATH``: the model section is the checkpoint folder's config.json.

When a config is loaded, ``fill_model`` puts the folder's shape into the model section (the
user writes no shape keys); a ``model.*`` key the user also gives must agree with it, and
``model.seq_length`` stays the user's, at most the model's ``max_position_embeddings``.
A config whose model section is complete (a run folder's config.yaml) loads without the folder,
so a run that has checkpoints of its own resumes even if the folder has gone (submit checks a
new run's folder itself). ``check`` refuses what the import cannot lay out (a tensor-parallel size that does not divide
the vocabulary: an imported vocabulary is not padded). The weights themselves are checked on
the login node (core.hf.files) and read on every rank (core.hf.reader).
"""
from __future__ import annotations

from typing import Any

from core.config.modelcfg import ModelConfig
from core.errors import ConfigError, LayoutError
from core.hf import families

# Keys whose YAML form may differ from config.json's while meaning the same (an int for a float).
_NUMERIC = ("norm_eps", "rope_scaling_factor")


def source(init_from: Any) -> str | None:
    """The folder of ``init_from: hf:PATH``, or None."""
    return families.split_source(init_from) if isinstance(init_from, str) else None


def fill_model(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its model section filled from ``init_from: hf:PATH``'s config.json (unchanged otherwise)."""
    folder = source(data.get("init_from"))
    user = data.get("model", {})
    if folder is None or not isinstance(user, dict):
        return data
    if not folder:
        raise ConfigError("init_from: 'hf:' names no folder; give hf:PATH (a Hugging Face checkpoint folder)")
    try:
        hf = families.model_section(folder)
    except ConfigError:
        if all(k in user for k in families.MODEL_KEYS):  # a run folder's config.yaml: the shape is written
            return data  # out already; its run resumes from its own checkpoints without the folder
        raise
    merged = dict(user)
    for key, value in hf.model.items():
        given = user.get(key, value)
        same = given == value if key not in _NUMERIC or given is None or value is None else float(given) == value
        if key in user and not same:
            raise ConfigError(f"model.{key}: {given!r} disagrees with {folder}/config.json, which gives {value!r}; "
                              f"leave model.{key} out (init_from: hf: takes the model's shape from config.json)")
        merged[key] = value
    seq = user.get("seq_length", ModelConfig.seq_length)
    if isinstance(seq, int) and seq > hf.max_positions:
        raise ConfigError(f"model.seq_length: {seq} exceeds {folder}/config.json's max_position_embeddings = "
                          f"{hf.max_positions}; use at most that")
    return {**data, "model": merged}


def check(init_from: str | None, model: ModelConfig, tps: dict[str, int]) -> None:
    """What an imported model needs of the layouts (``tps``: option name → tensor-parallel size)."""
    folder = source(init_from)
    for key, tp in tps.items() if folder is not None else ():
        if model.vocab_size % tp:
            raise LayoutError(f"{key}: {tp} does not divide {folder}/config.json's vocab_size = {model.vocab_size} "
                              "(an imported vocabulary is not padded); pick a tp that divides it")
