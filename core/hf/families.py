"""Hugging Face model families: a checkpoint folder's config.json as Baton's model section, and back.

No torch, no numpy: the login node reads a folder's shape before anything is written, and the
exporter writes config.json from a run's model section. Supported: Llama 3.x
(``LlamaForCausalLM``, Llama 3.1's scaled rotary frequencies included), Qwen2 / Qwen2.5
(``Qwen2ForCausalLM``: a bias on q, k and v only) and Qwen3 dense (``Qwen3ForCausalLM``:
RMSNorm on each head's q and k, a head size of its own). All are pre-norm RMSNorm, SwiGLU,
rotary, bias-free otherwise; tied or untied embeddings; grouped-query attention.

``model_section(path)`` gives the model keys (``kind`` .. ``tie_embeddings`` and the HF-only
ones: ``head_dim``, ``qk_norm``, ``qkv_bias``, ``norm_eps``, ``rope_scaling_factor``) and the
largest sequence length (``max_positions``); ``hf_config(model, family)`` is its inverse for
the three families. Mixture-of-experts, sliding-window attention and unknown architectures
are refused in one line naming the architecture and what is supported.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ConfigError

# architectures[0] of config.json → Baton's family name
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
FAMILIES = tuple(ARCHITECTURES.values())
# Megatron-core 0.16.1 hardcodes these for Llama 3.x's scaled RoPE (rotary_pos_embedding._apply_scaling).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CONFIG = "config.json"
# The model keys ``to_model`` gives (a run folder's config.yaml holds them all).
MODEL_KEYS = ("kind", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size", "normalization", "activation", "position_embedding", "rope_base", "bias", "tie_embeddings",
              "head_dim", "qk_norm", "qkv_bias", "norm_eps", "rope_scaling_factor")


@dataclass(frozen=True)
class HFModel:
    """What a folder's config.json says: its family, Baton's model keys, its longest sequence."""

    family: str
    model: dict[str, Any]
    max_positions: int


def split_source(value: str) -> str | None:
    """The folder of ``init_from: hf:PATH``, or None when ``value`` is not an ``hf:`` source."""
    return value[3:] if value.startswith("hf:") else None


def read_config(folder: str | Path) -> dict[str, Any]:
    """``folder``/config.json as a dict; a missing folder or file or bad JSON is a one-line ConfigError."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ConfigError(f"init_from: hf:{folder}: no such folder; give a Hugging Face checkpoint folder "
                          "(config.json + *.safetensors)")
    try:
        data = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise ConfigError(f"init_from: hf:{folder}: no {CONFIG} in it; give a Hugging Face checkpoint folder "
                          "(save_pretrained writes one)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"init_from: {path / CONFIG}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"init_from: {path / CONFIG}: expected a JSON object, got {type(data).__name__}")
    return data


def family_of(hf: Mapping[str, Any], where: str = CONFIG) -> str:
    """The Baton family of a config.json, or a ConfigError naming the architecture and the supported ones."""
    archs = hf.get("architectures") or [hf.get("model_type")]
    arch = str(archs[0]) if isinstance(archs, list) and archs else str(archs)
    if arch not in ARCHITECTURES:
        raise ConfigError(f"init_from: {where}: architecture {arch!r} is not supported; supported: "
                          f"{', '.join(ARCHITECTURES)} (dense)")
    if hf.get("num_experts") or hf.get("num_local_experts"):
        raise ConfigError(f"init_from: {where}: {arch} with experts (mixture-of-experts) is not supported; "
                          f"supported: dense {', '.join(ARCHITECTURES)}")
    if hf.get("use_sliding_window") or (hf.get("sliding_window") and ARCHITECTURES[arch] == "llama"):
        raise ConfigError(f"init_from: {where}: {arch} with sliding-window attention is not supported; set "
                          "use_sliding_window: false (full attention) or pick another model")
    return ARCHITECTURES[arch]


def _rope(hf: Mapping[str, Any], where: str) -> tuple[float, float | None]:
    """(rope theta, Llama 3's scaling factor or None) from ``rope_parameters`` (transformers 5)
    or the older ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or params)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(f"init_from: {where}: rope_type {kind!r} is not supported; supported: default, llama3")
    for key, want in LLAMA3_ROPE.items():
        if float(scaling.get(key, want)) != want:
            raise ConfigError(f"init_from: {where}: llama3 rope {key} {scaling[key]} is not {want:g}, the only "
                              "value Megatron-core 0.16.1 builds")
    return float(theta), float(scaling["factor"])


def _int(hf: Mapping[str, Any], key: str, where: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"init_from: {where}: {key} is {value!r}; expected a positive integer")
    return value


def to_model(hf: Mapping[str, Any], where: str = CONFIG) -> HFModel:
    """A config.json (as a dict) as Baton's model keys."""
    family = family_of(hf, where)
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"init_from: {where}: hidden_act {hf.get('hidden_act')!r} is not supported; supported: silu")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(f"init_from: {where}: attention_bias / mlp_bias true (a bias on o_proj or the MLP) is not "
                          "supported; supported: Qwen2's q/k/v bias only")
    theta, factor = _rope(hf, where)
    if theta != int(theta):
        raise ConfigError(f"init_from: {where}: rope_theta {theta} is not a whole number (model.rope_base is)")
    heads, hidden = _int(hf, "num_attention_heads", where), _int(hf, "hidden_size", where)
    head_dim = hf.get("head_dim") or hidden // heads
    model = {
        "kind": "gpt", "num_layers": _int(hf, "num_hidden_layers", where), "hidden_size": hidden,
        "num_attention_heads": heads, "num_query_groups": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": _int(hf, "intermediate_size", where), "vocab_size": _int(hf, "vocab_size", where),
        "normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope", "rope_base": int(theta),
        "bias": False, "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "head_dim": None if head_dim * heads == hidden else int(head_dim), "qk_norm": family == "qwen3",
        "qkv_bias": True if family == "qwen2" else None, "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_scaling_factor": factor,
    }
    return HFModel(family=family, model=model, max_positions=int(hf.get("max_position_embeddings") or 2**24))


def model_section(folder: str | Path) -> HFModel:
    """``folder``/config.json as Baton's model keys (see ``to_model``)."""
    return to_model(read_config(folder), str(Path(folder).expanduser() / CONFIG))


def hf_config(model: Any, family: str, *, dtype: str = "float32") -> dict[str, Any]:
    """The config.json of a Baton model section (a ModelConfig, or its dict) in ``family``:
    the inverse of ``to_model``; ``max_position_embeddings`` is the model's seq_length. The
    rotary settings are written both as transformers 5 reads them (``rope_parameters``) and as
    older readers do (``rope_theta``, ``rope_scaling``)."""
    m = dict(model) if isinstance(model, Mapping) else {k: getattr(model, k) for k in _KEYS}
    arch = {v: k for k, v in ARCHITECTURES.items()}.get(family)
    if arch is None:
        raise ConfigError(f"export: family {family!r} is not one of {', '.join(FAMILIES)}")
    shape = (m.get("normalization"), m.get("activation"), m.get("position_embedding"), bool(m.get("bias")))
    if shape != ("rmsnorm", "swiglu", "rope", False):
        raise ConfigError(f"export: a {family} model is rmsnorm, swiglu, rope and bias: false; this model has "
                          f"normalization {shape[0]}, activation {shape[1]}, position_embedding {shape[2]}, bias {shape[3]}")
    want = {"qk_norm": family == "qwen3", "qkv_bias": family == "qwen2"}
    have = {"qk_norm": bool(m.get("qk_norm")), "qkv_bias": bool(m.get("qkv_bias"))}
    if have != want:
        raise ConfigError(f"export: a {family} model has qk_norm {want['qk_norm']}, qkv_bias {want['qkv_bias']}; "
                          f"this one qk_norm {have['qk_norm']}, qkv_bias {have['qkv_bias']}")
    if m.get("rope_scaling_factor") is not None and family != "llama":
        raise ConfigError(f"export: model.rope_scaling_factor is Llama 3's; {family} has none")
    hidden, heads = int(m["hidden_size"]), int(m["num_attention_heads"])
    rope: dict[str, Any] = {"rope_theta": float(m.get("rope_base", 10000)), "rope_type": "default"}
    if m.get("rope_scaling_factor") is not None:
        rope.update(rope_type="llama3", factor=float(m["rope_scaling_factor"]), **LLAMA3_ROPE)
    out: dict[str, Any] = {
        "architectures": [arch], "model_type": family, "hidden_act": "silu", "hidden_size": hidden,
        "intermediate_size": int(m.get("ffn_hidden_size") or 4 * hidden), "num_hidden_layers": int(m["num_layers"]),
        "num_attention_heads": heads, "num_key_value_heads": int(m.get("num_query_groups") or heads),
        "head_dim": int(m.get("head_dim") or hidden // heads), "vocab_size": int(m["vocab_size"]),
        "max_position_embeddings": int(m["seq_length"]), "rms_norm_eps": float(m.get("norm_eps", 1e-5)),
        "rope_parameters": rope, "tie_word_embeddings": bool(m.get("tie_embeddings")), "dtype": dtype,
        # transformers 4.x's (and other readers') names for the same: rope_theta, rope_scaling
        "rope_theta": rope["rope_theta"], "rope_scaling": None if m.get("rope_scaling_factor") is None else dict(rope),
        "attention_dropout": 0.0, "initializer_range": float(m.get("init_method_std", 0.02)),
    }
    if family != "qwen2":
        out.update(attention_bias=False)
    if family == "llama":
        out.update(mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    return out


_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
         "seq_length", "normalization", "activation", "position_embedding", "rope_base", "bias", "tie_embeddings",
         "head_dim", "qk_norm", "qkv_bias", "norm_eps", "rope_scaling_factor", "init_method_std")
