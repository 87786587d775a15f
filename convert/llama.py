"""LlamaForCausalLM / MistralForCausalLM -> GGUF "llama" (q/k rows permuted from HF's NeoX halves to interleaved)."""
from convert.recipe import COMMON_METADATA, COMMON_TENSORS, Recipe

RECIPE = Recipe(
    tensors=COMMON_TENSORS,
    metadata=COMMON_METADATA,
    permute_qk=True,
    rope_dimension_count=True,
    default_pre="llama-bpe",
)
