"""Gemma3ForCausalLM (text) -> GGUF "gemma3": every *norm.weight + 1, tied embeddings, sandwich norms."""
from convert.recipe import COMMON_METADATA, QK_NORM_TENSORS, Recipe

_L = r"(?:model\.language_model|model)\.layers\.(\d+)\."
RECIPE = Recipe(
    tensors=(
        (r"(?:model\.language_model|model)\.embed_tokens\.weight", "token_embd.weight"),
        (r"(?:model\.language_model|model)\.norm\.weight", "output_norm.weight"),
        (_L + r"input_layernorm\.weight", "blk.{0}.attn_norm.weight"),
        (_L + r"self_attn\.q_proj\.weight", "blk.{0}.attn_q.weight"),
        (_L + r"self_attn\.k_proj\.weight", "blk.{0}.attn_k.weight"),
        (_L + r"self_attn\.v_proj\.weight", "blk.{0}.attn_v.weight"),
        (_L + r"self_attn\.o_proj\.weight", "blk.{0}.attn_output.weight"),
        (_L + r"post_attention_layernorm\.weight", "blk.{0}.post_attention_norm.weight"),
        (_L + r"pre_feedforward_layernorm\.weight", "blk.{0}.ffn_norm.weight"),
        (_L + r"post_feedforward_layernorm\.weight", "blk.{0}.post_ffw_norm.weight"),
        (_L + r"mlp\.gate_proj\.weight", "blk.{0}.ffn_gate.weight"),
        (_L + r"mlp\.up_proj\.weight", "blk.{0}.ffn_up.weight"),
        (_L + r"mlp\.down_proj\.weight", "blk.{0}.ffn_down.weight"),
    ) + tuple((p.replace(r"model\.layers\.(\d+)\.", _L), g) for p, g in QK_NORM_TENSORS),
    metadata=COMMON_METADATA + (
        ("sliding_window", "attention.sliding_window", int),
        ("final_logit_softcapping", "final_logit_softcapping", float),
    ),
    defaults={"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "head_dim": 256},
    norm_shift=1.0,
    always_key_length=True,
    tied_output=True,
    default_pre="default",
    spm_add_space_prefix=False,
)
