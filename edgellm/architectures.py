"""The supported architectures: one table for the loader (edgellm/loader.py) and the converter (convert/).

Keyed by GGUF's `general.architecture`. Each entry says which file under edgellm/models/ runs it, what differs
between the families (llama.cpp's per-arch constants, as data), and which Hugging Face `architectures` names
`edgellm convert` writes as it (the tensor and metadata recipe is convert/<arch>.py). Adding an architecture is
one line here, one models/ file (or an existing one), and optionally one convert/ file.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHS", "ArchSpec", "HF_ARCHS"]


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported architectures, as data (llama.cpp's per-arch constants)."""

    model: str  # edgellm/models/<model>.py implements it (llama-family archs share one file)
    rope_neox: bool  # NeoX rotation (halves) instead of adjacent pairs
    qk_norm: bool = False
    gemma: bool = False  # embeddings * sqrt(d), GeGLU, post-norms, tied output
    swa_pattern: int = 0  # every n-th layer is global (llama.cpp hard-codes 6 for gemma3)
    rope_base_local: float | None = None  # rope base of sliding-window layers
    bias: bool = False  # q/k/v biases (qwen2)
    qk_scale_layers: tuple[int, ...] = ()  # block counts whose query scale is 1/sqrt(d_model/heads) (gemma2 27B)
    window: int = 0  # sliding window when the file has no attention.sliding_window key (gemma2: 4096)
    softcaps: tuple[float, float] = (0.0, 0.0)  # (attention, final) logit soft-caps when the keys are missing
    no_rope_every: int = 0  # every n-th layer (il + 1 = n, 2n, ...) skips rotary embeddings (smollm3's NoPE)
    moe_norm_topk: bool = False  # mixture of experts: the routed experts' softmax weights renormalised to sum 1
    moe_gating: str = "softmax"  # kernels_cpu.moe.GATINGS: "softmax_weight" picks by raw logit, softmax over k
    moe_act: str = "swiglu"  # edgellm.models.moe.ACTIVATIONS
    moe_bias: bool = False  # router and expert biases (ffn_gate_inp.bias, ffn_{gate,up,down}_exps.bias)
    sinks: bool = False  # attention sinks: a learned per-head logit in the softmax (attn_sinks.weight)
    out_bias: bool = False  # attn_output.bias
    ffn_norm: str = "ffn_norm"  # the pre-FFN norm's tensor (gpt-oss: post_attention_norm)
    hf_archs: tuple[str, ...] = ()  # HF config.json "architectures" converted to this arch (convert/<arch>.py)


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", rope_neox=False, hf_archs=("LlamaForCausalLM", "MistralForCausalLM")),
    "mistral": ArchSpec("llama", rope_neox=False),  # llama.cpp writes Mistral checkpoints as "llama"
    "qwen2": ArchSpec("llama", rope_neox=True, bias=True, hf_archs=("Qwen2ForCausalLM",)),
    "qwen3": ArchSpec("llama", rope_neox=True, qk_norm=True, hf_archs=("Qwen3ForCausalLM",)),
    # mixture of experts (ffn_gate_inp router, ffn_{gate,up,down}_exps): qwen3 attention, top-k softmax routing
    "qwen3moe": ArchSpec("llama", rope_neox=True, qk_norm=True, moe_norm_topk=True),
    # gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE): q/k/v/o biases, attention sinks, even layers sliding-window,
    # YaRN rope, MoE routed by raw logits with biases and the clamped swiglu_oai, MXFP4 experts
    "gpt-oss": ArchSpec("llama", rope_neox=True, bias=True, swa_pattern=2, moe_gating="softmax_weight",
                        moe_act="swiglu_oai", moe_bias=True, sinks=True, out_bias=True,
                        ffn_norm="post_attention_norm"),
    "smollm3": ArchSpec("llama", rope_neox=False, no_rope_every=4),
    # phi3: fused attn_qkv and gate+up (ffn_up holds both), optional partial rotary and long/short rope factors
    "phi3": ArchSpec("llama", rope_neox=True),
    "gemma2": ArchSpec("gemma3", rope_neox=True, gemma=True, swa_pattern=2, window=4096, softcaps=(50.0, 30.0),
                       qk_scale_layers=(46,)),
    "gemma3": ArchSpec("gemma3", rope_neox=True, qk_norm=True, gemma=True, swa_pattern=6, rope_base_local=10000.0,
                       hf_archs=("Gemma3ForCausalLM",)),
}

# HF architecture name -> GGUF architecture (what `edgellm convert` accepts)
HF_ARCHS: dict[str, str] = {hf: arch for arch, spec in ARCHS.items() for hf in spec.hf_archs}
