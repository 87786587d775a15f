"""Qwen3ForCausalLM -> GGUF "qwen3" (q/k RMS norms, explicit head_dim, no permutation)."""
from convert.recipe import COMMON_METADATA, COMMON_TENSORS, QK_NORM_TENSORS, Recipe

RECIPE = Recipe(
    tensors=COMMON_TENSORS + QK_NORM_TENSORS,
    metadata=COMMON_METADATA,
    default_pre="qwen2",
)
