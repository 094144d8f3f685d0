"""The model section: a Megatron-core GPT's shape, or the numpy ``toy``.

The shape options are the ones models are trained with today, each mapped to Megatron's
own (core.model.gpt.model): ``normalization`` layernorm | rmsnorm, ``activation`` gelu |
swiglu (a gated linear unit with SiLU: fc1 holds the gate and the up projection,
``ffn_hidden_size`` each), ``position_embedding`` learned | rope (rotary, base
``rope_base``, no position-embedding table), ``num_query_groups`` (grouped-query
attention: that many key/value heads, shared by ``num_attention_heads / num_query_groups``
query heads each; null: one per head). ``bias: false`` drops every linear layer's bias.
``tie_embeddings``: the output layer is the word embedding (Megatron keeps a copy on the last
stage when pp > 1, its gradients all-reduced with the first stage's; a checkpoint holds the
embedding once). ``head_dim``: each head's width (null: hidden_size / num_attention_heads;
Megatron's ``kv_channels``). ``qk_norm``: a norm of the model's kind on each head's query
and key (Qwen3). ``qkv_bias``: a bias on the query, key and value projections only (null: as
``bias``; Qwen2 has ``bias: false, qkv_bias: true``). ``norm_eps``: every norm's epsilon.
``rope_scaling_factor``: Llama 3.x's scaled rotary frequencies (Megatron's, with low/high
frequency factors 1 and 4 over 8192 original positions).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from core.config.schema import bounded, check_bounds
from core.errors import ConfigError

# The shape options and their defaults: a model hash leaves them out at these values, so a
# checkpoint saved before they existed still belongs to the same model.
SHAPE_DEFAULTS: dict[str, Any] = {"normalization": "layernorm", "activation": "gelu", "position_embedding": "learned",
                                  "rope_base": 10000, "num_query_groups": None, "bias": True, "tie_embeddings": False,
                                  "head_dim": None, "qk_norm": False, "qkv_bias": None, "norm_eps": 1e-5,
                                  "rope_scaling_factor": None}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT (Megatron-core), or ``toy``: a deterministic numpy model for control-plane tests."""

    kind: Literal["gpt", "toy"] = "gpt"
    num_layers: int = bounded(4, gt=0, le=10**5)
    hidden_size: int = bounded(64, gt=0, le=2**20)
    num_attention_heads: int = bounded(4, gt=0, le=2**16)
    ffn_hidden_size: int | None = bounded(None, gt=0, le=2**22)  # default (null) 4 * hidden_size
    vocab_size: int = bounded(128, gt=0, le=2**26)
    seq_length: int = bounded(32, gt=0, le=2**24)
    init_method_std: float = bounded(0.02, ge=0, le=1e3, why=" (the weights would overflow)")
    hidden_dropout: float = bounded(0.0, ge=0, lt=1)  # Megatron's names; masks reproducible in every layout
    attention_dropout: float = bounded(0.0, ge=0, lt=1)
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    activation: Literal["gelu", "swiglu"] = "gelu"
    position_embedding: Literal["learned", "rope"] = "learned"
    rope_base: int = bounded(10000, gt=0, le=10**9)
    num_query_groups: int | None = bounded(None, gt=0, le=2**16)
    bias: bool = True
    tie_embeddings: bool = False
    head_dim: int | None = bounded(None, gt=0, le=2**16)  # null: hidden_size / num_attention_heads
    qk_norm: bool = False
    qkv_bias: bool | None = None  # null: as bias
    norm_eps: float = bounded(1e-5, gt=0, le=1)
    rope_scaling_factor: float | None = bounded(None, ge=1, le=1e6)

    def __post_init__(self) -> None:
        check_bounds(self, "model")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model.hidden_size: {self.hidden_size} is not divisible by "
                              f"model.num_attention_heads = {self.num_attention_heads}; set model.head_dim "
                              "or pick a divisor")
        if self.bias and self.qkv_bias is False:
            raise ConfigError("model.qkv_bias: False with model.bias: True cannot be built (Megatron biases q, k, v "
                              "whenever the linear layers have biases); leave qkv_bias null")
        if self.rope_scaling_factor is not None and self.position_embedding != "rope":
            raise ConfigError(f"model.rope_scaling_factor: {self.rope_scaling_factor} needs "
                              f"model.position_embedding: rope, not {self.position_embedding!r}")
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(f"model.num_query_groups: {self.num_query_groups} does not divide "
                              f"model.num_attention_heads = {self.num_attention_heads}; pick a divisor of it")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or one per attention head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_size(self) -> int:
        """One head's width: ``head_dim``, or hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def query_width(self) -> int:
        """The query projection's width: heads × head size (hidden_size unless ``head_dim`` says otherwise)."""
        return self.num_attention_heads * self.head_size

    @property
    def kv_channels(self) -> int:
        """The key/value width: query groups × head size."""
        return self.query_groups * self.head_size

    @property
    def qkv_has_bias(self) -> bool:
        """Whether the query, key and value projections have a bias (``qkv_bias``, else ``bias``)."""
        return self.bias if self.qkv_bias is None else self.qkv_bias


def hashed(model: dict[str, Any]) -> dict[str, Any]:
    """The model section as its hash sees it: shape options at their defaults left out."""
    return {k: v for k, v in model.items() if not (k in SHAPE_DEFAULTS and v == SHAPE_DEFAULTS[k])}
