"""Qwen3ForCausalLM -> GGUF "qwen3" (q/k RMS norms, explicit head_dim, no permutation)."""
from convert.common import COMMON_METADATA, COMMON_TENSORS, QK_NORM_TENSORS, ArchSpec

SPEC = ArchSpec(
    hf_archs=("Qwen3ForCausalLM",),
    arch="qwen3",
    tensors=COMMON_TENSORS + QK_NORM_TENSORS,
    metadata=COMMON_METADATA,
    default_pre="qwen2",
)
