"""GGUF file -> validated ModelConfig + zero-copy quantized weights."""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgellm.architectures import ARCHS
from edgellm.errors import GGUFError, UnsupportedModelError, UnsupportedQuantTypeError
from edgellm.gguf_file import GGUFFile, TensorInfo, read_gguf
from edgellm.metadata_schema import CheckedMetadata, check_metadata
from quant.types import WEIGHT_TYPES


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one model, filled once from GGUF metadata (`{arch}.*` keys)."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    d_model: int
    n_layers: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    rms_eps: float
    rope_base: float
    rope_scale: float  # linear position scale (1 / factor)
    rope_neox: bool
    qk_norm: bool
    gemma: bool
    bias: bool
    sliding_window: int  # 0 = none
    swa_layers: tuple[bool, ...]  # per layer: uses the sliding window (and the local rope base)
    rope_base_local: float
    attn_scale: float
    attn_softcap: float  # 0 = none
    final_softcap: float  # 0 = none
    tied_output: bool
    n_rot: int = 0  # rotary dimensions (the first n_rot of each head; 0 = the whole head)
    rope_layers: tuple[bool, ...] = ()  # per layer: applies rotary embeddings (False: smollm3's NoPE layers)
    rope_factors: tuple[str, str] | None = None  # (short, long) per-pair frequency-factor tensors (phi3 LongRoPE;
    # both rope_freqs.weight for Llama 3.1-style scaling)
    rope_ctx_orig: int = 0  # the context above which the long factors are used
    rope_mscale: float = 1.0  # cos/sin scale (rope.scaling.attn_factor)
    fused_qkv: bool = False  # one attn_qkv matrix (phi3) instead of attn_q/k/v
    fused_up: bool = False  # ffn_up holds gate and up stacked, no ffn_gate (phi3)
    n_experts: int = 0  # mixture of experts: experts per layer (0: a dense FFN)
    n_experts_used: int = 0  # experts each token is routed to
    d_ff_expert: int = 0  # one expert's FFN width
    moe_norm_topk: bool = False  # routed weights renormalised to sum 1
    moe_gating: str = "softmax"  # kernels_cpu.moe.GATINGS key
    moe_act: str = "swiglu"  # edgellm.models.moe.ACTIVATIONS key
    moe_bias: bool = False  # router and expert biases
    attn_sinks: bool = False  # per-head attention-sink logits (attn_sinks.weight)
    out_bias: bool = False  # attn_output.bias
    ffn_norm: str = "ffn_norm"  # the pre-FFN norm's tensor name in each block
    rope_yarn: tuple | None = None  # YaRN: (ext_factor, original context, beta_fast, beta_slow); None: no YaRN
    name: str = ""
    file_type: int | None = None
    extra: dict = field(default_factory=dict, compare=False)


def _scalar(v: Any, key: str = "") -> Any:
    # per-layer arrays (e.g. head_count_kv in some files): all equal is required here
    if isinstance(v, np.ndarray):
        if v.size == 0 or np.any(v != v.flat[0]):
            raise UnsupportedModelError(f"per-layer hyper-parameter {key} varies across layers: {v}")
        return v.flat[0].item()
    return v


def config_from_metadata(meta: dict, tensors: dict[str, TensorInfo], path: str = "") -> ModelConfig:
    """Build the ModelConfig from metadata checked by `metadata_schema` (checked here if it was not): raise
    UnsupportedModelError for unknown architectures or missing keys, GGUFError for malformed values."""
    if not isinstance(meta, CheckedMetadata) or "model" not in meta.scopes:
        meta = check_metadata(meta, tensors, path=path, archs=ARCHS)
    arch = meta["general.architecture"]
    spec = ARCHS[arch]
    g = lambda k, d=None: _scalar(meta.get(f"{arch}.{k}", d), f"{arch}.{k}")  # noqa: E731
    r = lambda k: _scalar(meta[f"{arch}.{k}"], f"{arch}.{k}")  # noqa: E731
    d_model, n_heads = int(r("embedding_length")), int(r("attention.head_count"))
    n_kv = int(g("attention.head_count_kv", n_heads))
    head_dim = int(g("attention.key_length", d_model // n_heads))
    n_layers = int(r("block_count"))
    if "token_embd.weight" not in tensors:
        raise UnsupportedModelError(f"{path}: missing tensor 'token_embd.weight'")
    n_vocab = tensors["token_embd.weight"].shape[0]
    window = int(g("attention.sliding_window", spec.window) or 0)
    pattern = int(g("attention.sliding_window_pattern", spec.swa_pattern) or 0)
    if pattern and window:  # llama.cpp: layer il is local iff il % pattern < pattern - 1
        swa = tuple(i % pattern < pattern - 1 for i in range(n_layers))
    else:
        swa = tuple(bool(window) for _ in range(n_layers))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(g("rope.scaling.factor", 1.0) or 1.0)
    rope_scale = 1.0 / factor if scaling in ("linear", "yarn") and factor > 0 else 1.0
    if scaling not in ("none", "linear", "longrope", "yarn", None):
        raise UnsupportedModelError(f"{path}: rope scaling {scaling!r} is not supported yet")
    rope_ctx_orig = int(g("rope.scaling.original_context_length", r("context_length")))
    mscale = float(g("rope.scaling.attn_factor", 1.0) or 1.0)
    yarn = None
    if scaling == "yarn":  # llama.cpp's defaults: ext_factor 1, beta 32 / 1 (it reads no yarn_* key for these archs)
        yarn = (1.0, rope_ctx_orig, 32.0, 1.0)
        mscale = yarn_attn_factor(np.float32(1.0) / np.float32(factor), mscale)
    rope_base = float(g("rope.freq_base", 10000.0))
    n_rot = int(g("rope.dimension_count", head_dim))
    every = spec.no_rope_every
    rope_layers = tuple(not every or (i + 1) % every != 0 for i in range(n_layers))
    factors = ("rope_factors_short.weight", "rope_factors_long.weight")  # phi3 LongRoPE: by context size
    if "rope_freqs.weight" in tensors:  # Llama 3.1-style frequency factors: one table for every context
        factors = ("rope_freqs.weight", "rope_freqs.weight")
    has_factors = all(f in tensors for f in factors)
    qk_dim = d_model // n_heads if n_layers in spec.qk_scale_layers else head_dim
    attn_cap, final_cap = spec.softcaps
    n_exp = int(g("expert_count", 0) or 0)
    n_used = int(g("expert_used_count", 0) or 0)
    if n_exp and not 0 < n_used <= n_exp:
        raise GGUFError(f"{path}: {arch}.expert_used_count = {n_used} must be in 1..{arch}.expert_count ({n_exp})")
    d_ff_exp = int(g("expert_feed_forward_length", 0) or 0) or (int(r("feed_forward_length")) // max(n_used, 1))
    return ModelConfig(
        arch=arch, n_vocab=n_vocab, n_ctx_train=int(r("context_length")), d_model=d_model,
        n_layers=n_layers, d_ff=int(r("feed_forward_length")), n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, v_head_dim=int(g("attention.value_length", head_dim)),
        rms_eps=float(r("attention.layer_norm_rms_epsilon")), rope_base=rope_base,
        rope_scale=rope_scale, rope_neox=spec.rope_neox, qk_norm=spec.qk_norm, gemma=spec.gemma,
        bias=spec.bias, sliding_window=window, swa_layers=swa,
        rope_base_local=float(g("rope.freq_base_swa", spec.rope_base_local or rope_base)),
        attn_scale=1.0 / math.sqrt(qk_dim),
        attn_softcap=float(g("attn_logit_softcapping", attn_cap) or 0.0),
        final_softcap=float(g("final_logit_softcapping", final_cap) or 0.0),
        tied_output="output.weight" not in tensors,
        n_rot=n_rot, rope_layers=rope_layers, rope_factors=factors if has_factors else None,
        rope_ctx_orig=rope_ctx_orig, rope_mscale=mscale, rope_yarn=yarn,
        n_experts=n_exp, n_experts_used=n_used, d_ff_expert=d_ff_exp if n_exp else 0,
        moe_norm_topk=spec.moe_norm_topk, moe_gating=spec.moe_gating, moe_act=spec.moe_act, moe_bias=spec.moe_bias,
        attn_sinks=spec.sinks, out_bias=spec.out_bias, ffn_norm=spec.ffn_norm,
        fused_qkv="blk.0.attn_qkv.weight" in tensors, fused_up="blk.0.ffn_gate.weight" not in tensors
        and "blk.0.ffn_up.weight" in tensors,
        name=str(meta.get("general.name", "")), file_type=meta.get("general.file_type"),
    )


def yarn_attn_factor(freq_scale: np.float32, attn_factor: float) -> float:
    """llama_context's yarn_attn_factor for YaRN (float32 as it computes it): get_mscale(1 / freq_scale) =
    0.1 ln(factor) + 1, divided by the 1 + 0.1 ln(factor) that ggml's rope multiplies in again, times the file's
    rope.scaling.attn_factor."""
    f = np.float32
    factor = f(1.0) / f(freq_scale)
    ln = f(math.log(factor))
    m = f(f(0.1) * ln) + f(1.0) if factor > 1 else f(1.0)
    m = f(m * f(f(1.0) / f(f(1.0) + f(f(0.1) * ln))))
    return float(f(m * f(attn_factor)))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Row-major shapes of every tensor the forward pass reads (optional ones marked by the model)."""
    d, hd, vd = cfg.d_model, cfg.head_dim, cfg.v_head_dim
    shapes = {"token_embd.weight": (cfg.n_vocab, d), "output_norm.weight": (d,)}
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.n_vocab, d)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        q, k, v = cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * vd
        shapes[b + "attn_norm.weight"] = (d,)
        if cfg.fused_qkv:
            shapes[b + "attn_qkv.weight"] = (q + k + v, d)
        else:
            shapes |= {b + "attn_q.weight": (q, d), b + "attn_k.weight": (k, d), b + "attn_v.weight": (v, d)}
        shapes |= {b + "attn_output.weight": (d, cfg.n_heads * vd), b + f"{cfg.ffn_norm}.weight": (d,)}
        if cfg.out_bias:
            shapes[b + "attn_output.bias"] = (d,)
        if cfg.attn_sinks:
            shapes[b + "attn_sinks.weight"] = (cfg.n_heads,)
        e, fe = cfg.n_experts, cfg.d_ff_expert
        if e:  # router + 3-D expert tensors (n_expert, N, K)
            shapes |= {b + "ffn_gate_inp.weight": (e, d), b + "ffn_gate_exps.weight": (e, fe, d),
                       b + "ffn_up_exps.weight": (e, fe, d), b + "ffn_down_exps.weight": (e, d, fe)}
            if cfg.moe_bias:
                shapes |= {b + "ffn_gate_inp.bias": (e,), b + "ffn_gate_exps.bias": (e, fe),
                           b + "ffn_up_exps.bias": (e, fe), b + "ffn_down_exps.bias": (e, d)}
        elif cfg.fused_up:
            shapes |= {b + "ffn_up.weight": (2 * cfg.d_ff, d), b + "ffn_down.weight": (d, cfg.d_ff)}
        else:
            shapes |= {b + "ffn_gate.weight": (cfg.d_ff, d), b + "ffn_up.weight": (cfg.d_ff, d),
                       b + "ffn_down.weight": (d, cfg.d_ff)}
        if cfg.qk_norm:
            shapes |= {b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
        if cfg.gemma:
            shapes |= {b + "post_attention_norm.weight": (d,), b + "post_ffw_norm.weight": (d,)}
        if cfg.bias:
            shapes |= {b + "attn_q.bias": (cfg.n_heads * hd,), b + "attn_k.bias": (cfg.n_kv_heads * hd,),
                       b + "attn_v.bias": (cfg.n_kv_heads * vd,)}
    if cfg.rope_factors:
        shapes |= {f: ((cfg.n_rot or hd) // 2,) for f in cfg.rope_factors}
    return shapes


def validate_tensors(cfg: ModelConfig, tensors: dict[str, TensorInfo], path: str = "") -> None:
    """Every tensor the forward reads exists with the shape the config implies (else the file is corrupt)."""
    for name, shape in expected_shapes(cfg).items():
        t = tensors.get(name)
        if t is None:
            raise UnsupportedModelError(f"{path}: missing tensor {name!r} for {cfg.arch}")
        if tuple(t.shape) != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {t.shape}, the metadata implies {shape}")
        if t.qtype not in WEIGHT_TYPES:
            raise UnsupportedQuantTypeError(
                f"{path}: tensor {name!r} is {t.qtype.name}, which edgellm reads and quantizes to but cannot run yet "
                f"(no kernel); supported: {', '.join(sorted(q.name for q in WEIGHT_TYPES))}")


@dataclass
class LoadedModel:
    """A GGUF file opened for inference: config, metadata, raw file, and the architecture's module."""

    config: ModelConfig
    gguf: GGUFFile

    @property
    def metadata(self) -> dict[str, Any]:
        return self.gguf.metadata

    @property
    def path(self) -> str:
        return self.gguf.path

    def model_module(self):
        return importlib.import_module(f"edgellm.models.{ARCHS[self.config.arch].model}")


def load_gguf(path: str) -> LoadedModel:
    """Read, validate and describe a GGUF model file (weights stay memory-mapped, nothing is copied).

    Every metadata key edgellm reads is checked here, once (`metadata_schema`); `LoadedModel.metadata` holds the
    checked values the tokenizer and the chat template then use."""
    g = read_gguf(path)
    if "general.architecture" not in g.metadata:
        raise GGUFError(f"{path}: metadata has no general.architecture")
    g.metadata = check_metadata(g.metadata, g.tensors, path=path, archs=ARCHS)
    cfg = config_from_metadata(g.metadata, g.tensors, path)
    validate_tensors(cfg, g.tensors, path)
    return LoadedModel(cfg, g)
