"""Baton's global tensors and a Hugging Face checkpoint's, name by name and row by row.

Baton's names and shapes are Megatron's ``sharded_state_dict`` ones (core.model.gpt.state):
transformer layers stacked on a leading layer axis; ``linear_qkv`` holds, per query group,
that group's query heads, then its key head, then its value head (its bias likewise); SwiGLU's
``linear_fc1`` is one global ``[gates; ups]``; the q/k norms are one head wide. Hugging Face
keeps ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj`` apart, one tensor per
layer. A tied model has no ``lm_head`` (Baton: no ``output_layer``).

``pieces(name, offset, shape, dims)`` lists the runs of HF rows any box of a Baton tensor
covers and where each goes in the box; ``read_global(rows, ...)`` builds the box from them
(``rows(hf_name, start, stop, cols)`` is the source: arrays in tests) and
``read_global_into(put, ..., out)`` copies each run straight into its place in ``out`` (a
parameter, in core.hf.reader: one pass from the file). ``to_hf(name, array, dims)`` splits a
whole Baton tensor into its HF tensors (the exporter's direction). numpy only.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
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
Put = Callable[[str, int, int, tuple[slice, ...], Any], None]  # the same, and the destination to copy them into
Piece = tuple[str, int, int, tuple[slice, ...], tuple[Any, ...]]  # the same, and where they go in the box


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


def pieces(name: str, offset: tuple[int, ...], shape: tuple[int, ...], d: Dims) -> Iterator[Piece]:
    """Each run of HF rows the box (``offset``, ``shape``) of Baton's global tensor ``name``
    covers, in order: (HF name, first row, end row, its other axes, where it goes in the box).
    Only the rows the box covers; the runs tile the box exactly once."""
    if name.startswith(P):
        key = name[len(P):]
        for i in range(offset[0], offset[0] + shape[0]):
            yield from _layer_pieces(key, i, i - offset[0], offset[1:], shape[1:], d)
        return
    if name not in _GLOBAL_1TO1:
        raise KeyError(f"{name}: no Hugging Face tensor maps to it")
    hf = _GLOBAL_1TO1[name]
    if name == "output_layer.weight" and d.tied:
        hf = _GLOBAL_1TO1["embedding.word_embeddings.weight"]
    yield hf, offset[0], offset[0] + shape[0], _cols(offset, shape), ()


def _cols(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))


def _layer_pieces(key: str, layer: int, at: int, offset: tuple[int, ...], shape: tuple[int, ...],
                  d: Dims) -> Iterator[Piece]:
    """One layer's runs (box index ``at`` of the layer axis) of ``decoder.layers.<key>``."""
    a, b, rest, pre = offset[0], offset[0] + shape[0], _cols(offset, shape), f"model.layers.{layer}."
    if key in _LAYER_1TO1:
        yield pre + _LAYER_1TO1[key], a, b, rest, (at,)
        return
    if key not in QKV and key != FC1:
        raise KeyError(f"{P}{key}: no Hugging Face tensor maps to it")
    runs = fc1_runs(a, b, d) if key == FC1 else qkv_runs(a, b, d)
    suffix, pos = key.rsplit(".", 1)[1], 0
    for p, s, e in runs:
        yield f"{pre}{_PROJ[p]}.{suffix}", s, e, rest, (at, slice(pos, pos + e - s))
        pos += e - s


def read_global(rows: Rows, name: str, offset: tuple[int, ...], shape: tuple[int, ...], d: Dims) -> np.ndarray:
    """The box (``offset``, ``shape``) of Baton's global tensor ``name``, read from HF rows
    (in the rows' dtype)."""
    out: np.ndarray | None = None
    for hf, a, b, rest, at in pieces(name, tuple(offset), tuple(shape), d):
        part = rows(hf, a, b, rest)
        if out is None:
            out = np.empty(shape, dtype=part.dtype)
        out[at] = part
    assert out is not None, f"{name}: an empty box"
    return out


def read_global_into(put: Put, name: str, offset: tuple[int, ...], shape: tuple[int, ...], d: Dims, out: Any) -> None:
    """The box (``offset``, ``shape``) of ``name`` written straight into ``out`` (an array or
    tensor of ``shape``), each run of HF rows into its place: ``put(hf_name, start, stop,
    cols, dest)`` copies them into the view ``dest`` of ``out``. No intermediate box."""
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: destination of shape {tuple(out.shape)} for a box of shape {tuple(shape)}")
    for hf, a, b, rest, at in pieces(name, tuple(offset), tuple(shape), d):
        put(hf, a, b, rest, out[at])


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
