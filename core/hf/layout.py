"""Baton's global tensors and a Hugging Face checkpoint's, name by name and row by row.

Baton's names and shapes are Megatron's ``sharded_state_dict`` ones (core.model.gpt.state):
transformer layers stacked on a leading layer axis; ``linear_qkv`` holds, per query group,
that group's query heads, then its key head, then its value head (its bias likewise); SwiGLU's
``linear_fc1`` is one global ``[gates; ups]``; the q/k norms are one head wide. Hugging Face
keeps ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj`` apart, one tensor per
layer. A tied model has no ``lm_head`` (Baton: no ``output_layer``).

``read_global(rows, name, offset, shape, dims)`` builds any box of a Baton tensor from the HF
tensors' rows, reading only the rows the box covers (``rows(hf_name, start, stop, cols)`` is
the source: a safetensors slice in core.hf.reader, arrays in tests); ``to_hf(name, array,
dims)`` splits a whole Baton tensor into its HF tensors (the exporter's direction). numpy only.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

P = "decoder.layers."
# Baton name (without the layer axis) → HF name in layer {i}; one to one.
_LAYER_1TO1 = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    # Transformer Engine's layer spec fuses the norms into the next linear layer
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_GLOBAL_1TO1 = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
FC1 = "mlp.linear_fc1.weight"

Rows = Callable[[str, int, int, tuple[slice, ...]], np.ndarray]  # (hf name, first row, end row, other axes)


@dataclass(frozen=True, kw_only=True)
class Dims:
    """The sizes the mapping needs (``dims_of`` takes them from a model section)."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    qk_norm: bool = False
    qkv_bias: bool = False
    tied: bool = False


def dims_of(model: Any) -> Dims:
    """A ModelConfig's sizes."""
    return Dims(layers=model.num_layers, hidden=model.hidden_size, heads=model.num_attention_heads,
                groups=model.query_groups, head_dim=model.head_size, ffn=model.ffn, vocab=model.vocab_size,
                qk_norm=model.qk_norm, qkv_bias=model.qkv_has_bias, tied=model.tie_embeddings)


def hf_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this model holds, with its shape."""
    hd, q, kv = d.head_dim, d.heads * d.head_dim, d.groups * d.head_dim
    layer = {"self_attn.q_proj.weight": (q, d.hidden), "self_attn.k_proj.weight": (kv, d.hidden),
             "self_attn.v_proj.weight": (kv, d.hidden), "self_attn.o_proj.weight": (d.hidden, q),
             "mlp.gate_proj.weight": (d.ffn, d.hidden), "mlp.up_proj.weight": (d.ffn, d.hidden),
             "mlp.down_proj.weight": (d.hidden, d.ffn), "input_layernorm.weight": (d.hidden,),
             "post_attention_layernorm.weight": (d.hidden,)}
    if d.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if d.qk_norm:
        layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    out = {"model.embed_tokens.weight": (d.vocab, d.hidden), "model.norm.weight": (d.hidden,)}
    if not d.tied:
        out["lm_head.weight"] = (d.vocab, d.hidden)
    for i in range(d.layers):
        out.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return out


def qkv_runs(start: int, stop: int, d: Dims) -> list[tuple[str, int, int]]:
    """Rows [start, stop) of Megatron's per-layer ``linear_qkv`` as runs of HF rows:
    (``q`` | ``k`` | ``v``, first row, end row), in order."""
    per_group, hd = d.heads // d.groups, d.head_dim
    width = (per_group + 2) * hd  # one query group's rows: its queries, its key, its value
    runs: list[tuple[str, int, int]] = []
    r = start
    while r < stop:
        g, within = divmod(r, width)
        if within < per_group * hd:
            proj, base, end = "q", g * per_group * hd + within, (g * width) + per_group * hd
        elif within < (per_group + 1) * hd:
            proj, base, end = "k", g * hd + within - per_group * hd, g * width + (per_group + 1) * hd
        else:
            proj, base, end = "v", g * hd + within - (per_group + 1) * hd, (g + 1) * width
        n = min(stop, end) - r
        if runs and runs[-1][0] == proj and runs[-1][2] == base:
            runs[-1] = (proj, runs[-1][1], base + n)
        else:
            runs.append((proj, base, base + n))
        r += n
    return runs


def fc1_runs(start: int, stop: int, d: Dims) -> list[tuple[str, int, int]]:
    """Rows [start, stop) of SwiGLU's global ``[gates; ups]`` as runs of ``gate`` / ``up`` rows."""
    runs = []
    if start < d.ffn:
        runs.append(("gate", start, min(stop, d.ffn)))
    if stop > d.ffn:
        runs.append(("up", max(start, d.ffn) - d.ffn, stop - d.ffn))
    return runs


_PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj"}


def _layer_box(rows: Rows, key: str, layer: int, offset: tuple[int, ...], shape: tuple[int, ...], d: Dims) -> np.ndarray:
    """One layer's box (without the layer axis) of the Baton tensor ``decoder.layers.<key>``."""
    a, b, rest = offset[0], offset[0] + shape[0], tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:],
                                                                                          strict=True))
    pre = f"model.layers.{layer}."
    if key in _LAYER_1TO1:
        return rows(pre + _LAYER_1TO1[key], a, b, rest)
    if key in QKV or key == FC1:
        runs = fc1_runs(a, b, d) if key == FC1 else qkv_runs(a, b, d)
        suffix = key.rsplit(".", 1)[1]
        return np.concatenate([rows(f"{pre}{_PROJ[p]}.{suffix}", s, e, rest) for p, s, e in runs])
    raise KeyError(f"{P}{key}: no Hugging Face tensor maps to it")


def read_global(rows: Rows, name: str, offset: tuple[int, ...], shape: tuple[int, ...], d: Dims) -> np.ndarray:
    """The box (``offset``, ``shape``) of Baton's global tensor ``name``, read from HF rows."""
    if name.startswith(P):
        key = name[len(P):]
        boxes = [_layer_box(rows, key, i, offset[1:], shape[1:], d) for i in range(offset[0], offset[0] + shape[0])]
        return np.stack(boxes)
    if name not in _GLOBAL_1TO1:
        raise KeyError(f"{name}: no Hugging Face tensor maps to it")
    hf = _GLOBAL_1TO1[name]
    if name == "output_layer.weight" and d.tied:
        hf = _GLOBAL_1TO1["embedding.word_embeddings.weight"]
    rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
    return rows(hf, offset[0], offset[0] + shape[0], rest)


def interleave_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, d: Dims) -> np.ndarray:
    """HF's q, k, v rows (weights or biases) as Megatron's ``linear_qkv`` rows."""
    per_group, hd = d.heads // d.groups, d.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(d.groups, per_group * hd, *rest), k.reshape(d.groups, hd, *rest), v.reshape(d.groups, hd, *rest))
    return np.concatenate(parts, axis=1).reshape(d.groups * (per_group + 2) * hd, *rest)


def split_qkv(qkv: np.ndarray, d: Dims) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's ``linear_qkv`` rows as HF's q, k, v (the inverse of ``interleave_qkv``)."""
    per_group, hd = d.heads // d.groups, d.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(d.groups, (per_group + 2) * hd, *rest)
    q, k, v = np.split(grouped, [per_group * hd, (per_group + 1) * hd], axis=1)
    return (q.reshape(d.heads * hd, *rest), k.reshape(d.groups * hd, *rest), v.reshape(d.groups * hd, *rest))


def to_hf(name: str, array: np.ndarray, d: Dims) -> dict[str, np.ndarray]:
    """A whole Baton global tensor as the HF tensors it holds (the exporter's direction); a
    tied model's ``output_layer`` gives none."""
    if name in _GLOBAL_1TO1:
        return {} if name == "output_layer.weight" and d.tied else {_GLOBAL_1TO1[name]: array}
    if not name.startswith(P):
        raise KeyError(f"{name}: no Hugging Face tensor maps to it")
    key, out = name[len(P):], {}
    for i, layer in enumerate(array):
        pre = f"model.layers.{i}."
        if key in _LAYER_1TO1:
            out[pre + _LAYER_1TO1[key]] = layer
        elif key in QKV:
            suffix = key.rsplit(".", 1)[1]
            for p, t in zip("qkv", split_qkv(layer, d), strict=True):
                out[f"{pre}{_PROJ[p]}.{suffix}"] = t
        elif key == FC1:
            out[f"{pre}mlp.gate_proj.weight"], out[f"{pre}mlp.up_proj.weight"] = layer[:d.ffn], layer[d.ffn:]
        else:
            raise KeyError(f"{name}: no Hugging Face tensor maps to it")
    return out
