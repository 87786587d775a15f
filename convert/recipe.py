"""What converting one HF architecture takes, as data: the `Recipe` each convert/<arch>.py module defines.

Which HF architectures exist and which GGUF architecture each becomes is not here but in the one architecture
table, edgellm/architectures.py; the converter (convert/common.py) loads convert/<arch>.py by that name. The
recipe modules import only this file, so the driver can import them without a cycle.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["COMMON_METADATA", "COMMON_TENSORS", "QK_NORM_TENSORS", "Recipe"]

_L = r"model\.layers\.(\d+)\."
COMMON_TENSORS: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (_L + r"input_layernorm\.weight", "blk.{0}.attn_norm.weight"),
    (_L + r"self_attn\.q_proj\.weight", "blk.{0}.attn_q.weight"),
    (_L + r"self_attn\.k_proj\.weight", "blk.{0}.attn_k.weight"),
    (_L + r"self_attn\.v_proj\.weight", "blk.{0}.attn_v.weight"),
    (_L + r"self_attn\.o_proj\.weight", "blk.{0}.attn_output.weight"),
    (_L + r"post_attention_layernorm\.weight", "blk.{0}.ffn_norm.weight"),
    (_L + r"mlp\.gate_proj\.weight", "blk.{0}.ffn_gate.weight"),
    (_L + r"mlp\.up_proj\.weight", "blk.{0}.ffn_up.weight"),
    (_L + r"mlp\.down_proj\.weight", "blk.{0}.ffn_down.weight"),
)
QK_NORM_TENSORS: tuple[tuple[str, str], ...] = (
    (_L + r"self_attn\.q_norm\.weight", "blk.{0}.attn_q_norm.weight"),
    (_L + r"self_attn\.k_norm\.weight", "blk.{0}.attn_k_norm.weight"),
)
# (config.json key, GGUF key without the "{arch}." prefix, type); missing keys are skipped
COMMON_METADATA: tuple[tuple[str, str, type], ...] = (
    ("max_position_embeddings", "context_length", int),
    ("hidden_size", "embedding_length", int),
    ("num_hidden_layers", "block_count", int),
    ("intermediate_size", "feed_forward_length", int),
    ("num_attention_heads", "attention.head_count", int),
    ("num_key_value_heads", "attention.head_count_kv", int),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon", float),
    ("rope_theta", "rope.freq_base", float),
)


@dataclass(frozen=True)
class Recipe:
    """HF tensor-name patterns -> GGUF names, config.json keys -> GGUF metadata keys, and a few flags."""

    tensors: tuple[tuple[str, str], ...]
    metadata: tuple[tuple[str, str, type], ...]
    defaults: dict = field(default_factory=dict)  # config values assumed when config.json lacks them
    permute_qk: bool = False  # llama: HF rotates halves (NeoX), GGUF "llama" rotates interleaved pairs
    norm_shift: float = 0.0  # gemma: RMSNorm multiplies by (1 + w)
    always_key_length: bool = False  # write key_length/value_length even when head_dim == hidden / heads
    rope_dimension_count: bool = False
    tied_output: bool = False  # never write output.weight (lm_head, if present, is the embedding)
    default_pre: str = "default"  # tokenizer.ggml.pre when the pre-tokenizer regex is not recognised
    spm_add_space_prefix: bool | None = None

    def gguf_name(self, hf_name: str) -> str | None:
        """The GGUF tensor name for `hf_name`, or None if no pattern matches."""
        for pat, out in self.tensors:
            m = re.fullmatch(pat, hf_name)
            if m:
                return out.format(*m.groups())
        return None
