"""The Megatron-core GPT of one pipeline stage, built from Baton's config sections.

The layer spec is Megatron's local one, or TransformerEngine's on a GPU where it is
installed. ``training.mixed_precision`` is what runs, on a GPU and on a CPU alike: bf16 or
fp16 parameters and compute (Megatron's ``Float16Module``) over fp32 main weights held by
Megatron's mixed-precision optimizer, or fp32 throughout; ``auto`` is bf16 on a GPU and
fp32 on a CPU. Each rank logs what it runs.
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from core.config.run import ModelConfig, ParallelConfig, TrainingConfig

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class Precision:
    """What the model computes in; ``param_dtype`` float32 means plain fp32 training."""

    param_dtype: torch.dtype
    grad_reduce_in_fp32: bool

    @property
    def bf16(self) -> bool:
        return self.param_dtype == torch.bfloat16

    @property
    def fp16(self) -> bool:
        return self.param_dtype == torch.float16


def resolve_precision(training: TrainingConfig, *, on_cuda: bool) -> Precision:
    """``training.mixed_precision`` as this rank runs it (``auto`` resolved for its device)."""
    param, reduce = training.mixed_precision.resolved(on_cuda=on_cuda)
    return Precision(param_dtype=_DTYPES[param], grad_reduce_in_fp32=reduce == "fp32")


def _recompute_options(recompute: str) -> dict[str, object]:
    if recompute == "full":
        # One layer per recompute unit: every layer's activations are recomputed in backward.
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}  # Megatron's default: core attention
    return {}


def transformer_config(
    model: ModelConfig, parallel: ParallelConfig, training: TrainingConfig, *, on_cuda: bool
) -> TransformerConfig:
    """The TransformerConfig every stage of the run shares."""
    precision = resolve_precision(training, on_cuda=on_cuda)
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        # Required for pp > 1: the dtype of the activations sent between stages.
        pipeline_dtype=precision.param_dtype,
        params_dtype=precision.param_dtype,
        bf16=precision.bf16,
        fp16=precision.fp16,
        # Without it each TP rank draws its own shard and TP layouts stop agreeing; on CPU
        # it is also the only path that works.
        use_cpu_initialization=True,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        sequence_parallel=False,
        **_shape_options(model),  # type: ignore[arg-type]
        **_recompute_options(training.recompute),  # type: ignore[arg-type]
    )


def _shape_options(model: ModelConfig) -> dict[str, object]:
    """core.config.modelcfg's shape options as Megatron's TransformerConfig fields."""
    out: dict[str, object] = {"normalization": "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm",
                              "add_bias_linear": model.bias, "num_query_groups": model.query_groups,
                              "kv_channels": model.head_size, "qk_layernorm": model.qk_norm,
                              "add_qkv_bias": model.qkv_has_bias, "layernorm_epsilon": model.norm_eps}
    if model.activation == "swiglu":
        out.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                   bias_activation_fusion=False)
    return out


def position_options(model: ModelConfig) -> dict[str, object]:
    """GPTModel's position arguments for ``model.position_embedding``."""
    if model.position_embedding == "rope":
        scaling = model.rope_scaling_factor
        return {"position_embedding_type": "rope", "rotary_base": model.rope_base, "rope_scaling": scaling is not None,
                "rope_scaling_factor": 8.0 if scaling is None else scaling}
    return {"position_embedding_type": "learned_absolute"}


def layer_spec(config: TransformerConfig, *, on_cuda: bool) -> ModuleSpec:
    """TransformerEngine layers on GPU when TE is installed; Megatron's local ones otherwise."""
    if on_cuda and importlib.util.find_spec("transformer_engine") is not None:
        from megatron.core.models.gpt.gpt_layer_specs import (  # only with Transformer Engine installed
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm)


def build_model(config: TransformerConfig, model: ModelConfig, *, on_cuda: bool) -> torch.nn.Module:
    """This rank's stage of the GPT: embedding on the first stage, loss head on the last."""
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, on_cuda=on_cuda),
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # Tied (model.tie_embeddings): with pp > 1 Megatron's embedding group keeps the last
        # stage's copy equal to the first stage's; checkpoints hold the embedding once.
        share_embeddings_and_output_weights=model.tie_embeddings,
        parallel_output=True,
        **position_options(model),
    )
    if on_cuda:
        gpt.cuda(torch.cuda.current_device())
    if config.bf16 or config.fp16:
        return Float16Module(config, gpt)
    return gpt


def unwrap(module: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not isinstance(module, GPTModel):
        module = module.module  # type: ignore[assignment]
    return module


def global_layer_indices(module: torch.nn.Module) -> list[int]:
    """Global (0-based) indices of the transformer layers this rank holds."""
    return [int(layer.layer_number) - 1 for layer in unwrap(module).decoder.layers]


def num_local_params(module: torch.nn.Module) -> int:
    """The parameters this rank holds (its shards, under ZeRO-3)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters())
