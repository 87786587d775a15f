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
    hf_archs: tuple[str, ...] = ()  # HF config.json "architectures" converted to this arch (convert/<arch>.py)


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", rope_neox=False, hf_archs=("LlamaForCausalLM", "MistralForCausalLM")),
    "mistral": ArchSpec("llama", rope_neox=False),  # llama.cpp writes Mistral checkpoints as "llama"
    "qwen2": ArchSpec("llama", rope_neox=True, bias=True, hf_archs=("Qwen2ForCausalLM",)),
    "qwen3": ArchSpec("llama", rope_neox=True, qk_norm=True, hf_archs=("Qwen3ForCausalLM",)),
    "gemma3": ArchSpec("gemma3", rope_neox=True, qk_norm=True, gemma=True, swa_pattern=6, rope_base_local=10000.0,
                       hf_archs=("Gemma3ForCausalLM",)),
}

# HF architecture name -> GGUF architecture (what `edgellm convert` accepts)
HF_ARCHS: dict[str, str] = {hf: arch for arch, spec in ARCHS.items() for hf in spec.hf_archs}
