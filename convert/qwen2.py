"""Qwen2ForCausalLM -> GGUF "qwen2" (q/k/v biases, no permutation)."""
from convert.recipe import COMMON_METADATA, COMMON_TENSORS, Recipe

RECIPE = Recipe(
    tensors=COMMON_TENSORS + (
        (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "blk.{0}.attn_q.bias"),
        (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "blk.{0}.attn_k.bias"),
        (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "blk.{0}.attn_v.bias"),
    ),
    metadata=COMMON_METADATA,
    default_pre="qwen2",
)
