"""core.hf.layout's row math without Megatron: Megatron's linear_qkv order (per query group:
its query heads, its key head, its value head) and SwiGLU's [gates; ups], checked against
loops written from that definition; and core.hf.families' config.json round trip."""
from __future__ import annotations

import numpy as np
import pytest

from core.errors import ConfigError
from core.hf import families, layout


def _dims(heads: int = 6, groups: int = 2, head_dim: int = 3, **kw: object) -> layout.Dims:
    base = dict(layers=2, hidden=8, heads=heads, groups=groups, head_dim=head_dim, ffn=5, vocab=10, qkv_bias=True)
    return layout.Dims(**{**base, **kw})  # type: ignore[arg-type]


def _reference_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, d: layout.Dims) -> np.ndarray:
    rows, per_group, hd = [], d.heads // d.groups, d.head_dim
    for g in range(d.groups):
        for h in range(g * per_group, (g + 1) * per_group):
            rows += [q[h * hd + i] for i in range(hd)]
        rows += [k[g * hd + i] for i in range(hd)]
        rows += [v[g * hd + i] for i in range(hd)]
    return np.stack(rows)


@pytest.mark.parametrize(("heads", "groups", "head_dim"), [(6, 2, 3), (4, 4, 2), (8, 1, 4), (4, 2, 5)])
def test_qkv_interleave_follows_megatrons_group_order_and_splits_back(heads: int, groups: int, head_dim: int) -> None:
    d, rng = _dims(heads, groups, head_dim), np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n * head_dim, 8)) for n in (heads, groups, groups))
    qkv = layout.interleave_qkv(q, k, v, d)
    np.testing.assert_array_equal(qkv, _reference_qkv(q, k, v, d))
    for got, want in zip(layout.split_qkv(qkv, d), (q, k, v), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(layout.interleave_qkv(q[:, 0], k[:, 0], v[:, 0], d), qkv[:, 0])  # a bias


def _hf_tensors(d: layout.Dims) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in layout.hf_shapes(d).items()}


def _rows(hf: dict[str, np.ndarray]) -> layout.Rows:
    return lambda name, a, b, rest: hf[name][(slice(a, b), *rest)]


def test_every_box_of_qkv_and_fc1_reads_the_rows_an_independent_interleave_gives() -> None:
    """Any tensor-parallel cut (a row range, a column range) of a stacked layer tensor equals
    that cut of the whole tensor built from HF's separate q, k, v / gate, up; built (read_global)
    or copied run by run into a destination (read_global_into)."""
    d = _dims()
    hf = _hf_tensors(d)
    rows = _rows(hf)

    def put(name: str, a: int, b: int, rest: tuple[slice, ...], dest: np.ndarray) -> None:
        dest[...] = hf[name][(slice(a, b), *rest)]

    for layer in range(d.layers):
        p = f"model.layers.{layer}."
        qkv = _reference_qkv(*(hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"), d)
        bias = _reference_qkv(*(hf[f"{p}self_attn.{x}_proj.bias"][:, None] for x in "qkv"), d)[:, 0]
        fc1 = np.concatenate([hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]])
        for a in range(qkv.shape[0]):
            for b in range(a + 1, qkv.shape[0] + 1):
                box = layout.read_global(rows, "decoder.layers.self_attention.linear_qkv.weight", (layer, a, 2),
                                         (1, b - a, 3), d)
                np.testing.assert_array_equal(box[0], qkv[a:b, 2:5])
                into = np.full((1, b - a, 3), np.nan, np.float32)  # every element written: no NaN left
                layout.read_global_into(put, "decoder.layers.self_attention.linear_qkv.weight", (layer, a, 2),
                                        (1, b - a, 3), d, into)
                np.testing.assert_array_equal(into[0], qkv[a:b, 2:5])
                got = layout.read_global(rows, "decoder.layers.self_attention.linear_qkv.bias", (layer, a), (1, b - a), d)
                np.testing.assert_array_equal(got[0], bias[a:b])
        for a, b in [(0, 10), (0, 5), (5, 10), (3, 7), (2, 3)]:
            box = layout.read_global(rows, "decoder.layers.mlp.linear_fc1.weight", (layer, a, 0), (1, b - a, 8), d)
            np.testing.assert_array_equal(box[0], fc1[a:b])
            into = np.full((1, b - a, 8), np.nan, np.float32)
            layout.read_global_into(put, "decoder.layers.mlp.linear_fc1.weight", (layer, a, 0), (1, b - a, 8), d, into)
            np.testing.assert_array_equal(into[0], fc1[a:b])


def test_to_hf_inverts_read_global_and_a_tied_model_has_no_lm_head() -> None:
    for tied in (False, True):
        d = _dims(qk_norm=True, tied=tied)
        hf = _hf_tensors(d)
        names = {"embedding.word_embeddings.weight": (10, 8), "decoder.final_layernorm.weight": (8,),
                 "decoder.layers.self_attention.linear_qkv.weight": (2, 30, 8),
                 "decoder.layers.self_attention.linear_qkv.bias": (2, 30),
                 "decoder.layers.self_attention.linear_proj.weight": (2, 8, 18),
                 "decoder.layers.self_attention.q_layernorm.weight": (2, 3),
                 "decoder.layers.self_attention.k_layernorm.weight": (2, 3),
                 "decoder.layers.input_layernorm.weight": (2, 8), "decoder.layers.pre_mlp_layernorm.weight": (2, 8),
                 "decoder.layers.mlp.linear_fc1.weight": (2, 10, 8), "decoder.layers.mlp.linear_fc2.weight": (2, 8, 5)}
        if not tied:
            names["output_layer.weight"] = (10, 8)
        back: dict[str, np.ndarray] = {}
        for name, shape in names.items():
            whole = layout.read_global(_rows(hf), name, (0,) * len(shape), shape, d)
            back.update(layout.to_hf(name, whole, d))
        assert back.keys() == hf.keys()
        for name, array in hf.items():
            np.testing.assert_array_equal(back[name], array)
        assert ("lm_head.weight" in back) is (not tied)


def _model(**kw: object) -> dict[str, object]:
    base = dict(kind="gpt", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                vocab_size=64, seq_length=128, normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                rope_base=500000, bias=False, tie_embeddings=False, head_dim=None, qk_norm=False, qkv_bias=None,
                norm_eps=1e-6, rope_scaling_factor=None, init_method_std=0.02)
    return {**base, **kw}


@pytest.mark.parametrize(("family", "extra"), [("llama", {"rope_scaling_factor": 8.0}), ("llama", {}),
                                               ("qwen2", {"qkv_bias": True, "tie_embeddings": True}),
                                               ("qwen3", {"qk_norm": True, "head_dim": 32, "tie_embeddings": True})])
def test_hf_config_and_to_model_are_inverses(family: str, extra: dict[str, object]) -> None:
    model = _model(**extra)
    hf = families.hf_config(model, family)
    back = families.to_model(hf)
    assert back.family == family and back.max_positions == 128 and tuple(back.model) == families.MODEL_KEYS
    assert back.model == {k: v for k, v in model.items() if k not in ("seq_length", "init_method_std")}
    import transformers  # the reader the exported config.json is for (tests only)

    read = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    assert families.to_model(read.to_dict()).model == back.model


@pytest.mark.parametrize(("change", "words"), [
    ({"architectures": ["MixtralForCausalLM"]}, "'MixtralForCausalLM' is not supported; supported: LlamaForCausalLM"),
    ({"architectures": ["Qwen3ForCausalLM"], "num_experts": 8}, "mixture-of-experts"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 2.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, "low_freq_factor 2.0"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}}, "rope_type 'yarn'"),
])
def test_unsupported_configs_are_refused_in_one_line(change: dict[str, object], words: str) -> None:
    hf = {**families.hf_config(_model(), "llama"), **change}
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
        families.to_model(hf)
    assert "\n" not in str(err.value)
